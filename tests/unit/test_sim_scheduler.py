"""The simulator's SGLang scheduler as pure logic: admission and the new-token ratio, retraction,
the running cap, chunked prefill, step costs, the radix cache and what /metrics reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from eaglegen.sim.engine import (
    OutputShape,
    Sampling,
    Vocab,
    decode_seconds,
    generate,
    prefill_seconds,
)
from eaglegen.sim.radix import RadixCache
from eaglegen.sim.scheduler import (
    Job,
    NewTokenRatio,
    PrefillBatch,
    RequestState,
    Scheduler,
    SchedulerConfig,
)

VOCAB = Vocab(
    think_end=10,
    im_end=4,
    tool_section_begin=11,
    tool_section_end=12,
    tool_call_begin=13,
    tool_call_argument_begin=14,
    tool_call_end=15,
    vocab_size=4096,
    ordinary_lo=16,
    ordinary_hi=4096,
)
SHAPE = OutputShape()


def prompt(i: int, n: int = 40, head: list[int] | None = None) -> list[int]:
    """A distinct prompt of n ordinary tokens, after an optional shared head."""
    own = [16 + (i * 7919 + k * 31) % 4000 for k in range(n)]
    return [*(head or []), *own]


def make_job(p: list[int], max_new: int, ignore_eos: bool = False) -> Job:
    """A job whose output is the simulator's answer to p, cut at max_new."""
    completion = generate(p, Sampling(max_new_tokens=max_new, ignore_eos=ignore_eos), VOCAB, SHAPE)
    return Job(p, completion, max_new)


@dataclass
class FakeClock:
    """A clock the test moves by hand."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(
    kv: int = 10_000,
    running: int = 100,
    prefill: int = 16_384,
    ratio: float | tuple[float, float] = 1.0,
    chunk: int | None = None,
    clock: Callable[[], float] | None = None,
) -> Scheduler:
    """A scheduler; ratio is fixed, or (init, floor) decaying over 600 steps."""
    init, floor = ratio if isinstance(ratio, tuple) else (ratio, ratio)
    config = SchedulerConfig(
        kv_tokens=kv,
        max_running_requests=running,
        max_prefill_tokens=prefill,
        chunked_prefill_size=chunk,
        init_new_token_ratio=init,
        min_new_token_ratio=floor,
    )
    return Scheduler(config, clock or FakeClock())


@dataclass
class Round:
    """What one forward pass of the service's loop did."""

    prefill: PrefillBatch | None
    retracted: tuple[Job, ...]
    finished: list[Job]


def one_round(s: Scheduler) -> Round:
    """The service's loop, without time: a prefill batch if one forms, else a decode step."""
    batch = s.admit()
    if batch is not None:
        return Round(batch, (), s.finish_prefill(batch))
    plan = s.prepare_decode()
    return Round(None, plan.retracted, s.decode_step() if plan.batch else [])


def drain(s: Scheduler, on_round: Callable[[Round], None] | None = None) -> list[Job]:
    """Run until idle; all finished jobs in order."""
    finished: list[Job] = []
    for _ in range(200_000):
        if not s.has_work():
            return finished
        done = one_round(s)
        if on_round is not None:
            on_round(done)
        finished += done.finished
    raise AssertionError("scheduler made no progress")


def assert_pool_balanced(s: Scheduler) -> None:
    """Nothing leaked: free + cached slots are the whole pool once idle."""
    assert not s.has_work()
    assert s.private_tokens == 0 and s.used_tokens == 0 and s.cache.protected_size == 0
    assert s.available_tokens + s.cache.total_size == s.kv_tokens
    assert s.available_tokens + s.cache.evictable_size == s.kv_tokens


# --- continuous batching --------------------------------------------------------------------


def test_each_job_takes_one_decode_step_per_token_after_the_prefill_token() -> None:
    s = scheduler()
    job = make_job(prompt(1), 10, ignore_eos=True)
    s.submit(job)
    batch = s.admit()
    assert batch is not None and batch.jobs == (job,) and batch.extend_tokens == 40
    assert s.finish_prefill(batch) == []
    steps = 0
    while not (s.prepare_decode() and s.decode_step()):
        steps += 1
    assert steps + 1 == 9  # 1 token from prefill, 9 from decode
    assert job.state is RequestState.DONE
    assert_pool_balanced(s)


