"""The adaptive in-flight limit: each rule of the pure controller, its damping on a stationary
server, its convergence near the knee of the simulator's own SGLang scheduler (in-process, on a
virtual clock) from a low and a high start, its back-off on retractions, the reading of
SGLang's /metrics, and a worker's intake and threads, which follow the limits."""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from dataclasses import dataclass, replace

import pytest

from bench.adaptive import WORKLOADS, Plan, Result, fixed, run, run_adaptive
from core.settings import ServerSpec, Settings
from eaglegen.sim import metrics
from worker.concurrency import ConcurrencyController, Decision, Sample, Tuning
from worker.controller import parse_metrics, sample_from_metrics
from worker.intake import MAX_THREADS, Room, default_threads, intake, spare

TUNING = Tuning()


def sample(
    running: int,
    queued: int = 0,
    usage: float = 0.3,
    retracted: int = 0,
    in_flight: int | None = None,
) -> Sample:
    """A /metrics reading of a server with a 100k-token pool."""
    return Sample(running, queued, usage, 100_000, retracted, 1000.0, in_flight)


def settled(controller: ConcurrencyController, s: Sample) -> Decision:
    """Feed the same sample until the hold after a change is over; the last decision."""
    decision = controller.update(s)
    for _ in range(TUNING.hold):
        assert controller.update(s).limit == decision.limit, "a change was not held"
    return decision


# --- the rules --------------------------------------------------------------------------


def test_grows_while_the_pool_has_room_and_the_queue_is_short() -> None:
    controller = ConcurrencyController(16)
    limits = []
    for _ in range(6):
        limits.append(settled(controller, sample(controller.limit, usage=0.2)).limit)
    assert limits == sorted(limits) and limits[0] > 16
    # Slow start: each step multiplies the limit, tapered by how full the pool is.
    assert limits[1] - limits[0] > 1
    assert "grow" in controller.update(sample(controller.limit, usage=0.2)).reason


def test_growth_tapers_as_the_pool_fills_and_stops_at_the_kv_target() -> None:
    empty, half = ConcurrencyController(40), ConcurrencyController(40)
    step_empty = empty.update(sample(40, usage=0.05)).limit - 40
    step_half = half.update(sample(40, usage=0.6)).limit - 40
    assert step_empty > step_half > 0
    full = ConcurrencyController(40)
    assert not full.update(sample(40, usage=TUNING.kv_target)).changed


def test_a_fast_rising_pool_stops_growth_before_it_is_full() -> None:
    """KV lags admission: a pool filling fast is projected ahead and growth stops early."""
    controller = ConcurrencyController(40)
    settled(controller, sample(40, usage=0.40))
    limit = controller.limit
    rising = controller.update(sample(limit, usage=0.40 + 0.5 / TUNING.lookahead + 0.01))
    assert not rising.changed


def test_no_growth_while_the_workers_do_not_fill_the_limit() -> None:
    controller = ConcurrencyController(100)
    assert not controller.update(sample(50, usage=0.1, in_flight=50)).changed
    assert controller.update(sample(95, usage=0.1, in_flight=95)).limit > 100


def test_shrinks_on_new_retractions_but_not_below_what_the_server_runs() -> None:
    controller = ConcurrencyController(100)
    controller.update(sample(90, queued=10, usage=0.95, retracted=7))  # the counter's baseline
    cut = controller.update(sample(90, queued=10, usage=0.97, retracted=9))
    assert cut.limit == 90 and cut.previous == 100 and "retracted" in cut.reason
    deep = ConcurrencyController(100)
    deep.update(sample(40, queued=2, usage=0.95))
    assert deep.update(sample(40, queued=60, usage=0.95, retracted=3)).limit == math.floor(
        TUNING.backoff * 100
    )


def test_a_counter_reset_is_a_restarted_server_not_a_retraction() -> None:
    controller = ConcurrencyController(50)
    controller.update(sample(50, usage=0.95, retracted=40))
    assert not controller.update(sample(50, usage=0.95, retracted=0)).changed
    assert controller.update(sample(50, usage=0.95, retracted=1)).limit < 50


def test_retractions_of_requests_admitted_before_a_cut_do_not_cut_again() -> None:
    controller = ConcurrencyController(100)
    controller.update(sample(90, queued=10, usage=0.95))
    first = controller.update(sample(80, queued=20, usage=0.99, retracted=4))
    assert first.limit == 80
    # Still 100 in flight against a limit of 80: the next retractions are the old load's.
    during = controller.update(sample(75, queued=25, usage=0.99, retracted=8, in_flight=100))
    assert during.limit == 80
    drained = controller.update(sample(70, queued=5, usage=0.99, retracted=9, in_flight=75))
    assert drained.limit < 80 and "retracted" in drained.reason


