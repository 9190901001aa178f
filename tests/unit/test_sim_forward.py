"""What a retraction costs in the simulator, as SGLang pays it (`eaglegen.sim.forward`): the
retracted request's prompt and output so far prefilled again at prefill speed, the running batch
stalled meanwhile, and its second wait in the queue in its latency. Driven pass by pass on the
engine's clock (the sum of the passes' costs), so nothing depends on the host."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from eaglegen.sim import preset
from eaglegen.sim.forward import EngineTime, ForwardPass, StepCosts, begin_pass, end_pass
from eaglegen.sim.scheduler import Job, RequestState, Scheduler, SchedulerConfig
from tests.unit.test_sim_scheduler import FakeClock, make_job, prompt

# Kimi-K2's step costs: a fixed 20 ms per forward pass, 0.5 ms per decoding request, 8
# prompt tokens per ms.
COSTS = StepCosts(
    decode_step_ms=20.0, decode_ms_per_request=0.5, prefill_tokens_per_ms=8.0, prefill_step_ms=20.0
)
HEAD = [16 + k for k in range(50)]  # a system prompt every request shares
OUTPUTS = (600, 100, 600, 600, 100, 100, 100)


@dataclass
class Trace:
    """A run of an overcommitted pool, pass by pass, and what each job went through."""

    scheduler: Scheduler
    clock: FakeClock
    jobs: list[Job]
    passes: list[ForwardPass] = field(default_factory=list)
    # Per job: outputs kept at each retraction, and (chunk, hit) at each prefill.
    kept: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    prefills: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    # Per job: engine seconds spent waiting, in its own prefills, decoding, stalled by others'.
    spent: dict[int, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    time: EngineTime = field(default_factory=EngineTime)
    # Per pass: the running jobs that got no token from it (a prefill of others).
    stalled: list[list[int]] = field(default_factory=list)


def overcommitted() -> Trace:
    """Seven jobs behind a shared head on a 1,500-token pool, admitted with a new-token ratio of
    0.1 (SGLang's floor is 0.098): decode outgrows the pool and retracts."""
    clock = FakeClock()
    config = SchedulerConfig(kv_tokens=1500, init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    s = Scheduler(config, clock)
    jobs = [make_job(prompt(i, 150, HEAD), n, ignore_eos=True) for i, n in enumerate(OUTPUTS)]
    for job in jobs:
        s.submit(job)
    trace = Trace(s, clock, jobs)
    for _ in range(100_000):
        if not s.has_work():
            return trace
        forward = begin_pass(s, COSTS)
        _account(trace, forward)
        clock.now += forward.seconds
        trace.time.add(forward)
        trace.passes.append(forward)
        end_pass(s, forward)
    raise AssertionError("the scheduler made no progress")


def _account(trace: Trace, forward: ForwardPass) -> None:
    """Where each unfinished job spends this pass."""
    batch = forward.prefill
    prefilled = {} if batch is None else dict(zip(batch.jobs, batch.chunks, strict=True))
    for job in forward.retracted:
        trace.kept[job.key].append(job.kept)
    trace.stalled.append([])
    for job in trace.jobs:
        spent = trace.spent[job.key]
        if job in prefilled:
            trace.prefills[job.key].append((prefilled[job], job.hit))
            spent["prefill"] += forward.seconds
        elif job.state is RequestState.WAITING:
            spent["queue"] += forward.seconds
        elif job.state is RequestState.RUNNING and batch is None:
            spent["decode"] += forward.seconds
        elif job.state is RequestState.RUNNING:
            spent["stalled"] += forward.seconds
            trace.stalled[-1].append(job.key)


def first_retracted(trace: Trace) -> Job:
    """The job retracted first."""
    forward = next(f for f in trace.passes if f.retracted)
    return forward.retracted[0]


def test_a_retracted_request_is_prefilled_again_prompt_and_output_so_far() -> None:
    trace = overcommitted()
    job = first_retracted(trace)
    (kept,) = trace.kept[job.key]
    assert kept > 0 and job.retractions == 1 and job.state is RequestState.DONE
    (first_chunk, first_hit), (chunk, hit) = trace.prefills[job.key]
    assert first_hit == len(HEAD) and first_chunk == job.prompt_tokens - len(HEAD)
    # The second prefill computes the prompt and the output so far (fill_ids = origin_input_ids
    # + output_ids), less what the tree still held: the shared head, which the running requests
    # lock. Its own prompt was evicted for the survivors and its output never entered the tree.
    assert hit == len(HEAD) and chunk == job.prompt_tokens + kept - len(HEAD)
    # Nothing is decoded twice: every output token came from one decode step or prefill.
    s = trace.scheduler
    assert s.tokens_generated == s.totals.generation_tokens == sum(OUTPUTS)
    redone = sum(c for key, runs in trace.prefills.items() for c, _ in runs[1:])
    assert s.totals.reprefill_tokens == redone >= sum(sum(k) for k in trace.kept.values())


def test_the_re_prefill_runs_at_prefill_speed_and_stalls_the_running_batch() -> None:
    trace = overcommitted()
    job = first_retracted(trace)
    _, i = [n for n, f in enumerate(trace.passes) if f.prefill and job in f.prefill.jobs]
    forward = trace.passes[i]
    batch = forward.prefill
    assert batch is not None and batch.reprefill_tokens == batch.extend_tokens
    # Priced like any prefill pass: the fixed part of a forward pass, then tokens at 8 per ms.
    assert forward.seconds == pytest.approx((20.0 + batch.extend_tokens / 8.0) / 1000)
    assert forward.reprefill_seconds == forward.seconds
    # It ran instead of a decode step of the requests still running (the pass before was
    # their decode step), and none of them got a token from it.
    before, after = trace.passes[i - 1], trace.passes[i + 1]
    assert 0 < len(trace.stalled[i]) <= before.decoded and forward.decoded == 0
    assert after.decoded == len(trace.stalled[i]) + len(batch.jobs)
    assert all(trace.spent[key]["stalled"] >= forward.seconds for key in trace.stalled[i])
    # The engine's clock is the passes' costs; prefill passes, retracted work among them, are
    # time no request decoded in.
    decode = sum(f.seconds for f in trace.passes if f.decoded)
    assert trace.time.total == pytest.approx(decode + trace.time.prefill)
    assert 0 < trace.time.reprefill < trace.time.prefill
    assert trace.time.passes["decode"] == trace.scheduler.step


def test_a_retracted_requests_latency_spans_both_waits_both_prefills_and_the_stalls() -> None:
    trace = overcommitted()
    retracted = [j for j in trace.jobs if j.retractions]
    # The one that waited longest: it went to the back of the queue.
    job = max(retracted, key=lambda j: trace.spent[j.key]["queue"])
    spent = trace.spent[job.key]
    assert job.latency is not None and job.arrived_at == 0.0
    assert job.latency == pytest.approx(
        spent["queue"] + spent["prefill"] + spent["decode"] + spent["stalled"]
    )
    assert spent["queue"] > 0 and spent["stalled"] > 0 and len(trace.prefills[job.key]) == 2
    # Requests of the same length that were never retracted finished sooner.
    same_length = [
        j for j in trace.jobs if not j.retractions and j.output_tokens == job.output_tokens
    ]
    assert same_length and all(job.latency > (j.latency or 0) for j in same_length)
    # Retracted requests are readmitted first come, first served (appended to the queue).
    order = [j.key for f in trace.passes for j in f.retracted]
    seen: set[int] = set()
    readmitted = []
    for f in trace.passes:
        for j in f.prefill.jobs if f.prefill else ():
            if j.key in seen:
                readmitted.append(j.key)
            seen.add(j.key)
    assert readmitted == order
    # SGLang's queue_time_seconds is observed at each admission, a retracted request's too.
    s = trace.scheduler
    assert s.queue_time.count == len(trace.jobs) + s.totals.retracted_requests


def test_a_retraction_stops_as_soon_as_the_next_step_fits() -> None:
    # Ten requests of 60-token prompts and a ratio of 0.02: the pool runs out early, when the
    # youngest has decoded little. Freeing it and evicting its prompt leaves room for the next
    # step but not for 20 steps of the nine others, and SGLang stops there (retract_decode loops
    # on check_decode_mem), where an older SGLang retracted until 20 steps fit.
    config = SchedulerConfig(kv_tokens=1200, init_new_token_ratio=0.02, min_new_token_ratio=0.02)
    s = Scheduler(config, FakeClock())
    for i in range(10):
        s.submit(make_job(prompt(i, 60), 300, ignore_eos=True))
    for _ in range(10_000):
        forward = begin_pass(s, COSTS)
        if forward.retracted:
            break
        end_pass(s, forward)
    else:
        raise AssertionError("the pool never ran out")
    survivors = forward.decoded
    assert len(forward.retracted) == 1 and survivors == 9
    assert survivors <= s.available_tokens < 20 * survivors
    assert s.last_retracted == 1


def test_a_prefill_pass_pays_the_fixed_part_of_a_forward_pass_where_the_preset_says() -> None:
    # `fast` keeps its prefill priced by tokens alone (the suite's timings do not move); the
    # Kimi-K2 presets pay the decode step's fixed 20 ms on a prefill pass too.
    fast = preset("fast").step_costs()
    assert fast.prefill_step_ms == 0.0 and fast.prefill(1000) == pytest.approx(1000 / 50 / 1000)
    for name in ("kimi-k2", "kv-rich"):
        costs = preset(name).step_costs()
        assert costs.prefill_step_ms == costs.decode_step_ms == 20.0
        assert costs.prefill(800) == pytest.approx(0.12)
        assert costs.decode(50) == pytest.approx(0.05)


def test_an_idle_pass_costs_nothing() -> None:
    s = Scheduler(SchedulerConfig(kv_tokens=1000), FakeClock())
    forward = begin_pass(s, COSTS)
    assert forward.seconds == 0.0 and forward.prefill is None and forward.decoded == 0
    assert end_pass(s, forward) == [] and forward.reprefill_seconds == 0.0
    assert forward.retracted == ()