def test_generated_counts_the_tokens_a_stream_may_have_sent() -> None:
    s = scheduler()
    job = make_job(prompt(1), 6, ignore_eos=True)
    s.submit(job)
    batch = s.admit()
    assert batch is not None and s.generated(job) == 0  # prefilling
    s.finish_prefill(batch)
    counts = [s.generated(job)]
    while job.state is RequestState.RUNNING:
        s.prepare_decode()
        s.decode_step()
        counts.append(s.generated(job))
    assert counts == [1, 2, 3, 4, 5, 6]


def test_kv_usage_counts_prompt_and_generated_tokens_like_sglang() -> None:
    s = scheduler()
    job = make_job(prompt(1, 50), 20, ignore_eos=True)
    s.submit(job)
    batch = s.admit()
    assert batch is not None
    s.finish_prefill(batch)
    for _ in range(5):
        s.prepare_decode()
        s.decode_step()
    # The prompt is in the tree, locked; the generated tokens are the job's own.
    assert s.cache.protected_size == 50 and s.private_tokens == 6
    assert s.used_tokens == 50 + 1 + 5 and s.token_usage == pytest.approx(56 / 10_000)
    drain(s)
    # Once done the whole sequence is cached, evictable: not "used" any more.
    assert s.cache.evictable_size == 50 + 20
    assert_pool_balanced(s)


def test_totals_count_finished_requests_exactly() -> None:
    s = scheduler(kv=3000)
    jobs = [make_job(prompt(i), 64) for i in range(40)]
    for job in jobs:
        s.submit(job)
    drain(s)
    assert s.totals.requests == 40
    assert s.totals.prompt_tokens == sum(j.prompt_tokens for j in jobs)
    assert s.totals.generation_tokens == sum(j.output_tokens for j in jobs) == s.tokens_generated
    assert_pool_balanced(s)


def test_abort_frees_kv_wherever_the_job_is() -> None:
    # Two reserve 500 each; SGLang admits while the need stays strictly below the room.
    s = scheduler(kv=1001)
    running = make_job(prompt(1, 100), 400, ignore_eos=True)
    waiting = make_job(prompt(2, 100), 400)
    s.submit(running)
    s.submit(make_job(prompt(3, 100), 400))
    s.submit(waiting)
    batch = s.admit()
    assert batch is not None and len(batch.jobs) == 2
    s.finish_prefill(batch)
    s.prepare_decode()
    s.decode_step()
    s.abort(waiting)
    s.abort(running)
    assert waiting.state is running.state is RequestState.ABORTED
    assert s.num_waiting == 0 and s.num_running == 1
    finished = drain(s)
    assert len(finished) == 1
    assert_pool_balanced(s)


def test_a_job_larger_than_the_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        scheduler(kv=100).submit(make_job(prompt(1, 50), 60))


def test_max_new_tokens_zero_finishes_at_prefill_with_nothing() -> None:
    s = scheduler()
    job = make_job(prompt(1), 0)
    s.submit(job)
    assert drain(s) == [job] and job.output_tokens == 0
    assert_pool_balanced(s)


# --- admission and the new-token ratio ------------------------------------------------------


def admit_all(s: Scheduler) -> int:
    """Prefill every batch that forms now (no decode in between); how many jobs started."""
    started = 0
    while (batch := s.admit()) is not None:
        s.finish_prefill(batch)
        started += len(batch.jobs)
    return started


@pytest.mark.parametrize(("ratio", "second_pass"), [(1.0, 0), (0.5, 4)])
def test_admission_charges_running_requests_their_remaining_output_times_the_ratio(
    ratio: float, second_pass: int
) -> None:
    s = scheduler(kv=10_000, ratio=ratio)
    for i in range(20):
        s.submit(make_job(prompt(i, 100), 1000, ignore_eos=True))
    # Nothing runs yet: each new request is charged its prompt and its whole (clipped) output,
    # 1100 tokens, so 9 fit in 10 000.
    first = s.admit()
    assert first is not None and len(first.jobs) == 9
    s.finish_prefill(first)
    # Now the 9 running ones are charged 999 remaining tokens times the ratio:
    # rem_total = 10000 - 900 (prompts) - 9 (first tokens) - 9 * 999 * ratio.
    # Ratio 1: 100 left, nothing fits. Ratio 0.5: 4595.5 left, room for 4 more.
    second = s.admit()
    assert (len(second.jobs) if second else 0) == second_pass
    assert s.num_running == 9 + second_pass


