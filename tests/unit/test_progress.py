"""Rates and ETAs of `eaglegen status`, from hand-made snapshots."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from core.heartbeat import Heartbeat, ServerBeat
from eaglegen.report.progress import (
    MIN_SPAN_S,
    dataset_progress,
    format_eta,
    run_progress,
    server_rows,
    whole_run_rate,
    window_rate,
)
from models.snapshot import DatasetStatus, ServerStatus, Window

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def dataset(
    *,
    queued: int = 0,
    running: int = 0,
    done: int = 0,
    completion: int = 0,
    prompt: int = 0,
    budget: int | None = None,
    used: int = 0,
    basis: str = "completion",
    recent: tuple[int, int, int] = (0, 0, 0),  # completions, completion, prompt in 10 min
    name: str = "d",
    covered: float | None = None,  # seconds the recent work spans (None: the whole window)
) -> DatasetStatus:
    n, c, p = recent
    short = None if covered is None else min(covered, 60.0)
    return DatasetStatus(
        run="r",
        dataset=name,
        states={"queued": queued, "running": running, "done": done, "failed": 0,
                "skipped_budget": 0},
        done_prompt_tokens=prompt,
        done_completion_tokens=completion,
        budget_tokens=budget,
        budget_basis=basis,
        used_tokens=used,
        reserved_tokens=0,
        first_done_at=T0 if done else None,
        last_done_at=T0 + timedelta(hours=1) if done > 1 else (T0 if done else None),
        windows=(Window(60, n // 10, c // 10, p // 10, short), Window(600, n, c, p, covered)),
    )  # fmt: skip


def test_a_window_rate_is_its_sums_over_its_length() -> None:
    rate = window_rate(Window(600, completions=30, completion_tokens=60_000, prompt_tokens=6_000))
    assert (rate.label, rate.completion_tok_s, rate.completions_per_min) == ("10m", 100.0, 3.0)


def test_a_window_the_work_started_within_divides_by_the_time_it_spans() -> None:
    # A run 60 s old at 24,000 tok/s: its 10-minute window holds 60 s of work, not 600.
    rate = window_rate(Window(600, completions=60, completion_tokens=1_440_000, covered_s=60.0))
    assert (rate.completion_tok_s, rate.completions_per_min, rate.span_s) == (24_000, 60, 60)
    assert rate.as_dict()["span_s"] == 60.0
    # Work that filled the window (or more: a generation begun before it) spans all of it.
    full = window_rate(Window(600, completions=60, completion_tokens=60_000, covered_s=600.0))
    assert (full.completion_tok_s, full.span_s) == (100.0, 600)
    # Generations recorded an instant after they started: never a division by ~0.
    instant = window_rate(Window(60, completions=3, completion_tokens=300, covered_s=0.0))
    assert instant.span_s == MIN_SPAN_S and instant.completion_tok_s == 300 / MIN_SPAN_S


def test_a_datasets_eta_in_its_first_minute_is_at_the_rate_it_runs() -> None:
    # 15 s in, 250 of 1,000 jobs done: 750 left at 1,000 a minute is 45 s, not the 30
    # minutes that 250 completions spread over the whole 10 minutes would say.
    d = dataset(queued=700, running=50, done=250, completion=250_000,
                recent=(250, 250_000, 25_000), covered=15.0)  # fmt: skip
    progress = dataset_progress(d)
    ten = progress.rates[1]
    assert (ten.label, ten.completions_per_min, ten.completion_tok_s) == ("10m", 1000, 250_000 / 15)
    assert progress.eta_s == pytest.approx(45.0)
    assert format_eta(progress.eta_s) == "45s"


def test_the_run_rate_spans_from_the_earliest_dataset_start() -> None:
    # a has run for 2 minutes, b for 30 s, c nothing lately: the run's work spans 2 minutes.
    a = dataset(name="a", queued=100, done=10, completion=120_000,
                recent=(10, 120_000, 0), covered=120.0)  # fmt: skip
    b = dataset(name="b", queued=100, done=5, completion=60_000,
                recent=(5, 60_000, 0), covered=30.0)  # fmt: skip
    c = dataset(name="c", queued=100)
    progress = run_progress([a, b, c])
    one, ten = progress.rates
    assert (ten.span_s, ten.completion_tok_s) == (120.0, 180_000 / 120)
    assert one.span_s == 60.0  # the shorter window is full
    # 300 jobs at the run's mean of 12,000 tokens over 1,500 tok/s.
    assert progress.eta_s == pytest.approx(300 * 12_000 / 1500)


def test_the_whole_run_rate_spans_first_to_last_generation() -> None:
    rate = whole_run_rate(dataset(done=3600, completion=3_600_000))
    assert rate is not None and rate.completion_tok_s == 1000.0 and rate.completions_per_min == 60
    assert whole_run_rate(dataset(done=1, completion=10)) is None  # one instant: no span


def test_eta_is_jobs_left_over_the_completion_rate() -> None:
    # 26 completions a minute (the real run's), 89,000 jobs left: about 57 hours.
    d = dataset(queued=88_950, running=50, done=1000, completion=3_500_000, recent=(260, 0, 0))
    progress = dataset_progress(d)
    assert progress.eta_s == pytest.approx(89_000 / (26 / 60))
    assert format_eta(progress.eta_s) == "2d 9h"


def test_eta_is_the_budget_when_it_comes_first() -> None:
    # 1,000 tok/s against 100k tokens left: 100 s, long before the 10,000 jobs are done.
    d = dataset(queued=10_000, done=10, completion=9_900_000, budget=10_000_000,
                used=9_900_000, recent=(100, 600_000, 0))  # fmt: skip
    assert dataset_progress(d).eta_s == pytest.approx(100.0)


def test_a_total_budget_is_spent_by_prompts_too() -> None:
    d = dataset(queued=10_000, done=10, completion=5, budget=200_000, used=100_000,
                basis="total", recent=(100, 300_000, 300_000))  # fmt: skip
    assert dataset_progress(d).eta_s == pytest.approx(100_000 / 1000.0)


def test_finished_datasets_and_stalled_ones() -> None:
    assert dataset_progress(dataset(done=5, completion=50)).finished == "all jobs done"
    spent = dataset_progress(dataset(queued=9, done=5, budget=50, used=50))
    assert (spent.finished, spent.eta_s, format_eta(spent.eta_s, spent.finished)) == (
        "budget reached", 0.0, "done")  # fmt: skip
    stalled = dataset_progress(dataset(queued=9, done=5, completion=50))
    assert (stalled.finished, stalled.eta_s, format_eta(stalled.eta_s)) == (None, None, "?")


def test_the_run_eta_is_all_tokens_left_over_the_whole_rate() -> None:
    # a: 100 jobs of 1,000 tokens left; b: not started, takes the run's mean (1,000), capped
    # by its budget of 20,000 tokens. 1,000 tok/s in all: (100,000 + 20,000) / 1,000.
    a = dataset(name="a", queued=100, done=10, completion=10_000, recent=(60, 600_000, 0))
    b = dataset(name="b", queued=500, budget=20_000)
    progress = run_progress([a, b])
    assert progress.remaining_tokens == pytest.approx(120_000)
    assert progress.eta_s == pytest.approx(120.0)
    assert progress.remaining_jobs == 600 and progress.finished is None


def test_servers_merge_heartbeats_and_recent_figures() -> None:
    def beat(pid: int, servers: dict[str, tuple[bool, int, int]]) -> Heartbeat:
        return Heartbeat(
            worker=f"w{pid}", nodename=f"w{pid}@h", host="h", pid=pid, ts=0.0, in_flight=0,
            threads=64, consuming=True, db_pool=8,
            servers={name: ServerBeat(healthy=up, reason=None if up else "down", held=held,
                                      limit=limit, adaptive=False, model="m")
                     for name, (up, held, limit) in servers.items()},
        )  # fmt: skip

    beats = [
        beat(1, {"gpu-a": (True, 3, 64)}),
        beat(2, {"gpu-a": (False, 2, 64), "gpu-b": (False, 0, 32)}),
    ]
    recent = [ServerStatus("gpu-a", (Window(60, 6, 6000, 0),), {"timeout": 2}),
              ServerStatus("gpu-c", (Window(60, 0, 0, 0),), {"connection": 1})]  # fmt: skip
    rows = {r["name"]: r for r in server_rows(recent, beats)}
    assert rows["gpu-a"]["in_flight"] == 5 and rows["gpu-a"]["up"] is True
    assert rows["gpu-a"]["completion_tok_s_1m"] == 100.0 and rows["gpu-a"]["errors"] == {
        "timeout": 2}  # fmt: skip
    assert rows["gpu-b"]["up"] is False and rows["gpu-b"]["limit"] == 32
    assert rows["gpu-c"]["up"] is None  # no live worker reports it


def test_eta_formats() -> None:
    assert [format_eta(s) for s in (45, 125, 3 * 3600 + 720, 90_000)] == [
        "45s", "2m 05s", "3h 12m", "1d 1h"]  # fmt: skip