def test_shrinks_on_a_growing_queue_towards_running_plus_headroom() -> None:
    controller = ConcurrencyController(60)
    controller.update(sample(50, queued=4, usage=0.95))  # a full pool: no growth either
    headroom = TUNING.headroom(50)
    grown = controller.update(sample(50, queued=4 + headroom, usage=0.95))
    assert grown.limit < 60 and "queue" in grown.reason
    assert grown.limit >= 50 + headroom


def test_a_queue_longer_than_a_batch_that_stopped_growing_is_cut_to_the_knee_at_once() -> None:
    controller = ConcurrencyController(1024)
    limits = []
    for _ in range(40):
        limits.append(controller.update(sample(50, queued=974, usage=0.9, in_flight=1024)).limit)
    # The first sample cannot tell a full batch from one still filling: a 20% trim; the
    # next is held; the third sees the batch flat and goes to capacity + headroom.
    knee = 50 + TUNING.headroom(50)
    assert limits[:3] == [math.floor(TUNING.backoff * 1024), limits[0], knee]
    assert set(limits[2:]) == {knee}


def test_a_long_queue_at_a_batch_still_filling_is_trimmed_by_at_most_the_backoff() -> None:
    controller = ConcurrencyController(1024)
    limits = []
    for running in range(20, 220, 10):  # the server admits more every sample
        limits.append(controller.update(sample(running, queued=900, in_flight=1024)).limit)
    cuts = [after / before for before, after in itertools.pairwise(limits) if after < before]
    assert cuts and min(cuts) >= TUNING.backoff - 0.01  # never the deep cut


def test_bounded_by_min_and_max() -> None:
    tuning = Tuning(min_limit=8, max_limit=64)
    assert ConcurrencyController(1, tuning).limit == 8
    assert ConcurrencyController(1000, tuning).limit == 64
    high = ConcurrencyController(60, tuning)
    for _ in range(10):
        high.update(sample(high.limit, usage=0.05))
    assert high.limit == 64
    low = ConcurrencyController(9, tuning)
    for i in range(10):
        low.update(sample(2, queued=7, usage=0.99, retracted=3 * i, in_flight=2))
    assert low.limit == 8


def test_the_same_sample_at_the_knee_changes_nothing() -> None:
    """A queue between the headroom and twice it is the band the limit rests in."""
    controller = ConcurrencyController(58)
    at_knee = sample(50, queued=8, usage=0.5)
    assert all(not controller.update(at_knee).changed for _ in range(50))


def test_the_same_sample_with_room_grows_only_up_to_what_the_workers_fill() -> None:
    controller = ConcurrencyController(50)
    room = sample(45, queued=0, usage=0.3, in_flight=50)
    limits = [controller.update(room).limit for _ in range(50)]
    # One step up, then the 50 in flight no longer fill the limit: no further growth.
    assert limits[0] > 50 and set(limits) == {limits[0]}


def cut_to_the_floor(start: int) -> ConcurrencyController:
    """A controller that a stalled server (retracting with 2 running) cut to its minimum."""
    controller = ConcurrencyController(start)
    for i in itertools.count():
        if controller.limit == TUNING.min_limit:
            return controller
        controller.update(sample(2, queued=50, usage=0.95, retracted=3 * i, in_flight=2))
    raise AssertionError("unreachable")


def test_after_a_cut_a_server_with_room_is_regrown_multiplicatively() -> None:
    """Issue 27: a cut to 4 came back to 200 at +1 per step (16 minutes at 5 s)."""
    controller = cut_to_the_floor(200)
    server = SteadyServer(250, 0.6)  # admits all it is sent up to 250
    limits = [controller.limit]
    while controller.limit < 200:
        assert len(limits) <= 30, f"regrowth too slow: {limits}"
        limits.append(controller.update(server.read(controller.limit)).limit)
    # Twenty-odd samples (each change then held one), growing by a factor, not a step.
    changes = [b / a for a, b in itertools.pairwise(limits) if b != a]
    assert min(changes) > 1.25, changes


def test_after_a_cut_growth_near_the_knee_stays_additive() -> None:
    """A queue of half the headroom or more says the knee is near: a step, not a factor."""
    controller = cut_to_the_floor(200)
    server = SteadyServer(250, 0.6)
    while controller.limit < 100:
        controller.update(server.read(controller.limit))
    controller.update(sample(50, usage=0.3, in_flight=50))  # neither grows nor trims: unheld
    limit, twin = controller.limit, copy.deepcopy(controller)
    running = limit - TUNING.headroom(limit)
    headroom = TUNING.headroom(running)  # the queue kept at the knee, at this batch
    room = controller.update(sample(limit, queued=0, usage=0.3, in_flight=limit))
    near = twin.update(sample(running, queued=headroom, usage=0.3, in_flight=limit))
    step = math.ceil(headroom / 2)
    assert near.limit == limit + step and "grow" in near.reason
    assert room.limit > limit + 3 * step


