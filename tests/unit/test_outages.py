"""What a worker says about conditions that last (worker.outages.Outages) and what its
feeder says (worker.feeder.FeedLog): changes of state, reminders, never a line per pass."""

from __future__ import annotations

import logging

import pytest
import redis
from sqlalchemy.exc import InterfaceError, OperationalError

from worker.feeder import FeedLog, FeedReport
from worker.outages import (
    DATABASE_UNREACHABLE,
    REDIS_FULL,
    REDIS_UNREACHABLE,
    Outages,
    service_trouble,
)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_an_outage_is_one_line_then_a_reminder_per_interval_then_one_line(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    caplog.set_level(logging.INFO)
    outages = Outages(remind_s=60, logger=logging.getLogger("test.outages"), clock=clock)
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    for _ in range(200):  # a pass every half second for 100 s
        assert outages.service_down(down)
        clock.now += 0.5
    outages.database_ok()
    outages.database_ok()  # nothing to say: it is not down
    assert said(caplog) == [
        "database unreachable: connection refused; retrying",
        "database unreachable (for 60 s): connection refused; retrying",
        "database back after 100 s",
    ]
    assert all(r.exc_info is None for r in caplog.records)


def test_an_unforeseen_error_keeps_its_trace_once(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    caplog.set_level(logging.INFO)
    outages = Outages(remind_s=10, logger=logging.getLogger("test.outages"), clock=clock)
    error = RuntimeError("bug")
    for _ in range(3):
        outages.down("worker x loop failing", "RuntimeError: bug", ended="x ok", exc_info=error)
        clock.now += 10
    outages.up("worker x loop failing")
    assert [r.exc_info is not None for r in caplog.records] == [True, False, False, False]
    assert said(caplog)[-1] == "x ok after 30 s"


def test_errors_are_sorted_by_the_service_they_say_is_down() -> None:
    assert service_trouble(OperationalError("x", {}, Exception())) == DATABASE_UNREACHABLE
    # A connection the server closed under SQLAlchemy: the same outage (models.db's rule).
    assert service_trouble(InterfaceError("x", {}, Exception())) == DATABASE_UNREACHABLE
    assert service_trouble(redis.ConnectionError("refused")) == REDIS_UNREACHABLE
    assert service_trouble(ValueError("bug")) is None


FULL = "command not allowed when used memory > 'maxmemory'."
# What redis-py raises for a script whose write Redis refused (a slot lease, say).
IN_SCRIPT = f"Error running script (call to f_0d30): @user_script:8: @user_script: 8: -OOM {FULL}"


@pytest.mark.parametrize("error", [redis.OutOfMemoryError(FULL), redis.ResponseError(IN_SCRIPT)])
def test_a_redis_that_refuses_writes_is_full_not_unreachable_until_a_write_passes(
    error: redis.RedisError, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    outages = Outages()
    assert service_trouble(error) == REDIS_FULL
    outages.failed("heartbeat loop", error)
    assert outages.reason(REDIS_FULL) == FULL  # Redis's words, without the script's
    outages.redis_ok()  # a read: writes may still be refused
    assert outages.holds(REDIS_FULL) and not outages.holds(REDIS_UNREACHABLE)
    outages.redis_ok(wrote=True)
    assert outages.reason(REDIS_FULL) is None
    assert said(caplog) == [f"{REDIS_FULL}: {FULL}; retrying", "Redis takes writes again after 0 s"]
    assert service_trouble(redis.ResponseError("WRONGTYPE Operation against a key")) != REDIS_FULL


def test_the_feeder_says_its_changes_of_state_and_a_summary_not_each_pass(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    caplog.set_level(logging.INFO)
    feed_log = FeedLog("q", summary_s=600, logger=logging.getLogger("test.feeder"), clock=clock)
    feed_log.leading(True)
    for _ in range(1500):  # a pass publishing 32 messages every 0.5 s, for 12.5 min
        feed_log.passed(FeedReport(64, 32, 32, 0, 60.0, queried=True))
        clock.now += 0.5
    feed_log.passed(FeedReport(64, 0, 0, 0, 60.0, queried=True, idle=True))
    feed_log.passed(FeedReport(64, 0, 0, 0, 0.0, queried=True, idle=True))
    feed_log.leading(False)
    assert said(caplog) == [
        "feeder: this worker feeds queue q now",
        "feeder: publishing queue q (window 64 message(s))",
        "feeder: in the last 10 min: 38,432 message(s) published, 0 job(s) of spent budgets "
        "skipped; window 64, 64 waiting in Redis",
        "feeder: nothing left to publish on queue q (48,000 message(s) published)",
        "feeder: another worker feeds queue q now",
    ]
