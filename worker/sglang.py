"""The SGLang client: per server, one HTTP/1.1 connection per worker thread.

Generations go out on the standard library's ``http.client``: a generation is one POST of
JSON on a kept-alive connection, and httpx's layers around that cost the worker more of
its one core per job than anything but the database (BENCHMARKS.md, "Orchestration
ceiling"). Probes and metrics reads, a few a minute, stay on httpx, each bounded in size and
in total time (core.bounded).

One connection per thread, never a pool shared by threads: httpcore's shared pool could
close a connection it had just handed to another thread's request (encode/httpcore#1110),
which then waited for an answer on a closed socket until its read timeout, an hour for a
generation (seen here at 600 requests in flight: BENCHMARKS.md, "Hung requests"). A
connection only its own thread uses has no such race.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from core import bounded, sampling
from core.settings import ServerSpec
from worker.retry import AttemptError, ErrorKind, classify_status, status_kind
from worker.stream import Assembler, events

# A kept connection idle this long is closed, not reused: below the server's keep-alive
# (uvicorn, so SGLang: 5 s), so that it is never reused just as the server closes it.
KEEPALIVE_EXPIRY_S = 2.0
CONNECT_TIMEOUT_S = 10.0
# An error body is shown, not stored: its first bytes say enough.
ERROR_BODY_BYTES = 64 << 10
READ_BYTES = 64 << 10


class SGLangClient:
    """Calls one server's raw ``/generate`` with token ids."""

    def __init__(
        self,
        server: ServerSpec,
        *,
        timeout_s: float,
        max_response_bytes: int = 64 << 20,
        stall_timeout_s: float = 300.0,
        stream: bool | None = False,
    ) -> None:
        self.server = server
        url = urlsplit(server.url)
        self._address = (url.hostname or "", url.port)
        self._https = url.scheme == "https"
        self._path = f"{url.path.rstrip('/')}/generate"
        self._timeout_s = timeout_s
        # None: decided by `adopt_streaming` once the server said how it streams.
        self.stream_choice = stream
        self._stream = bool(stream)
        self._max_bytes = max_response_bytes
        self._stall_s = stall_timeout_s
        # One context for every thread's connection (each would load the CA bundle else).
        self._ssl = ssl.create_default_context() if self._https else None
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._open_lock = threading.Lock()
        # Probes must not queue behind generations for a connection: a worker busy on
        # every thread would time its probe out and call a healthy server down.
        self._probe = bounded.client(server.url, max_connections=2)

    @property
    def streaming(self) -> bool:
        """Whether answers are asked for streamed."""
        return self._stream

    def adopt_streaming(self, incremental: bool) -> bool:
        """With the choice left to the server (``stream`` None): stream when it streams
        incrementally; whether that changed anything."""
        if self.stream_choice is not None or self._stream == incremental:
            return False
        self._stream = incremental
        return True

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], rid: str) -> Any:
        """POST /generate; raise AttemptError (retryable or not) on any failure."""
        payload = generate_payload(input_ids, sampling_params, rid)
        streamed = self._stream
        if streamed:
            payload["stream"] = True
        # A streamed answer shows progress, so silence longer than a stall is one; a whole
        # answer comes only at the end of its generation, after up to request_timeout_s.
        timeout = self._stall_s if streamed else self._timeout_s
        connection = self._connection()
        response: http.client.HTTPResponse | None = None
        reusable = False
        try:
            response = self._post(connection, json.dumps(payload).encode(), timeout)
            if response.status != 200:
                raise AttemptError(
                    f"{self.server.name}: HTTP {response.status}: "
                    f"{error_message(response.read(ERROR_BODY_BYTES))}",
                    retryable=classify_status(response.status),
                    kind=status_kind(response.status),
                )
            answer: dict[str, Any] | bytes = (
                self._streamed(response) if streamed else self._body(response)
            )
            # Kept only once its answer was read to the end (a stream left at [DONE] may
            # still hold its last chunk) and the server keeps it open.
            reusable = response.isclosed() and not response.will_close
        except (OSError, http.client.HTTPException) as exc:
            raise transport_failure(self.server.name, exc, f"{type(exc).__name__}: {exc}") from exc
        finally:
            if reusable:
                self._local.idle_since = time.monotonic()
            else:
                if response is not None:  # a Connection: close answer owns the socket
                    response.close()
                self._drop(connection)
        if isinstance(answer, dict):  # streamed, already folded and parsed
            return answer
        try:
            return json.loads(answer)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise AttemptError(
                f"{self.server.name}: malformed JSON body", retryable=True, kind=ErrorKind.MALFORMED
            ) from exc

    def _post(
        self, connection: http.client.HTTPConnection, body: bytes, timeout_s: float
    ) -> http.client.HTTPResponse:
        """Send the request and wait up to ``timeout_s`` for the response's headers (and as
        long for each read after them)."""
        if connection.sock is None:
            connection.connect()  # within CONNECT_TIMEOUT_S
        connection.sock.settimeout(timeout_s)
        connection.request("POST", self._path, body, {"Content-Type": "application/json"})
        return connection.getresponse()

    def _streamed(self, response: http.client.HTTPResponse) -> dict[str, Any]:
        """A streamed answer folded into one body (worker.stream)."""
        assembler = Assembler()
        chunks = iter(lambda: response.read1(READ_BYTES), b"")
        for data in events(chunks, max_event_bytes=self._max_bytes, stall_s=self._stall_s):
            assembler.add(data)
            if assembler.done:
                break
        return assembler.answer()

    def _body(self, response: http.client.HTTPResponse) -> bytes:
        """The whole body, refused past ``max_response_bytes`` without reading the rest,
        and once it takes longer than ``stall_timeout_s`` to arrive: SGLang writes its
        answer at once, so a body that trickles in is a stuck or hostile server, which the
        hour-long read timeout (reset by every byte) would not catch."""
        declared = response.getheader("content-length", "")
        if declared.isdigit() and int(declared) > self._max_bytes:
            raise too_large(self.server.name, f"declares {declared} bytes", self._max_bytes)
        deadline = time.monotonic() + self._stall_s
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(READ_BYTES):
            size += len(chunk)
            if size > self._max_bytes:
                raise too_large(
                    self.server.name, f"went past {self._max_bytes} bytes", self._max_bytes
                )
            if time.monotonic() > deadline:
                raise stalled(self.server.name, self._stall_s, size)
            chunks.append(chunk)
        response.read()  # nothing is left: this marks the response read to its end
        return b"".join(chunks)

    def get(self, path: str, timeout_s: float) -> httpx.Response:
        """A GET on the server (health probes, metrics), on its own small pool: its answer
        read whole within ``timeout_s`` and the path's size cap, else `bounded.AnswerRefused`
        (an httpx.HTTPError)."""
        return bounded.get(self._probe, path, timeout_s)

    def _connection(self) -> http.client.HTTPConnection:
        """This thread's connection: the kept one unless idle too long, else a new one
        (connected when the request is sent)."""
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
            if time.monotonic() - self._local.idle_since < KEEPALIVE_EXPIRY_S:
                return connection
            self._drop(connection)
        host, port = self._address
        if self._https:
            connection = http.client.HTTPSConnection(
                host, port, timeout=CONNECT_TIMEOUT_S, context=self._ssl
            )
        else:
            connection = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
        self._local.connection = connection
        with self._open_lock:
            self._open.add(connection)
        return connection

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        """Close a connection that is not to be used again."""
        connection.close()
        if getattr(self._local, "connection", None) is connection:
            self._local.connection = None
        with self._open_lock:
            self._open.discard(connection)

    def close(self) -> None:
        """Close every thread's connection and the probes'."""
        with self._open_lock:
            connections, self._open = self._open, set()
        for connection in connections:
            connection.close()
        self._probe.close()