def test_tuning_rejects_knobs_that_cannot_control() -> None:
    for bad in ({"min_limit": 0}, {"backoff": 1.0}, {"kv_target": 0.0}, {"queue_floor": 0}):
        with pytest.raises(ValueError):
            Tuning(**bad)


# --- damping on a stationary server -------------------------------------------------------


@dataclass
class SteadyServer:
    """A server whose batch holds `capacity` requests, the rest waiting in its queue."""

    capacity: int
    kv_at_capacity: float

    def read(self, in_flight: int) -> Sample:
        """What /metrics says with `in_flight` requests sent."""
        running = min(in_flight, self.capacity)
        usage = self.kv_at_capacity * running / self.capacity
        return sample(running, in_flight - running, usage, in_flight=in_flight)


@pytest.mark.parametrize("start", [4, 1024])
@pytest.mark.parametrize(
    "server",
    [SteadyServer(33, 0.22), SteadyServer(46, 0.89), SteadyServer(400, 0.6)],
    ids=["admission-bound", "kv-bound", "running-cap"],
)
def test_settles_without_oscillating_on_a_stationary_server(
    server: SteadyServer, start: int
) -> None:
    controller = ConcurrencyController(start)
    limits = [controller.update(server.read(controller.limit)).limit for _ in range(200)]
    tail = limits[100:]
    assert len(set(tail)) == 1, f"still moving: {sorted(set(tail))}"
    headroom = TUNING.headroom(server.capacity)
    assert server.capacity + headroom <= tail[0] <= server.capacity + 2 * headroom + 1
    # After the first decrease the limit never turns back up past where it turned.
    turns = sum(
        1 for a, b, c in zip(limits, limits[1:], limits[2:], strict=False) if (b - a) * (c - b) < 0
    )
    assert turns <= 2


# --- against the simulator's own scheduler ------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A preset, the workload its knee is measured with, the simulated warm-up and span, and
    fixed levels around its knee; the last is far past it and measures the knee itself."""

    workload: str
    plan: Plan
    levels: tuple[int, ...]


CASES: dict[str, Case] = {
    "fast": Case("short-chat", Plan(60.0, 240.0), (64, 128, 512)),
    "kimi-k2": Case("long-reasoning", Plan(600.0, 1500.0), (32, 64, 512)),
    "kv-rich": Case("long-reasoning", Plan(600.0, 1500.0), (128, 256, 512)),
}


@pytest.fixture(scope="module")
def sweeps() -> dict[str, dict[int, Result]]:
    """Fixed levels per preset, each on a fresh server, computed once for the module."""
    return {}


def fixed_sweep(sweeps: dict[str, dict[int, Result]], name: str) -> dict[int, Result]:
    """The preset's fixed sweep (cached)."""
    if name not in sweeps:
        case = CASES[name]
        shapes = WORKLOADS[case.workload]
        sweeps[name] = {lv: run(name, shapes, fixed(lv), lv, case.plan) for lv in case.levels}
    return sweeps[name]


@pytest.mark.parametrize("start", [4, 1024])
@pytest.mark.parametrize("name", list(CASES))
def test_settles_near_the_knee_of_each_preset(
    sweeps: dict[str, dict[int, Result]], name: str, start: int
) -> None:
    levels = fixed_sweep(sweeps, name)
    # The knee: the batch the server itself holds when it is never short of requests.
    knee = levels[max(levels)].mean_running
    best = max(r.tok_s for r in levels.values())
    case = CASES[name]
    result = run_adaptive(name, WORKLOADS[case.workload], start, case.plan)
    measured = result.limits[-round(case.plan.span_s / case.plan.interval_s) :]
    limit = statistics.median(measured)
    assert 0.8 * knee <= limit <= 1.5 * knee + 8, f"limit {limit} vs knee {knee:.0f}"
    assert result.tok_s >= 0.95 * best, f"{result.tok_s:.0f} tok/s vs best fixed {best:.0f}"


def test_backs_off_when_the_server_retracts() -> None:
    """Above the knee of the real run's server, SGLang admits more than its pool holds and
    retracts; every retraction the controller sees outside a drain cuts the limit."""
    decisions: list[tuple[Sample, Decision]] = []
    controller = ConcurrencyController(96)

    def policy(s: Sample) -> int:
        decisions.append((s, controller.update(s)))
        return controller.limit

    run("kimi-k2", WORKLOADS["long-reasoning"], policy, 96, Plan(0.0, 900.0))
    events = []
    for (before, previous), (now, decision) in itertools.pairwise(decisions):
        if now.retracted_total > before.retracted_total and now.held <= previous.limit:
            events.append((now, decision))
    assert events, "the server never retracted at this load"
    for now, decision in events:
        assert decision.limit < decision.previous and "retracted" in decision.reason
        assert decision.limit >= min(now.running, decision.previous - 1)
    assert controller.limit < 96


