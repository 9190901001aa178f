"""The SGLang client: per server, one ``httpx.Client`` of one connection per worker thread.

Not one pool shared by all threads: httpcore's pool can close a connection it has just
handed to another thread's request (encode/httpcore#1110); the request then waits for an
answer on a closed socket until its read timeout, which for a generation is an hour. Seen
here as a job `running` for good at 600 requests in flight (BENCHMARKS.md, "Hung
requests"). A pool used by one thread only has no such race.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from core import sampling
from core.settings import ServerSpec
from worker.retry import AttemptError, ErrorKind, classify_status, status_kind
from worker.stream import Assembler, events

KEEPALIVE_EXPIRY_S = 2.0
# An error body is shown, not stored: its first bytes say enough.
ERROR_BODY_BYTES = 64 << 10


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
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._stall_timeout = httpx.Timeout(stall_timeout_s, connect=10.0)
        # None: decided by `adopt_streaming` once the server said how it streams.
        self.stream_choice = stream
        self._stream = bool(stream)
        self._max_bytes = max_response_bytes
        self._stall_s = stall_timeout_s
        # One context for every thread's client (each would load the CA bundle otherwise).
        self._ssl = ssl.create_default_context()
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()
        # Probes must not queue behind generations for a connection: a worker busy on
        # every thread would time its probe out and call a healthy server down.
        self._probe = httpx.Client(
            base_url=server.url, timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=2)
        )

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
        refused = sampling.unsendable(sampling_params)
        if refused:
            raise AttemptError(
                f"sampling params SGLang must not get: {refused}",
                retryable=False,
                kind=ErrorKind.INVALID_REQUEST,
            )
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "rid": rid,
        }
        streamed = self._stream
        if streamed:
            payload["stream"] = True
        # A streamed answer shows progress, so silence longer than a stall is one; a whole
        # answer comes only at the end of its generation, after up to request_timeout_s.
        timeout = self._stall_timeout if streamed else self._timeout
        try:
            with self._thread_client().stream(
                "POST", "/generate", json=payload, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    raise AttemptError(
                        f"{self.server.name}: HTTP {response.status_code}: "
                        f"{_error_message(_head(response))}",
                        retryable=classify_status(response.status_code),
                        kind=status_kind(response.status_code),
                    )
                if streamed:
                    return self._streamed(response)
                raw = self._body(response)
        except httpx.TransportError as exc:
            raise AttemptError(
                f"{self.server.name}: {type(exc).__name__}: {exc}",
                retryable=True,
                transport=True,
                kind=(
                    ErrorKind.TIMEOUT
                    if isinstance(exc, httpx.TimeoutException)
                    else ErrorKind.CONNECTION
                ),
            ) from exc
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise AttemptError(
                f"{self.server.name}: malformed JSON body", retryable=True, kind=ErrorKind.MALFORMED
            ) from exc

    def _streamed(self, response: httpx.Response) -> dict[str, Any]:
        """A streamed answer folded into one body (worker.stream)."""
        assembler = Assembler()
        chunks = response.iter_bytes()
        for data in events(chunks, max_event_bytes=self._max_bytes, stall_s=self._stall_s):
            assembler.add(data)
            if assembler.done:
                break
        return assembler.answer()

    def _body(self, response: httpx.Response) -> bytes:
        """The whole body, refused past ``max_response_bytes`` without reading the rest,
        and once it takes longer than ``stall_timeout_s`` to arrive: SGLang writes its
        answer at once, so a body that trickles in is a stuck or hostile server, which the
        hour-long read timeout (reset by every byte) would not catch."""
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_bytes:
            raise self._too_large(f"declares {declared} bytes")
        deadline = time.monotonic() + self._stall_s
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > self._max_bytes:
                raise self._too_large(f"went past {self._max_bytes} bytes")
            if time.monotonic() > deadline:
                raise AttemptError(
                    f"{self.server.name}: the answer took over {self._stall_s:g} s to arrive "
                    f"after its headers ({size} bytes so far): a stalled or dripping server",
                    retryable=True,
                    kind=ErrorKind.STALLED,
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, what: str) -> AttemptError:
        """The body is refused unread (no answer to a request is legally that large)."""
        return AttemptError(
            f"invalid response: {self.server.name}: body {what}, over max_response_bytes="
            f"{self._max_bytes}",
            retryable=False,
            kind=ErrorKind.TOO_LARGE,
        )

    def get(self, path: str, timeout_s: float) -> httpx.Response:
        """A GET on the server (health probes, metrics), on its own small pool."""
        return self._probe.get(path, timeout=timeout_s)

    def _thread_client(self) -> httpx.Client:
        """This thread's client (built on its first request): one connection, kept alive."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(
                base_url=self.server.url,
                timeout=self._timeout,
                verify=self._ssl,
                limits=httpx.Limits(
                    max_connections=1,
                    max_keepalive_connections=1,
                    # Below the server's keep-alive (uvicorn, so SGLang: 5 s), so that a
                    # kept connection is never reused just as the server closes it.
                    keepalive_expiry=KEEPALIVE_EXPIRY_S,
                ),
            )
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        """Close every thread's connection and the probes'."""
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self._probe.close()


def _head(response: httpx.Response) -> bytes:
    """The first ERROR_BODY_BYTES of a body; the rest is not read."""
    head = bytearray()
    for chunk in response.iter_bytes():
        head += chunk
        if len(head) >= ERROR_BODY_BYTES:
            break
    return bytes(head[:ERROR_BODY_BYTES])


def _error_message(raw: bytes) -> str:
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
