"""Runtime state of one simulator: the scheduler, the tokenizer and the task driving the steps.

Handlers hand jobs to the service and wait: a non-streamed call for its jobs to finish, a
streamed one for each chunk SGLang's scheduler would send (`StreamWatch`), so a stream's chunks
go out as the simulated decode produces its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from eaglegen.sim import metrics
from eaglegen.sim.config import SimConfig
from eaglegen.sim.engine import (
    Completion,
    OutputShape,
    ThroughputMeter,
    generate,
    stream_due,
)
from eaglegen.sim.faults import FaultInjector
from eaglegen.sim.forward import EngineTime, begin_pass, end_pass
from eaglegen.sim.protocol import GenerateItem, Limits, ids_for_text
from eaglegen.sim.scheduler import Job, RequestState, Scheduler
from eaglegen.sim.tools import ToolCallWriter
from eaglegen.sim.voice import Voice

logger = logging.getLogger(__name__)
# Falling further behind than this re-anchors the step clock instead of bursting to catch up.
_MAX_LAG_S = 0.05


class _StepClock:
    """Paces simulated steps against wall time, absorbing the loop's own processing time."""

    def __init__(self) -> None:
        """Anchor at now."""
        self._t = time.monotonic()

    def reset(self) -> None:
        """Re-anchor after an idle period."""
        self._t = time.monotonic()

    async def advance(self, seconds: float) -> None:
        """Sleep until this step's simulated end."""
        self._t += seconds
        delay = self._t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
            return
        if -delay > _MAX_LAG_S:
            self._t = time.monotonic()
        # Yield anyway so HTTP handlers run between back-to-back steps.
        await asyncio.sleep(0)


@dataclass(eq=False)
class StreamWatch:
    """A streamed job as its handler sees it: how many tokens the scheduler has released."""

    job: Job
    # Tokens between chunks (SGLang's stream_interval).
    interval: int
    # Set whenever a job of the handler's call has something to send.
    wake: asyncio.Event
    ready: int = 0
    finished: bool = False
    error: str | None = None