# --- reading /metrics ---------------------------------------------------------------------


def _snapshot(**values: float) -> metrics.Snapshot:
    base = dict.fromkeys(metrics.Snapshot.__dataclass_fields__, 0)
    return metrics.Snapshot(**{**base, **values})  # type: ignore[arg-type]


def test_reads_sglangs_metrics_with_their_labels() -> None:
    snap = _snapshot(
        num_running_reqs=46,
        num_queue_reqs=5,
        token_usage=0.89,
        max_total_num_tokens=159_000,
        num_retracted_requests_total=12,
        gen_throughput=938.5,
    )
    text = metrics.render(snap, metrics.Histogram(), "moonshotai/Kimi-K2.5")
    assert parse_metrics(text)["sglang:num_running_reqs"] == [46.0]
    read = sample_from_metrics(text, in_flight=52)
    assert read == Sample(46, 5, 0.89, 159_000, 12, 938.5, 52)


def test_data_parallel_ranks_add_up_and_the_fullest_pool_counts() -> None:
    ranks = [
        metrics.render(_snapshot(num_running_reqs=r, token_usage=u), metrics.Histogram(), "m")
        for r, u in ((30, 0.5), (20, 0.9))
    ]
    text = "\n".join(
        line.replace('tp_rank="0"', f'dp_rank="{i}"')
        for i, body in enumerate(ranks)
        for line in body.splitlines()
    )
    read = sample_from_metrics(text)
    assert read is not None and read.running == 50 and read.token_usage == 0.9


def test_lines_without_a_usable_value_are_skipped() -> None:
    text = (
        'sglang:num_running_reqs{model_name="a } b"} 7.0 1700000000\n'
        "sglang:num_running_reqs NaN\n"
        "sglang:num_queue_reqs\n"
        "garbage line\n"
        "sglang:token_usage 0.5\n"
    )
    assert parse_metrics(text) == {"sglang:num_running_reqs": [7.0], "sglang:token_usage": [0.5]}
    read = sample_from_metrics(text)
    assert read is not None and (read.running, read.queued, read.token_usage) == (7, 0, 0.5)


def test_a_server_without_scheduler_metrics_gives_no_sample() -> None:
    assert sample_from_metrics("# nothing here\nprocess_cpu_seconds_total 3.0\n") is None
    assert sample_from_metrics("") is None


def test_a_sample_without_in_flight_counts_what_the_server_holds() -> None:
    assert replace(sample(40, 7), in_flight=None).held == 47


# --- a worker's intake (worker.intake) -----------------------------------------------------


def test_a_worker_alone_takes_its_servers_limits_plus_the_spare() -> None:
    # Empty servers: their limits, plus a tenth of them waiting for a slot.
    assert intake([Room(0, 256, 0)], threads=1024) == 256 + 26
    # Busy with its own requests: the same, whatever it holds.
    assert intake([Room(200, 256, 200), Room(10, 64, 10)], threads=1024) == 320 + 32
    # A limit cut below what runs: only what it holds, and the spare.
    assert intake([Room(300, 200, 300)], threads=1024) == 300 + 20
    # A few threads: they cap it; never below one.
    assert intake([Room(0, 256, 0)], threads=64) == 64
    assert intake([], threads=64) == spare(0) == 2


def test_workers_sharing_a_server_share_its_free_slots() -> None:
    # Another worker holds 200 of 256: this one may take the 56 left, and its spare.
    assert intake([Room(0, 256, 200)], threads=1024) == 56 + 26
    # Full: only the spare waits (taking a slot the other gives back).
    assert intake([Room(50, 256, 256)], threads=1024) == 50 + 26


def test_a_workers_threads_by_default_reach_its_servers_highest_limits() -> None:
    adaptive = Settings(concurrency_max=1024)
    servers = [ServerSpec(url="http://a:1"), ServerSpec(url="http://b:1", max_inflight=32)]
    assert default_threads(adaptive, servers) == 1024 + 32
    fixed = Settings(adaptive_concurrency=False, server_max_inflight=300)
    assert default_threads(fixed, servers) == 300 + 32
    many = [ServerSpec(url=f"http://h{i}:1") for i in range(8)]
    assert default_threads(adaptive, many) == MAX_THREADS  # a bound, not 8 x 1024
    assert default_threads(Settings(worker_concurrency=48), many) == 48  # set: as set
