"""Streamed /generate answers (`"stream": true`), as SGLang's http_server sends them.

The body is `text/event-stream`: one `data: <json>\\n\\n` event per chunk, each with the shape of
a non-streamed answer (`text`, `output_ids`, `meta_info`), `finish_reason` null until the last
chunk (which alone has `e2e_latency`), then `data: [DONE]\\n\\n`. By default `text` and
`output_ids` are everything so far; with `--incremental-streaming-output` only what is new.
A batch streams each prompt's chunks as they come, each with its `index` in the batch. An error
SGLang raises while streaming becomes `data: {"error": {"message": ...}}` before `[DONE]`, in a
200 response; a request the scheduler refuses (queue full) ends with an abort finish_reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from eaglegen.sim.engine import Completion, Finish
from eaglegen.sim.protocol import (
    GenerateItem,
    GenerateRequest,
    leak,
    result_body,
    strip_special,
    stripped,
)
from eaglegen.sim.service import SimService, StreamWatch

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
QUEUE_FULL = "The request queue is full."


def sse(payload: object) -> bytes:
    """One event as SGLang writes it (orjson, then a blank line)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream(StreamingResponse):
    """A `text/event-stream` response that runs on_close however it ends (a client that
    leaves mid-stream cancels the body, which may be parked at a yield and never resumed)."""

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None
    ) -> None:
        """Stream these events."""
        super().__init__(events, media_type=MEDIA_TYPE)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the events; clean up afterwards, even when cancelled."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                self._on_close()


def error_stream(message: str) -> EventStream:
    """The 200 stream SGLang sends when the request fails once streaming has begun."""

    async def events() -> AsyncIterator[bytes]:
        yield sse({"error": {"message": message}})
        yield DONE

    return EventStream(events())


def queue_full_stream(parsed: GenerateRequest, started: float) -> EventStream:
    """Every prompt aborted by the scheduler's --max-queued-requests, as SGLang streams it."""
    finish = Finish("abort", message=QUEUE_FULL, status_code=503)

    async def events() -> AsyncIterator[bytes]:
        for index, item in enumerate(parsed.items):
            body = result_body(
                item,
                [],
                text="",
                finish=finish,
                completion_tokens=0,
                cached_tokens=0,
                e2e_latency=time.perf_counter() - started,
            )
            yield sse(_indexed(body, index if parsed.is_batch else None))
        yield DONE

    return EventStream(events())


class IncrementalText:
    """SGLang's incremental detokenization: the text grows by whole characters only, each step
    decoding a short window of ids instead of everything so far."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        """No text yet."""
        self.text = ""
        self._decode = decode
        # ids[surr:read] is context already in the text; ids[read:] is not in it yet.
        self._surr = 0
        self._read = 0

    def advance(self, ids: Sequence[int], end: int) -> str:
        """Take in ids[:end]; the new text, empty while it ends inside a character."""
        if end <= self._read:
            return ""
        known = self._decode(list(ids[self._surr : self._read]))
        text = self._decode(list(ids[self._surr : end]))
        if len(text) <= len(known) or text.endswith("\ufffd"):
            return ""
        delta = text[len(known) :]
        self._surr, self._read = self._read, end
        self.text += delta
        return delta

    def finish(self, final: str) -> str:
        """End with the whole answer's text (stop token trimmed); what it adds to the text."""
        delta = final[len(self.text) :] if final.startswith(self.text) else final
        self.text = final
        return delta


@dataclass(frozen=True)
class StreamOptions:
    """What shapes one streamed call's chunks."""

    incremental: bool
    leak_prompt_tokens: int
    # Special ids left out of output_ids (the strip_special_tokens fault); empty keeps all.
    strip: frozenset[int] = frozenset()
    # Data chunks sent before the stream goes silent (the stall fault); None never stalls.
    stall_after: int | None = None