class SimService:
    """Runtime state of one simulator: scheduler, tokenizer and the single step-driving task."""

    def __init__(self, config: SimConfig, voice: Voice) -> None:
        """Build the engine; nothing runs until start()."""
        self.config = config
        self.voice = voice
        self.layout = voice.layout
        self.tokenizer = voice.tokenizer
        self.shape = OutputShape(
            config.mean_output_tokens, config.max_output_tokens, config.output_length_sigma
        )
        size = self.layout.vocab_size
        self.limits = Limits(size, config.context_length, config.kv_tokens, config.seed)
        self.scheduler = Scheduler(config.scheduler_config())
        self.costs = config.step_costs()
        # Simulated seconds the passes took (before time_scale): the model's own clock.
        self.engine_time = EngineTime()
        # Latency of finished requests on the engine's clock (engine seconds at submission by
        # job key): unlike the wall-clock e2e histogram, it does not depend on time_scale or on
        # how well the host keeps pace.
        self.engine_e2e = metrics.Histogram()
        self._arrived: dict[int, float] = {}
        self.meter = ThroughputMeter()
        self.e2e = metrics.Histogram()
        self.faults = FaultInjector(config.faults)
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._watches: dict[int, StreamWatch] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-steps")

    async def stop(self) -> None:
        """Stop the step loop and fail whatever still waits."""
        if self._task is not None:
            self._task.cancel()
            # A crash was already logged by _run; shutdown must not raise it again.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for future in self._futures.values():
            future.cancel()
        self._fail_watches("the simulator stopped")

    def alive(self) -> bool:
        """Whether the step loop runs."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        """Drive the steps; a crash fails every waiting request and marks the server unhealthy."""
        try:
            await self._steps()
        except Exception as exc:
            logger.exception("simulator step loop crashed")
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"simulator step loop crashed: {exc}"))
            self._fail_watches(f"simulator step loop crashed: {exc}")
            raise

    async def _steps(self) -> None:
        """The one task that drives every request: admit, prefill, decode, repeat."""
        clock = _StepClock()
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                clock.reset()
                continue
            await self._one_round(clock)

    async def _one_round(self, clock: _StepClock) -> None:
        """One forward pass, as SGLang's event loop picks it (`eaglegen.sim.forward`): a prefill
        batch when a waiting request may start, else one decode step of the running batch. A
        retracted stream just pauses: its next chunk comes after its re-prefill."""
        scheduler = self.scheduler
        forward = begin_pass(scheduler, self.costs)
        if forward.prefill is None and not forward.decoded:
            if not forward.retracted:
                # Defensive: work exists yet nothing can move; never spin.
                await asyncio.sleep(0.001)
            return
        self.engine_time.add(forward)
        await clock.advance(forward.seconds * self.config.time_scale)
        self._resolve(end_pass(scheduler, forward))
        self._release_chunks()
        if forward.decoded:
            self.meter.record(time.monotonic(), scheduler.tokens_generated)

    @property
    def sim_seconds(self) -> float:
        """Simulated seconds the passes took (before time_scale)."""
        return self.engine_time.total

    def _resolve(self, jobs: list[Job]) -> None:
        """Wake the handlers of finished jobs."""
        for job in jobs:
            arrived = self._arrived.pop(job.key, None)
            if arrived is not None and job.count_in_metrics:
                self.engine_e2e.observe(self.engine_time.total - arrived)
            future = self._futures.pop(job.key, None)
            if future is not None and not future.done():
                future.set_result(None)
            watch = self._watches.pop(job.key, None)
            if watch is not None:
                watch.ready = job.output_tokens
                watch.finished = True
                watch.wake.set()

    def _release_chunks(self) -> None:
        """After a step, release a chunk to every stream whose token count is due one."""
        # Every running job gains exactly one token per step, so checking after each step
        # sees every count the scheduler's rule could pick.
        for watch in self._watches.values():
            job = watch.job
            if job.state is not RequestState.RUNNING:
                continue
            tokens = self.scheduler.generated(job)
            if tokens > watch.ready and stream_due(tokens, watch.interval):
                watch.ready = tokens
                watch.wake.set()

    def _fail_watches(self, message: str) -> None:
        """Tell every stream that its answer will never come."""
        for watch in self._watches.values():
            watch.error = message
            watch.wake.set()
        self._watches.clear()

    def queue_full(self, incoming: int) -> bool:
        """Whether accepting more requests would overflow --max-queued-requests."""
        cap = self.config.max_queued_requests
        return cap is not None and self.scheduler.num_waiting + incoming > cap

    def make_job(self, item: GenerateItem, count_in_metrics: bool) -> Job:
        """Generate an item's output now; the scheduler decides when it is revealed."""
        voice, tools = self.voice, None
        if voice.declarations is not None and voice.call_format is not None:
            functions = voice.declarations.functions(item.input_ids)
            if functions:
                rate = self.faults.config.broken_tool_args_rate
                tools = ToolCallWriter(functions, self.encode, rate, voice.call_format)
        completion = generate(item.input_ids, item.sampling, self.layout, self.shape, tools)
        return Job(item.input_ids, completion, item.sampling.max_new_tokens, count_in_metrics)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (what the model writes between special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    async def run(self, jobs: list[Job], receive: Receive) -> bool:
        """Run jobs to completion; False (and the jobs aborted) if the client disconnects."""
        futures = [self._submit(job) for job in jobs]
        done_all: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*futures))
        gone: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({done_all, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if done_all.done():
            done_all.result()
            return True
        done_all.cancel()
        # Retrieve the cancelled gather's outcome, or asyncio logs it as never retrieved.
        done_all.add_done_callback(_retrieve)
        for job in jobs:
            self._futures.pop(job.key, None)
            self._arrived.pop(job.key, None)
            self.scheduler.abort(job)
        return False

    def _submit(self, job: Job) -> asyncio.Future[None]:
        """Queue one job and wake the step loop."""
        self.scheduler.submit(job)
        self._arrived[job.key] = self.engine_time.total
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[job.key] = future
        self._wake.set()
        return future

    def stream(self, jobs: list[Job], intervals: list[int]) -> list[StreamWatch]:
        """Queue jobs whose chunks are released as they decode; all share one wake event."""
        wake = asyncio.Event()
        watches = []
        for job, interval in zip(jobs, intervals, strict=True):
            self.scheduler.submit(job)
            self._arrived[job.key] = self.engine_time.total
            watch = StreamWatch(job, interval, wake)
            self._watches[job.key] = watch
            watches.append(watch)
        self._wake.set()
        return watches

    def release(self, watches: Iterable[StreamWatch]) -> None:
        """A stream ended (or its client left): abort what still runs and forget the watches."""
        for watch in watches:
            self._watches.pop(watch.job.key, None)
            self._arrived.pop(watch.job.key, None)
            self.scheduler.abort(watch.job)

    def text(self, completion: Completion, item: GenerateItem) -> str:
        """Detokenize like SGLang's detokenizer manager."""
        ids = ids_for_text(completion, item.text_options)
        return self.decode(ids, item.text_options.skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Text of token ids."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def snapshot(self) -> metrics.Snapshot:
        """Current values for /metrics."""
        s = self.scheduler
        return metrics.Snapshot(
            num_running_reqs=s.num_running,
            num_queue_reqs=s.num_waiting,
            num_used_tokens=s.used_tokens,
            token_usage=s.token_usage,
            gen_throughput=self.meter.rate(time.monotonic()),
            cache_hit_rate=s.last_cache_hit_rate,
            max_total_num_tokens=s.kv_tokens,
            prompt_tokens_total=s.totals.prompt_tokens,
            generation_tokens_total=s.totals.generation_tokens,
            cached_tokens_total=s.totals.cached_tokens,
            num_requests_total=s.totals.requests,
            num_retracted_reqs=s.last_retracted,
            num_retracted_requests_total=s.totals.retracted_requests,
            num_retracted_input_tokens_total=s.totals.retracted_input_tokens,
            num_retracted_output_tokens_total=s.totals.retracted_output_tokens,
            new_token_ratio=s.ratio.current,
        )

    def scheduler_stats(self) -> dict[str, Any]:
        """The simulator's own counters (GET /sim/stats): the model's clock and wasted work."""
        s = self.scheduler
        return {
            "sim_seconds": self.sim_seconds,
            # Of which prefill passes, and the share of them that redid retracted work.
            "prefill_seconds": self.engine_time.prefill,
            "reprefill_seconds": self.engine_time.reprefill,
            # Prefill passes run: arrivals spread out cost more of them than arrivals together.
            "prefill_passes": self.engine_time.passes["prefill"],
            # Finished requests' e2e latency on the same clock: count and sum.
            "e2e_count": self.engine_e2e.count,
            "e2e_seconds": self.engine_e2e.total,
            "decode_steps": s.step,
            "tokens_generated": s.tokens_generated,
            "generation_tokens_total": s.totals.generation_tokens,
            "retracted_requests": s.totals.retracted_requests,
            "retracted_output_tokens": s.totals.retracted_output_tokens,
            "reprefill_tokens": s.totals.reprefill_tokens,
            "new_token_ratio": s.ratio.current,
            "cached_tree_tokens": s.cache.total_size,
        }


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen."""
    if not future.cancelled():
        future.exception()


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection (the body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