def test_the_clip_bounds_what_a_huge_max_new_tokens_reserves() -> None:
    s = scheduler(kv=100_000, ratio=1.0)
    for i in range(30):
        s.submit(make_job(prompt(i, 100), 20_000))
    # Charged 100 + min(20000, 4096) each: 23 fit instead of 4.
    assert admit_all(s) == 23


def test_the_ratio_decays_per_step_to_its_floor_and_resets() -> None:
    ratio = NewTokenRatio(0.7, 0.7 * 0.14, 600)
    for _ in range(300):
        ratio.decay_step()
    assert ratio.current == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(1000):
        ratio.decay_step()
    assert ratio.current == pytest.approx(0.098)
    ratio.reset()
    assert ratio.current == 0.7
    assert NewTokenRatio.after_retract(decoded=500, max_new=2000, survivors=5, steps=20) == (
        pytest.approx(600 / 2001)
    )
    assert NewTokenRatio.after_retract(decoded=5000, max_new=2000, survivors=5, steps=20) == 1.0


def test_the_scheduler_decays_the_ratio_each_decode_step_and_resets_when_idle() -> None:
    s = scheduler(ratio=(0.7, 0.098))
    s.submit(make_job(prompt(1), 50, ignore_eos=True))
    admit_all(s)
    for step in range(1, 11):
        s.prepare_decode()
        s.decode_step()
        assert s.ratio.current == pytest.approx(0.7 - step * s.ratio.decay)
    drain(s)
    assert s.ratio.current == 0.7


def test_a_lower_ratio_admits_more_requests_up_front() -> None:
    def started(ratio: float) -> int:
        s = scheduler(kv=20_000, ratio=ratio)
        for i in range(100):
            s.submit(make_job(prompt(i, 500), 2000))
        return admit_all(s)

    assert started(1.0) < started(0.5) < started(0.1)


# --- retraction -----------------------------------------------------------------------------


def test_retraction_frees_fewest_outputs_then_longest_prompt_first() -> None:
    # A small pool and a low ratio: admission overcommits and decode runs out of KV.
    s = scheduler(kv=6000, ratio=0.05)
    rng_lengths = [60 + (i * 37) % 200 for i in range(16)]
    jobs = [make_job(prompt(i, n), 1500, ignore_eos=True) for i, n in enumerate(rng_lengths)]
    for job in jobs[:8]:
        s.submit(job)
    events: list[tuple[list[tuple[int, int, int]], tuple[Job, ...], float]] = []
    for _ in range(100_000):
        before = [(s.generated(j), -j.prompt_tokens, j.key) for j in s.decoding_jobs()]
        done = one_round(s)
        if done.retracted:
            events.append((before, done.retracted, s.ratio.current))
            break
        if s.num_waiting == 0 and len(jobs) > s.totals.requests + s.num_running:
            for job in jobs[8:]:  # a second wave arrives mid-decode, with fewer outputs
                if job.state is RequestState.WAITING and job.key == 0:
                    s.submit(job)
    assert events, "the pool never ran out"
    before, retracted, ratio = events[0]
    ranked = sorted(before)  # fewest outputs first, then the longest prompt (-len smallest)
    assert [j.key for j in retracted] == [key for _, _, key in ranked[: len(retracted)]]
    survivors = [entry for entry in ranked[len(retracted) :]]
    decoded = sum(gen for gen, _, _ in survivors)
    assert ratio == pytest.approx(
        min(1.0, (decoded + 20 * len(survivors)) / (1500 * len(survivors) + 1))
    )
    # Retracted one at a time until the next step fits (then up to 20 steps' worth evicted).
    assert s.available_tokens >= len(survivors)
    assert s.last_retracted == len(retracted) == s.totals.retracted_requests


