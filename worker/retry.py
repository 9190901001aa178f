"""Retry policy: which failures retry, and after how long. Pure, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum, StrEnum

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ErrorKind(StrEnum):
    """A failed attempt's class: short and stable, for the job's attempt history, the
    workers' Prometheus error label and Flower; the reason itself says the rest."""

    TIMEOUT = "timeout"  # connect or read timeout
    CONNECTION = "connection"  # refused, reset or dropped, a stream cut before its end
    HTTP_4XX = "http_4xx"  # a non-200 status below 500 (408 and 429 among them)
    HTTP_5XX = "http_5xx"
    MALFORMED = "malformed"  # a body or chunk that is not JSON
    INVALID_RESPONSE = "invalid_response"  # JSON that breaks the contract (worker.validate)
    ABORTED = "aborted"  # finish_reason abort
    STALLED = "stalled"  # no progress for stall_timeout_s
    TOO_LARGE = "too_large"  # over max_response_bytes
    INVALID_REQUEST = "invalid_request"  # refused before sending (sampling params)
    UNEXPECTED = "unexpected"  # nothing foresaw it (a bug here or a strange server)


def status_kind(status: int) -> ErrorKind:
    """The class of a non-200 HTTP status."""
    return ErrorKind.HTTP_5XX if status >= 500 else ErrorKind.HTTP_4XX


class Disposition(Enum):
    """What to do with a job after a failed attempt."""

    RETRY = "retry"
    FAIL = "fail"


# Not frozen: raising sets __traceback__ on the exception (contextlib does, re-raising
# through a `with`), which a frozen dataclass refuses.
@dataclass(eq=False)
class AttemptError(Exception):
    """A failed attempt: the reason and whether another attempt can succeed."""

    reason: str
    retryable: bool
    transport: bool = False  # the connection failed: says something about the server
    kind: ErrorKind = ErrorKind.UNEXPECTED

    def __str__(self) -> str:
        return self.reason


def classify_status(status: int) -> bool:
    """Whether an HTTP status from the server is worth retrying."""
    return status in RETRYABLE_STATUS or status >= 500


def decide(error: AttemptError, attempts: int, max_attempts: int) -> Disposition:
    """Retry a retryable error while attempts remain; otherwise fail the job."""
    if error.retryable and attempts < max_attempts:
        return Disposition.RETRY
    return Disposition.FAIL


def backoff(
    attempt: int, base_s: float = 1.0, cap_s: float = 60.0, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    ceiling = min(cap_s, base_s * 2 ** max(attempt - 1, 0))
    return (rng or random).uniform(0, ceiling)
