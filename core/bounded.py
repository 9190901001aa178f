"""Calls to a server with a size cap and a total deadline: the one way this code reads a
server's answer over httpx (the worker's probes and metrics, `eaglegen doctor`).

httpx's timeouts are per socket operation: a server that sends a byte before each read times
out starts the next read's timeout afresh, so a server dripping a byte every few seconds holds
a call forever (headers included); and a body is read whole, so a 400 MB ``/metrics`` is
400 MB in memory (issue 27). Here every socket operation of a call (connect, TLS, each write
and read) may take only what is left of the call's deadline, and the body is read in chunks
that stop at its cap.

The errors are `httpx.HTTPError`s, so a caller that handles httpx's handles these too; their
message is one line that names the path: "/metrics: answer over 4 MiB".
"""

from __future__ import annotations

import contextvars
import ssl
import time
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

KIB = 1 << 10
MIB = 1 << 20
# Each a generous multiple of what SGLang sends: its /metrics is tens of KB per data-parallel
# rank with every histogram, its server info ~10 KB (every server argument), its model info
# and health answers a few hundred bytes at most.
CAPS: dict[str, int] = {
    "/metrics": 4 * MIB,
    "/get_model_info": 1 * MIB,
    "/get_server_info": 1 * MIB,
    "/health": 64 * KIB,
    "/health_generate": 64 * KIB,
}
DEFAULT_CAP = 1 * MIB

# The deadline (time.monotonic) of the call running in this thread; None outside one.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "eaglegen_bounded_deadline", default=None
)


class AnswerRefused(httpx.HTTPError):
    """A server's answer that was not read to its end: too large or too slow."""


class AnswerTooLarge(AnswerRefused):
    """The answer went past its cap (or declared a length past it); ``received``: the bytes
    of its body read before it was refused."""

    def __init__(self, message: str, received: int) -> None:
        super().__init__(message)
        self.received = received


class AnswerTooSlow(AnswerRefused):
    """The whole answer did not arrive within the call's deadline."""


def cap_for(path: str) -> int:
    """The size cap of an answer to a GET of ``path``."""
    return CAPS.get(path.split("?", 1)[0], DEFAULT_CAP)


def client(base_url: str, *, max_connections: int = 2) -> httpx.Client:
    """A client for `get` and `request` on one server. No proxy from the environment: the
    worker's generations go straight to the server (http.client), and so do its probes."""
    return httpx.Client(
        base_url=base_url.rstrip("/"),
        transport=_Transport(max_connections),
        trust_env=False,
    )


def get(
    http: httpx.Client, path: str, deadline_s: float, max_bytes: int | None = None
) -> httpx.Response:
    """GET ``path``: the response with its body read (at most ``max_bytes``, by default the
    path's cap) within ``deadline_s`` from the start of the call to its last byte."""
    return request(http, "GET", path, deadline_s, cap_for(path) if max_bytes is None else max_bytes)


def request(
    http: httpx.Client,
    method: str,
    path: str,
    deadline_s: float,
    max_bytes: int,
    *,
    json: Any = None,
) -> httpx.Response:
    """One request with its answer read whole, within ``deadline_s`` and ``max_bytes``;
    AnswerTooSlow or AnswerTooLarge otherwise (any other failure is httpx's own error)."""
    token = _DEADLINE.set(time.monotonic() + deadline_s)
    try:
        with http.stream(
            method,
            path,
            json=json,
            timeout=deadline_s,
            # An encoded body would be decoded whole from each chunk: a compression bomb.
            headers={"Accept-Encoding": "identity"},
        ) as response:
            body = _body(response, path, max_bytes)
    except httpx.TimeoutException as exc:
        # Every operation had only the deadline's rest: any timeout is the deadline's.
        raise AnswerTooSlow(f"{path}: no full answer within {deadline_s:g} s") from exc
    finally:
        _DEADLINE.reset(token)
    return httpx.Response(
        response.status_code, headers=response.headers, content=body, request=response.request
    )


def _body(response: httpx.Response, path: str, max_bytes: int) -> bytes:
    """The body, read up to ``max_bytes`` and no further."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise AnswerTooLarge(
            f"{path}: answer of {declared} bytes declared, over {size(max_bytes)}", 0
        )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise AnswerRefused(f"{path}: answer encoded as {encoding!r}, though none was accepted")
    chunks: list[bytes] = []
    received = 0
    for chunk in response.iter_raw():
        received += len(chunk)
        if received > max_bytes:
            raise AnswerTooLarge(f"{path}: answer over {size(max_bytes)}", received)
        chunks.append(chunk)
    return b"".join(chunks)


def size(n: int) -> str:
    """A byte count as people write it: 4 MiB, 64 KiB, 100 bytes."""
    for unit, name in ((MIB, "MiB"), (KIB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} bytes"


# --- the deadline at every socket operation -----------------------------------------------


def _left(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """An operation's timeout, cut to what is left of this thread's call, if in one."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A connection whose every operation ends by the deadline of the call using it."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """httpcore's own sockets, each wrapped in a `_Stream`."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_tcp(host, port, left, local_address, socket_options))

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _Transport(httpx.HTTPTransport):
    """httpx's transport (its request and error mapping) over a pool on `_Backend`."""

    def __init__(self, max_connections: int) -> None:
        super().__init__(trust_env=False)
        # httpx has no argument for the network backend; its pool is swapped for one that
        # has it (HTTP/1.1, no proxy). Idle connections close after 2 s, before uvicorn's
        # (so SGLang's) 5 s keep-alive could close one as it is reused (worker.sglang).
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl.create_default_context(),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=2.0,
            network_backend=_Backend(),
        )
