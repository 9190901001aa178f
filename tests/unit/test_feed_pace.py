"""When the feeder looks at the queue list again (worker.feeder.FeedReport.next_pass_s),
and how large a window it keeps (worker.feeder.paced_window)."""

from __future__ import annotations

import logging
import math

import pytest

from worker.feeder import MAX_WINDOW, PACE_HORIZON_S, SOON_S, FeedLog, FeedReport, paced_window

INTERVAL = 1.0


def test_after_a_top_up_it_looks_again_soon() -> None:
    report = FeedReport(window=128, in_redis=10, published=118, skipped=0, taken_per_s=0.0)
    assert report.next_pass_s(INTERVAL) == SOON_S


def test_a_list_nobody_takes_from_waits_the_interval() -> None:
    report = FeedReport(window=128, in_redis=128, published=0, skipped=0, taken_per_s=0.0)
    assert report.next_pass_s(INTERVAL) == INTERVAL


def test_a_fast_drain_brings_the_next_pass_before_the_list_is_at_half() -> None:
    # 64 messages above half the window, taken at 200 a second: half is 0.32 s away.
    report = FeedReport(window=128, in_redis=128, published=0, skipped=0, taken_per_s=200.0)
    wait = report.next_pass_s(INTERVAL)
    assert SOON_S <= wait < 0.32
    assert wait == 0.16  # halfway there, to see the pace again before it is reached


def test_a_slow_drain_waits_at_most_the_interval() -> None:
    # A real run: a job every few seconds.
    report = FeedReport(window=128, in_redis=100, published=0, skipped=0, taken_per_s=0.4)
    assert report.next_pass_s(INTERVAL) == INTERVAL


def test_the_wait_never_drops_below_soon() -> None:
    report = FeedReport(window=128, in_redis=65, published=0, skipped=0, taken_per_s=10_000.0)
    assert report.next_pass_s(INTERVAL) == SOON_S


def test_the_window_holds_a_second_of_a_fast_pace_within_its_bound() -> None:
    # The heartbeats' window (twice what the workers run at once) stands while they take
    # fewer messages a second than it holds; a faster pace widens it to a second of it.
    assert paced_window(128, 0.0) == 128
    assert paced_window(128, 100.0) == 128
    assert paced_window(128, 700.5) == math.ceil(700.5 * PACE_HORIZON_S)
    assert paced_window(128, 1e9) == MAX_WINDOW


def test_a_window_that_follows_the_pace_is_said_when_it_halves_or_doubles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker.feeder")
    said = FeedLog("q")
    for window in (128, 700, 750, 650, 1300, 1500, 640):
        said.passed(FeedReport(window=window, in_redis=0, published=0, skipped=0))
    changes = [r.getMessage() for r in caplog.records if "window now" in r.getMessage()]
    assert changes == [
        "feeder: window now 700 message(s) (was 128)",
        "feeder: window now 1500 message(s) (was 700)",
        "feeder: window now 640 message(s) (was 1500)",
    ]