class _ItemStream:
    """The chunks of one prompt of a streamed call."""

    def __init__(
        self,
        service: SimService,
        item: GenerateItem,
        watch: StreamWatch,
        index: int | None,
        options: StreamOptions,
    ) -> None:
        """Nothing sent yet."""
        self.service = service
        self.item = item
        self.watch = watch
        self.index = index
        self.options = options
        self.text = IncrementalText(self._decode)
        self.sent = 0
        # output_ids sent so far (fewer than the tokens when special tokens are stripped).
        self.shown = 0
        self.chunks = 0
        self.done = False

    def _decode(self, ids: list[int]) -> str:
        """Text of ids with this prompt's detokenizer options."""
        return self.service.decode(ids, self.item.text_options.skip_special_tokens)

    def _ids(self, ids: list[int], finished: bool) -> list[int]:
        """The output ids released so far, as this call sends them."""
        if not self.options.strip:
            return ids
        final_stop = finished and self.watch.job.completion.finish.type == "stop"
        return strip_special(ids, self.options.strip, final_stop)

    def _final(self) -> Completion:
        """The whole answer as this call sends it."""
        completion = self.watch.job.completion
        return stripped(completion, self.options.strip) if self.options.strip else completion

    def pending(self) -> bool:
        """Whether the scheduler released a chunk this stream has not sent."""
        return not self.done and (self.watch.finished or self.watch.ready > self.sent)

    def chunk(self, started: float) -> dict[str, Any]:
        """The next chunk, covering every token released so far."""
        watch, completion = self.watch, self.watch.job.completion
        ids = self._ids(completion.output_ids[: watch.ready], watch.finished)
        if watch.finished:
            delta = self.text.finish(self.service.text(self._final(), self.item))
        else:
            delta = self.text.advance(ids, len(ids))
        incremental = self.options.incremental
        out = ids[self.shown :] if incremental else ids
        if self.sent == 0 or not incremental:
            out = leak(out, self.item.input_ids, self.options.leak_prompt_tokens)
        body = result_body(
            self.item,
            out,
            text=delta if incremental else self.text.text,
            finish=completion.finish if watch.finished else None,
            completion_tokens=len(ids),
            cached_tokens=watch.job.cached_tokens,
            e2e_latency=time.perf_counter() - started if watch.finished else None,
            retractions=watch.job.retractions,
        )
        self.sent, self.shown, self.done = watch.ready, len(ids), watch.finished
        self.chunks += 1
        return _indexed(body, self.index)


def stream_response(
    service: SimService,
    parsed: GenerateRequest,
    watches: list[StreamWatch],
    started: float,
    options: StreamOptions,
) -> EventStream:
    """The event stream of watched jobs; they are aborted if the client leaves early."""
    streams = [
        _ItemStream(service, item, watch, i if parsed.is_batch else None, options)
        for i, (item, watch) in enumerate(zip(parsed.items, watches, strict=True))
    ]
    events = _events(service, parsed, streams, started, options)
    return EventStream(events, on_close=lambda: service.release(watches))


async def _events(
    service: SimService,
    parsed: GenerateRequest,
    streams: list[_ItemStream],
    started: float,
    options: StreamOptions,
) -> AsyncIterator[bytes]:
    """Send each chunk as the scheduler releases it, then [DONE]."""
    wake = streams[0].watch.wake
    sent = 0
    live = streams
    while live:
        await wake.wait()
        # Cleared before looking, so a chunk released while this one is sent wakes us again.
        wake.clear()
        for stream in live:
            if stream.watch.error is not None:
                yield sse({"error": {"message": stream.watch.error}})
                yield DONE
                return
            if not stream.pending():
                continue
            if options.stall_after is not None and sent >= options.stall_after:
                await _hold()
            chunk = stream.chunk(started)
            _count(service, stream, chunk, parsed.log_metrics)
            yield sse(chunk)
            sent += 1
        live = [stream for stream in live if not stream.done]
    if options.stall_after is not None and sent >= options.stall_after:
        await _hold()
    yield DONE


def _count(
    service: SimService, stream: _ItemStream, chunk: dict[str, Any], log_metrics: bool
) -> None:
    """Tally a chunk just built: a leak on a prompt's first chunk, the rest on its last."""
    stats = service.faults.stats
    if stream.chunks == 1 and stream.options.leak_prompt_tokens:
        stats.leaked += 1
    if stream.chunks == 1 and stream.options.strip:
        stats.stripped += 1
    if stream.done:
        if stream.watch.job.completion.broken_tool_args:
            stats.broken_tool_args += 1
        if log_metrics:
            service.e2e.observe(chunk["meta_info"]["e2e_latency"])


async def _hold() -> None:
    """Keep the connection open and silent until the client goes away (which cancels us)."""
    await asyncio.Event().wait()


def _indexed(body: dict[str, Any], index: int | None) -> dict[str, Any]:
    """A batch's chunk carries its prompt's position in the batch, as in SGLang."""
    if index is not None:
        body["index"] = index
    return body
