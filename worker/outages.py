"""What a worker says about conditions that last: a service out of reach, a server down, a
side loop failing. One line when the condition starts, a short reminder at most every
``EAGLEGEN_LOG_REMINDER_S`` while it lasts (never a stack trace again), one line when it ends:
a log line per change of state, not one per pass of the loop or per job that meets it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy.exc import TimeoutError as SQLTimeoutError

from models.db import is_lock_timeout, lost_database

log = logging.getLogger(__name__)

# The conditions a service's errors start (see `service_trouble`).
DATABASE_UNREACHABLE = "database unreachable"
DATABASE_BUSY = "database busy"
REDIS_UNREACHABLE = "Redis unreachable"
# Redis answers but refuses writes for want of memory (maxmemory reached, noeviction).
REDIS_FULL = "Redis refuses writes"
_ENDINGS = {
    DATABASE_UNREACHABLE: "database back",
    DATABASE_BUSY: "database answering again",
    REDIS_UNREACHABLE: "Redis back",
    REDIS_FULL: "Redis takes writes again",
}
REMINDER_S = 60.0


@dataclass
class _Condition:
    since: float  # when it started (monotonic)
    said: float  # when a line last said it
    reason: str  # why, as it was first said
    ended: str | None  # what to say when it ends (None: nothing)


class Outages:
    """Conditions that hold now in this process, shared by its threads."""

    def __init__(
        self,
        remind_s: float = REMINDER_S,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remind_s = remind_s
        self._log = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._holding: dict[str, _Condition] = {}
        # How many times each condition began: a connection opened before the database's
        # last outage began is no longer to be trusted (worker.loop).
        self.began: Counter[str] = Counter()

    def down(
        self,
        condition: str,
        reason: str,
        *,
        then: str = "retrying",
        ended: str | None = None,
        exc_info: BaseException | None = None,
    ) -> None:
        """``condition`` holds (e.g. "database unreachable") because of ``reason``, and
        ``then`` is what the worker does meanwhile. Said at once if it is new (with
        ``exc_info``'s trace, for an error nobody foresaw), again at most every
        ``remind_s`` without a trace; ``ended`` is said when it ends (default: the endings
        of the service conditions, else nothing)."""
        now = self._clock()
        with self._lock:
            held = self._holding.get(condition)
            if held is None:
                ending = ended if ended is not None else _ENDINGS.get(condition)
                self._holding[condition] = _Condition(now, now, reason, ending)
                self.began[condition] += 1
                line: str | None = f"{condition}: {reason}; {then}"
            elif now - held.said >= self.remind_s:
                held.said = now
                line = f"{condition} (for {now - held.since:.0f} s): {reason}; {then}"
                exc_info = None
            else:
                line = None
        if line is not None:
            self._log.warning("%s", line, exc_info=exc_info)

    def up(self, condition: str) -> None:
        """``condition`` no longer holds: its ending is said, if it held."""
        if condition not in self._holding:  # the common case, without the lock
            return
        with self._lock:
            held = self._holding.pop(condition, None)
        if held is not None and held.ended is not None:
            self._log.warning("%s after %.0f s", held.ended, self._clock() - held.since)

    def failed(self, part: str, exc: Exception) -> None:
        """A pass of one of the worker's loops (``part``: "heartbeat loop", "intake", ...)
        failed: a service out of reach is that service's outage; an error nobody foresaw is
        said with its trace once, then reminded of, until `passed`."""
        if not self.service_down(exc):
            self.down(
                f"worker {part} failing",
                f"{type(exc).__name__}: {one_line(exc)}",
                ended=f"worker {part} works again",
                exc_info=exc,
            )

    def passed(self, part: str) -> None:
        """A pass of that loop went through."""
        self.up(f"worker {part} failing")

    def holds(self, condition: str) -> bool:
        """Whether ``condition`` holds now."""
        return condition in self._holding

    def reason(self, condition: str) -> str | None:
        """Why ``condition`` holds, as first said; None while it does not."""
        with self._lock:
            held = self._holding.get(condition)
        return None if held is None else held.reason

    def database_ok(self) -> None:
        """A statement just went through: the database is reachable and answers."""
        self.up(DATABASE_UNREACHABLE)
        self.up(DATABASE_BUSY)

    def redis_ok(self, wrote: bool = False) -> None:
        """A Redis command just went through (``wrote``: one that writes)."""
        self.up(REDIS_UNREACHABLE)
        if wrote:
            self.up(REDIS_FULL)

    def service_down(self, exc: BaseException) -> bool:
        """Note ``exc`` if it says a service is out of reach or busy; whether it did."""
        condition = service_trouble(exc)
        if condition is None:
            return False
        refusal = redis_full(exc) if condition == REDIS_FULL else None
        self.down(condition, refusal or one_line(exc))
        return True


def service_trouble(exc: BaseException) -> str | None:
    """The condition ``exc`` is a sign of (a service out of reach or busy), None for any
    other error."""
    if isinstance(exc, SQLTimeoutError) or is_lock_timeout(exc):
        return DATABASE_BUSY  # every pooled connection in use, or a row held too long
    if lost_database(exc) is not None:  # the one rule for "Postgres is gone" (models.db)
        return DATABASE_UNREACHABLE
    if redis_full(exc) is not None:
        return REDIS_FULL
    if isinstance(exc, redis.RedisError | KombuOperationalError):
        return REDIS_UNREACHABLE
    return None


def redis_full(exc: BaseException) -> str | None:
    """Redis's refusal if ``exc`` is one of a write for want of memory (maxmemory reached
    under noeviction), directly or from inside a script; None for any other error."""
    if isinstance(exc, redis.OutOfMemoryError):
        return one_line(exc)
    if isinstance(exc, redis.ResponseError) and "-OOM " in (text := str(exc)):
        return " ".join(text.split("-OOM ", 1)[1].split())[:300]
    return None


def one_line(exc: BaseException) -> str:
    """An error as one short line: the driver's message when there is one."""
    cause = getattr(exc, "orig", None) or exc
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text[:300]
