"""Dropping a connection with no HTTP answer, which ASGI itself cannot express.

uvicorn never shows the app its transport, so the simulator serves with a subclass of uvicorn's
h11 protocol that puts each connection's transport into the request scope's extensions; a
handler then aborts it, and the client sees the socket close before any response byte.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable
from uvicorn._types import Scope as UvicornScope
from uvicorn.protocols.http.h11_impl import H11Protocol

# ASGI extension key under which each request finds {"transport": asyncio.Transport}.
TRANSPORT_EXTENSION = "eaglegen.sim.transport"


class DroppableH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that hands every request its connection's transport."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Wrap the app for this connection (one protocol instance per connection)."""
        super().connection_made(transport)
        self.app = _with_transport(self.app, transport)


def _with_transport(app: ASGI3Application, transport: asyncio.Transport) -> ASGI3Application:
    """The app, with the transport added to every HTTP scope's extensions."""

    async def app_with_transport(
        scope: UvicornScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            extensions = scope.setdefault("extensions", {})
            extensions[TRANSPORT_EXTENSION] = {"transport": transport}
        await app(scope, receive, send)

    return app_with_transport


class NoAnswer(Response):
    """A handler's result when the connection is already gone: sends nothing."""

    def __init__(self) -> None:
        """No status, headers or body to keep."""
        super().__init__(status_code=499)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send nothing: there is no one to send it to."""


async def drop(request: Request) -> NoAnswer:
    """Abort the request's TCP connection without answering; return once uvicorn noticed."""
    extension = request.scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {})
    transport = extension.get("transport")
    if not isinstance(transport, asyncio.Transport):
        raise RuntimeError("dropping a connection needs the simulator's uvicorn protocol")
    # abort() discards anything buffered and closes the socket; no response byte was written.
    transport.abort()
    # uvicorn learns of the loss a loop turn later; waiting for it keeps uvicorn from logging
    # "returned without starting response" and sending a 500 into the closed socket.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    return NoAnswer()