def test_a_retracted_job_keeps_its_output_and_is_prefilled_again() -> None:
    s = scheduler(kv=5000, ratio=0.05)
    jobs = [make_job(prompt(i, 100 + 10 * i), 1500, ignore_eos=True) for i in range(8)]
    for job in jobs:
        s.submit(job)
    kept: dict[int, int] = {}
    redo: dict[int, list[int]] = {}

    def watch(r: Round) -> None:
        for job in r.retracted:
            assert job.state is RequestState.WAITING and job.kept > 0
            kept[job.key] = kept.get(job.key, 0) + job.kept
        if r.prefill is not None:
            for job, chunk in zip(r.prefill.jobs, r.prefill.chunks, strict=True):
                if job.retractions:
                    redo.setdefault(job.key, []).append(chunk)

    finished = drain(s, watch)
    assert kept and len(finished) == 8
    assert all(j.state is RequestState.DONE and j.output_tokens == 1500 for j in jobs)
    assert s.totals.retracted_output_tokens == sum(kept.values())
    assert s.totals.retracted_requests == sum(j.retractions for j in jobs)
    # Re-prefill recomputes at least the kept output (the prompt may still be cached).
    assert s.totals.reprefill_tokens == sum(sum(c) for c in redo.values())
    assert s.totals.reprefill_tokens >= sum(kept.values())
    # Decode never redoes a token: the waste is prefill work and the time it takes.
    assert s.tokens_generated == s.totals.generation_tokens == 8 * 1500
    retracted = [j for j in jobs if j.retractions]
    assert all(j.cached_tokens == 0 for j in retracted)  # the first prefill's hit is reported
    assert_pool_balanced(s)


def test_no_retraction_while_the_ratio_reserves_everything() -> None:
    s = scheduler(kv=5000, ratio=1.0)
    for i in range(8):
        s.submit(make_job(prompt(i, 100 + 10 * i), 1500, ignore_eos=True))
    drain(s, lambda r: None if not r.retracted else pytest.fail("retracted"))
    assert s.totals.retracted_requests == 0


# --- running cap, prefill budget, chunking, step costs ---------------------------------------


def test_max_running_requests_caps_the_batch() -> None:
    s = scheduler(running=3)
    for i in range(5):
        s.submit(make_job(prompt(i), 5))
    assert admit_all(s) == 3 and s.num_waiting == 2 and s.num_running == 3
    s.prepare_decode()
    s.decode_step()
    assert s.admit() is None  # still capped until one finishes


def test_prefill_batch_is_bounded_by_max_prefill_tokens_but_admits_one() -> None:
    s = scheduler(prefill=100)
    big = make_job(prompt(1, 150), 5)
    small = make_job(prompt(2, 50), 5)
    s.submit(big)
    s.submit(small)
    first = s.admit()
    assert first is not None and first.jobs == (big,)
    s.finish_prefill(first)
    second = s.admit()
    assert second is not None and second.jobs == (small,)


def test_a_long_prompt_is_prefilled_in_chunks_before_it_decodes() -> None:
    s = scheduler(kv=50_000, chunk=8192)
    long = make_job(prompt(1, 20_000), 10)
    s.submit(long)
    chunks = []
    while long.state is not RequestState.RUNNING:
        batch = s.admit()
        assert batch is not None and batch.jobs == (long,)
        chunks.append(batch.extend_tokens)
        s.finish_prefill(batch)
    assert chunks == [8192, 8192, 20_000 - 2 * 8192]
    assert s.generated(long) == 1


def test_step_costs_grow_with_the_batch_and_the_prompt() -> None:
    costs = [decode_seconds(n, 20.0, 0.6) for n in (1, 50, 100)]
    assert costs == pytest.approx([0.0206, 0.05, 0.08])
    assert prefill_seconds(8000, 8.0) == pytest.approx(1.0)
    assert prefill_seconds(16_000, 8.0) == pytest.approx(2 * prefill_seconds(8000, 8.0))


# --- radix cache ----------------------------------------------------------------------------


