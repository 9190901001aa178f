"""SGLang's raw ``/generate`` from an asyncio event loop (worker.loop): the answers of
`worker.sglang.SGLangClient`, and its errors, without a thread per request.

A minimal HTTP/1.1 client on asyncio streams, for the one request the loop sends: a POST
of JSON, whose answer comes with a Content-Length, in chunks, or up to the connection's end;
streamed, its events folded into one answer as they arrive (worker.stream).
Each request takes a kept-alive connection of the server's idle ones, or opens one; it goes
back only once its answer was read to the end and the server keeps it open. Every answer is
bounded in time (its head within ``timeout_s``, its body within ``stall_timeout_s`` after
the head, as the threaded client does) and in size (``max_response_bytes``, refused unread
when declared larger).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson

from core.settings import ServerSpec
from worker.retry import AttemptError, ErrorKind, classify_status, status_kind
from worker.sglang import (
    CONNECT_TIMEOUT_S,
    ERROR_BODY_BYTES,
    KEEPALIVE_EXPIRY_S,
    error_message,
    generate_payload,
    stalled,
    too_large,
    transport_failure,
)
from worker.stream import Assembler, EventSplitter

# A response's status line and headers; also asyncio's bound on one line of a chunked body.
HEAD_BYTES = 64 << 10
READ_BYTES = 64 << 10


class HttpAnswerError(Exception):
    """An answer that breaks HTTP/1.1 as this client reads it."""


class _Connection:
    """One kept-alive connection and when it was last idle."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.writer.close()


