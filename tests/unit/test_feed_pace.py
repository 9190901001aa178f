"""When the feeder looks at the queue list again (worker.feeder.FeedReport.next_pass_s)."""

from __future__ import annotations

from worker.feeder import SOON_S, FeedReport

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