def transport_failure(server: str, exc: BaseException, reason: str) -> AttemptError:
    """A request whose connection failed: retryable, and a sign about the server."""
    return AttemptError(
        f"{server}: {reason}",
        retryable=True,
        transport=True,
        kind=ErrorKind.TIMEOUT if isinstance(exc, TimeoutError) else ErrorKind.CONNECTION,
    )


def stalled(server: str, stall_s: float, size: int) -> AttemptError:
    """A whole answer whose body did not arrive within ``stall_s`` of its headers (SGLang
    writes it at once: a stuck or dripping server)."""
    return AttemptError(
        f"{server}: the answer took over {stall_s:g} s to arrive after its headers ({size} "
        "bytes so far): a stalled or dripping server",
        retryable=True,
        kind=ErrorKind.STALLED,
    )


def too_large(server: str, what: str, max_bytes: int) -> AttemptError:
    """A body refused unread: no answer to a request is legally that large."""
    return AttemptError(
        f"invalid response: {server}: body {what}, over max_response_bytes={max_bytes}",
        retryable=False,
        kind=ErrorKind.TOO_LARGE,
    )


def generate_payload(
    input_ids: Sequence[int], sampling_params: dict[str, Any], rid: str
) -> dict[str, Any]:
    """The body of a raw ``/generate`` request (not streamed); AttemptError, not retryable,
    for stored params SGLang must not get (a database edited by hand)."""
    refused = sampling.unsendable(sampling_params)
    if refused:
        raise AttemptError(
            f"sampling params SGLang must not get: {refused}",
            retryable=False,
            kind=ErrorKind.INVALID_REQUEST,
        )
    return {"input_ids": list(input_ids), "sampling_params": sampling_params, "rid": rid}


def error_message(raw: bytes) -> str:
    """SGLang's error message from an error body, or the body's start."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]