class AsyncSGLang:
    """Calls one server's raw ``/generate`` with token ids, from an event loop."""

    def __init__(
        self,
        server: ServerSpec,
        *,
        timeout_s: float,
        max_response_bytes: int = 64 << 20,
        stall_timeout_s: float = 300.0,
    ) -> None:
        self.server = server
        url = urlsplit(server.url)
        self._host = url.hostname or ""
        self._https = url.scheme == "https"
        self._port = url.port or (443 if self._https else 80)
        self._path = f"{url.path.rstrip('/')}/generate"
        self._timeout_s = timeout_s
        self._stall_s = stall_timeout_s
        self._max_bytes = max_response_bytes
        self._ssl = ssl.create_default_context() if self._https else None
        self._idle: list[_Connection] = []

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        stream: bool = False,
    ) -> Any:
        """POST /generate; the parsed answer, or AttemptError (retryable or not). Streamed
        (``stream``), the chunks folded into the one body a whole answer is
        (worker.stream), and silence past ``stall_timeout_s`` fails it."""
        payload = generate_payload(input_ids, sampling_params, rid)
        if stream:
            payload["stream"] = True
        connection = await self._connection()
        reusable = False
        try:
            status, answer, reusable = await self._exchange(
                connection, orjson.dumps(payload), stream
            )
        except (OSError, EOFError, HttpAnswerError, asyncio.LimitOverrunError) as exc:
            raise transport_failure(self.server.name, exc, transport_reason(exc)) from exc
        finally:
            if reusable:
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()
        if isinstance(answer, dict):  # streamed, folded and parsed already
            return answer
        if status != 200:
            raise AttemptError(
                f"{self.server.name}: HTTP {status}: {error_message(answer)}",
                retryable=classify_status(status),
                kind=status_kind(status),
            )
        try:
            return orjson.loads(answer)
        except orjson.JSONDecodeError as exc:
            raise AttemptError(
                f"{self.server.name}: malformed JSON body", retryable=True, kind=ErrorKind.MALFORMED
            ) from exc

    async def _connection(self) -> _Connection:
        """A kept connection not idle too long (below the server's keep-alive, so that it
        is never reused just as the server closes it), else a new one."""
        while self._idle:
            connection = self._idle.pop()
            if time.monotonic() - connection.idle_since < KEEPALIVE_EXPIRY_S:
                return connection
            connection.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                    limit=HEAD_BYTES,
                ),
                CONNECT_TIMEOUT_S,
            )
        except OSError as exc:
            raise transport_failure(self.server.name, exc, transport_reason(exc)) from exc
        return _Connection(reader, writer)

    async def _exchange(
        self, connection: _Connection, body: bytes, stream: bool
    ) -> tuple[int, bytes | dict[str, Any], bool]:
        """Send the request; the status, the body (an error's cut to ERROR_BODY_BYTES; a
        streamed answer folded) and whether the connection may be used again."""
        head = (
            f"POST {self._path} HTTP/1.1\r\nHost: {self._host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        connection.writer.write(head.encode() + body)
        await connection.writer.drain()
        # A streamed answer shows progress, so silence longer than a stall is one; a whole
        # answer's head comes only at the end of its generation (as the threaded client).
        wait = self._stall_s if stream else self._timeout_s
        raw = await asyncio.wait_for(connection.reader.readuntil(b"\r\n\r\n"), wait)
        status, version, headers = parse_head(raw)
        # HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 closes it.
        keep = version == "HTTP/1.1" and headers.get("connection", "") != "close"
        if stream and status == 200:
            folded = _Streamed(self._max_bytes, self._stall_s)
            whole = await _Body(connection.reader, folded.feed, read_timeout=self._stall_s).read(
                headers
            )
            return status, folded.answer(), keep and whole
        bound = self._max_bytes if status == 200 else ERROR_BODY_BYTES
        collect = _Collect(bound)
        read = _Body(connection.reader, collect, deadline=time.monotonic() + self._stall_s)
        try:
            whole = await read.read(headers, declared_bound=bound)
        except TimeoutError:
            raise stalled(self.server.name, self._stall_s, read.size) from None
        except _TooLarge as refused:
            if status == 200:  # an error body is only shown: its start is enough
                raise too_large(self.server.name, str(refused), self._max_bytes) from None
            return status, collect.body(), False
        return status, collect.body(), keep and whole

    def close(self) -> None:
        """Close the kept connections."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def transport_reason(exc: BaseException) -> str:
    """A transport failure as the threaded client (``http.client``) names the same one, so
    that a job's last error reads alike on either engine."""
    if isinstance(exc, asyncio.IncompleteReadError):
        if not exc.partial and exc.expected is None:  # not a byte of the answer's head
            return "RemoteDisconnected: Remote end closed connection without response"
        return f"IncompleteRead: {len(exc.partial)} bytes read, the connection closed"
    if isinstance(exc, TimeoutError) and not str(exc):  # asyncio's says nothing
        return "TimeoutError: timed out"
    return f"{type(exc).__name__}: {exc}"


def parse_head(raw: bytes) -> tuple[int, str, dict[str, str]]:
    """The status code, the HTTP version and the headers (names and the values that are
    tokens in lower case) of a response's head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpAnswerError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    for token in ("connection", "transfer-encoding"):
        if token in headers:
            headers[token] = headers[token].lower()
    return int(parts[1]), parts[0], headers


class _TooLarge(Exception):
    """A body past its bound; ``start``: what was read of it."""

    def __init__(self, what: str, start: bytes) -> None:
        super().__init__(what)
        self.start = start


class _Collect:
    """A body kept whole, up to ``bound`` bytes (_TooLarge past it)."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._chunks: list[bytes] = []
        self._size = 0

    def __call__(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._bound:
            raise _TooLarge(f"went past {self._bound} bytes", self.body())
        self._chunks.append(data)

    def body(self) -> bytes:
        return b"".join(self._chunks)


class _Streamed:
    """A streamed answer's bytes, split into events and folded as they arrive."""

    def __init__(self, max_bytes: int, stall_s: float) -> None:
        self._events = EventSplitter(max_event_bytes=max_bytes, stall_s=stall_s)
        self._assembler = Assembler()

    def feed(self, data: bytes) -> None:
        for event in self._events.feed(data):
            if not self._assembler.done:  # what follows [DONE] is read, not taken
                self._assembler.add(event)

    def answer(self) -> dict[str, Any]:
        return self._assembler.answer()


class _Body:
    """A response body, each piece handed to ``sink`` as it arrives, read by its
    Content-Length, in chunks, or until the server closes the connection; within a
    ``deadline`` for the whole, or ``read_timeout`` for each read (TimeoutError past
    either)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        sink: Callable[[bytes], None],
        *,
        deadline: float | None = None,
        read_timeout: float | None = None,
    ) -> None:
        self._reader = reader
        self._sink = sink
        self._deadline = deadline
        self._read_timeout = read_timeout
        self.size = 0

    async def read(self, headers: dict[str, str], declared_bound: int | None = None) -> bool:
        """Read the body to its end; whether the connection may carry another request.
        A Content-Length over ``declared_bound`` is refused unread (_TooLarge)."""
        if headers.get("transfer-encoding") == "chunked":
            await self._chunked()
            return True
        declared = headers.get("content-length", "")
        if declared.isdigit():
            if declared_bound is not None and int(declared) > declared_bound:
                raise _TooLarge(f"declares {declared} bytes", b"")
            await self._exactly(int(declared))
            return True
        while await self._some():  # no length: the body ends when the connection does
            pass
        return False

    async def _wait(self, read: Any) -> Any:
        timeout = self._read_timeout
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return await asyncio.wait_for(read, timeout)

    def _add(self, data: bytes) -> None:
        self.size += len(data)
        self._sink(data)

    async def _some(self) -> bool:
        data: bytes = await self._wait(self._reader.read(READ_BYTES))
        if data:
            self._add(data)
        return bool(data)

    async def _exactly(self, size: int) -> None:
        end = self.size + size
        while self.size < end:
            data: bytes = await self._wait(self._reader.read(min(READ_BYTES, end - self.size)))
            if not data:
                raise asyncio.IncompleteReadError(b"", end - self.size)
            self._add(data)

    async def _chunked(self) -> None:
        while True:
            line: bytes = await self._wait(self._reader.readuntil(b"\r\n"))
            try:
                length = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpAnswerError(f"a bad chunk size line: {line[:40]!r}") from None
            if length == 0:
                while await self._wait(self._reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return
            await self._exactly(length)
            if await self._wait(self._reader.readexactly(2)) != b"\r\n":
                raise HttpAnswerError("a chunk not ended by CRLF")
