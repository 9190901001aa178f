"""Retry classification and backoff."""

from __future__ import annotations

import random

import pytest

from worker.retry import AttemptError, Disposition, backoff, classify_status, decide


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 599])
def test_server_side_statuses_retry(status: int) -> None:
    assert classify_status(status)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
def test_client_errors_do_not_retry(status: int) -> None:
    assert not classify_status(status)


def test_retryable_error_retries_until_attempts_run_out() -> None:
    error = AttemptError("503", retryable=True)
    assert decide(error, attempts=1, max_attempts=3) is Disposition.RETRY
    assert decide(error, attempts=2, max_attempts=3) is Disposition.RETRY
    assert decide(error, attempts=3, max_attempts=3) is Disposition.FAIL


def test_permanent_error_fails_at_once() -> None:
    assert decide(AttemptError("400", retryable=False), 1, 5) is Disposition.FAIL


def test_backoff_is_jittered_and_capped() -> None:
    rng = random.Random(7)
    samples = [backoff(attempt, base_s=1.0, cap_s=8.0, rng=rng) for attempt in range(1, 12)]
    assert all(0 <= s <= 8.0 for s in samples)
    assert backoff(1, base_s=1.0, cap_s=8.0, rng=random.Random(1)) <= 1.0
    assert len(set(samples)) == len(samples)  # jitter: no two equal waits
    many = [backoff(10, base_s=1.0, cap_s=8.0, rng=rng) for _ in range(500)]
    assert max(many) > 6.0  # the cap, not the exponent, bounds late attempts