def test_radix_matches_the_longest_prefix_splitting_nodes() -> None:
    tree = RadixCache()
    a = prompt(1, 100)
    assert tree.match_prefix(a)[0] == 0
    assert tree.insert(a)[0] == 100
    assert tree.match_prefix(a)[0] == 100
    b = a[:40] + prompt(2, 60)
    length, node = tree.match_prefix(b)
    assert length == 40 and len(node.key) == 40  # the 100-token node was split at 40
    assert tree.insert(b)[0] == 60 and tree.total_size == 160
    assert tree.insert(a)[0] == 0


def test_radix_locks_protect_and_eviction_frees_least_recently_used_leaves() -> None:
    tree = RadixCache()
    head = prompt(0, 50)
    a, b, c = (prompt(i, 30, head) for i in (1, 2, 3))
    for p in (a, b, c):
        tree.insert(p)
    assert tree.total_size == 50 + 90 and tree.evictable_size == 140
    _, node_b = tree.match_prefix(b)
    tree.lock(node_b)
    assert tree.protected_size == 80  # b's own 30 and the shared head
    tree.match_prefix(a)  # a is now more recent than c
    assert tree.evict(1) == 30  # whole leaves go: c, the least recently used unlocked one
    assert tree.match_prefix(c)[0] == 50 and tree.match_prefix(a)[0] == 80
    assert tree.evict(1000) == 30  # only a's leaf is left to take: b and the head are locked
    tree.unlock(node_b)
    assert tree.evict(1000) == 80 and tree.total_size == 0


def test_requests_sharing_a_system_prompt_get_real_cached_tokens() -> None:
    s = scheduler()
    system = prompt(0, 500)
    first, second = make_job(prompt(1, 40, system), 8), make_job(prompt(2, 40, system), 8)
    s.submit(first)
    drain(s)
    s.submit(second)
    batch = s.admit()
    assert batch is not None
    assert second.cached_tokens == 500 and batch.extend_tokens == 40
    assert s.last_cache_hit_rate == pytest.approx(500 / 540)
    # A prompt seen whole still computes one token, as in SGLang.
    again = make_job(list(first.input_ids), 8)
    s.finish_prefill(batch)
    s.submit(again)
    drain(s)
    assert again.cached_tokens == 540 - 1
    assert s.totals.cached_tokens == 500 + 539


def test_cached_tokens_are_evicted_to_make_room_and_flush_needs_an_idle_server() -> None:
    s = scheduler(kv=2000)
    for i in range(10):
        s.submit(make_job(prompt(i, 150), 40, ignore_eos=True))
    drain(s)
    # Ten finished sequences of 190 tokens would not fit in 2000: older ones were evicted.
    assert s.cache.total_size <= 2000 and s.totals.requests == 10
    s.submit(make_job(prompt(99, 20), 5))
    assert not s.flush_cache()
    drain(s)
    assert s.flush_cache() and s.cache.total_size == 0


# --- what /metrics reads --------------------------------------------------------------------


def test_queue_time_is_observed_when_a_request_leaves_the_queue() -> None:
    clock = FakeClock()
    s = scheduler(running=1, clock=clock)
    a, b = make_job(prompt(1), 3, ignore_eos=True), make_job(prompt(2), 3, ignore_eos=True)
    s.submit(a)
    s.submit(b)
    clock.now = 0.4
    admit_all(s)
    assert s.num_waiting == 1 and s.queue_time.count == 1 and s.queue_time.total == 0.4
    clock.now = 2.5
    drain(s)
    assert s.queue_time.count == 2 and s.queue_time.total == pytest.approx(0.4 + 2.5)


def test_gauges_report_running_queue_and_usage_while_busy() -> None:
    s = scheduler(kv=3000, running=4)
    for i in range(6):
        s.submit(make_job(prompt(i, 100), 200, ignore_eos=True))
    admit_all(s)
    for _ in range(10):
        s.prepare_decode()
        s.decode_step()
    assert s.num_running == 4 and s.num_waiting == 2 and s.num_decoding == 4
    assert s.used_tokens == 4 * (100 + 11)
    assert s.token_usage == pytest.approx(444 / 3000)
