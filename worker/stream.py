"""SGLang's streamed /generate answer (``"stream": true``), folded into the one body a
non-streamed request gets, so that the same checks apply to both. Pure, no I/O.

Why stream at all: a streamed request shows progress, so one that stops making any (a
lost connection, a stuck server, a drip) is caught within ``stall_timeout_s`` instead of
the hour-long request timeout. SGLang writes each chunk as ``data: <json>\\n\\n`` and ends
with ``data: [DONE]``; a chunk has the shape of a whole answer so far. Its ``output_ids``
are the ids since the previous chunk when the server runs with ``--stream-output``, else
all ids so far: both are read here, told apart by ``meta_info.completion_tokens``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from worker.retry import AttemptError, ErrorKind

DONE = b"[DONE]"


def events(
    chunks: Iterable[bytes],
    *,
    max_event_bytes: int,
    stall_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[bytes]:
    """The ``data:`` payloads of an event stream, each as soon as it is complete
    (`EventSplitter` on each chunk)."""
    splitter = EventSplitter(max_event_bytes=max_event_bytes, stall_s=stall_s, clock=clock)
    for chunk in chunks:
        yield from splitter.feed(chunk)


class EventSplitter:
    """Splits an event stream, fed as its bytes arrive, into its ``data:`` payloads.

    A stream that sends bytes but no complete event for ``stall_s`` (a drip) fails, and so
    does an event larger than ``max_event_bytes``; complete silence is the read timeout's.
    """

    def __init__(
        self, *, max_event_bytes: int, stall_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max = max_event_bytes
        self._stall_s = stall_s
        self._clock = clock
        self._pending = bytearray()
        self._last_event = clock()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads ``chunk`` completes."""
        pending = self._pending
        # Look for an event's end only in what is new (and the byte before it): an event that
        # arrives in many pieces is scanned once, not once per piece.
        start = max(len(pending) - 1, 0)
        pending += chunk
        found = []
        while (end := pending.find(b"\n\n", start)) >= 0:
            event = bytes(pending[:end])
            del pending[: end + 2]
            start = 0
            self._last_event = self._clock()
            if data := _data(event):
                found.append(data)
        if len(pending) > self._max:
            raise AttemptError(
                f"invalid response: a streamed chunk over max_response_bytes={self._max}",
                retryable=False,
                kind=ErrorKind.TOO_LARGE,
            )
        if self._clock() - self._last_event > self._stall_s:
            raise AttemptError(
                f"no streamed chunk for over {self._stall_s:g} s ({len(pending)} bytes of one "
                "so far): a stalled or dripping server",
                retryable=True,
                kind=ErrorKind.STALLED,
            )
        return found


def _data(event: bytes) -> bytes:
    """The payload of one event: its ``data:`` lines joined."""
    return b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))


class Assembler:
    """Folds streamed chunks into the body a non-streamed request would have received."""

    def __init__(self) -> None:
        self.output_ids: list[Any] = []
        self.last: dict[str, Any] | None = None
        self.done = False

    def add(self, data: bytes) -> None:
        """Take one event's payload."""
        if data.strip() == DONE:
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise AttemptError(
                "malformed JSON in a streamed chunk", retryable=True, kind=ErrorKind.MALFORMED
            ) from exc
        if not isinstance(chunk, dict):
            raise AttemptError(
                "invalid response: a streamed chunk is not an object",
                retryable=False,
                kind=ErrorKind.INVALID_RESPONSE,
            )
        if "error" in chunk:
            # What SGLang streams for a request it refuses (a 400 when not streamed).
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise AttemptError(
                f"server refused the request: {message}",
                retryable=False,
                kind=ErrorKind.HTTP_4XX,  # a 400 when not streamed
            )
        self._extend(chunk)
        self.last = chunk

    def _extend(self, chunk: dict[str, Any]) -> None:
        ids = chunk.get("output_ids")
        meta = chunk.get("meta_info")
        total = meta.get("completion_tokens") if isinstance(meta, dict) else None
        if not isinstance(ids, list) or type(total) is not int:
            raise AttemptError(
                "invalid response: a streamed chunk without output_ids or completion_tokens",
                retryable=False,
                kind=ErrorKind.INVALID_RESPONSE,
            )
        held = len(self.output_ids)
        if held + len(ids) == total:  # the ids since the last chunk (or the first chunk)
            self.output_ids.extend(ids)
        elif len(ids) == total and ids[:held] == self.output_ids:  # all ids so far
            self.output_ids = list(ids)
        else:
            raise AttemptError(
                f"invalid response: streamed output_ids ({held} so far, {len(ids)} in this "
                f"chunk) disagree with completion_tokens={total}",
                retryable=False,
                kind=ErrorKind.INVALID_RESPONSE,
            )

    def answer(self) -> dict[str, Any]:
        """The whole answer: the last chunk with every output id, once the stream ended."""
        if self.last is None or not self.done:
            raise AttemptError(
                "the stream ended before its last chunk ([DONE])",
                retryable=True,
                transport=True,
                kind=ErrorKind.CONNECTION,
            )
        return {**self.last, "output_ids": self.output_ids}
