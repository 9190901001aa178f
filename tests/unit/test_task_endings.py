"""How a task ends in Flower (worker.events.ending): the loop engine sends by hand the event
the Celery engine's task ends with, so each outcome must name the same thing both ways."""

from __future__ import annotations

import pytest
from celery.utils.saferepr import saferepr

from core import wire
from worker.app import JobFailed, SentBack
from worker.events import GIVEN_BACK, ending, sent_back
from worker.runner import CLAIM_LOST, SENT_BACK, Outcome, Result, unclaimed


@pytest.mark.parametrize("outcome", sorted(SENT_BACK, key=lambda o: o.value))
def test_a_job_sent_back_is_a_retry_with_its_reason_as_the_celery_engine_raises_it(
    outcome: Outcome,
) -> None:
    reason = "no free slot: this worker's servers are full"
    kind, fields = ending(Result(outcome, 1.5, reason=reason))
    assert kind == "task-retried"
    # Celery's worker sends the Retry's repr and (worker.app.GenerateTask.on_retry) its text.
    raised = SentBack(reason, when=1.5)
    assert fields == {"exception": repr(raised), "traceback": str(raised)}
    assert sent_back(GIVEN_BACK) == repr(SentBack(GIVEN_BACK))


def test_a_failed_job_is_a_failure_with_the_exception_the_celery_engine_raises() -> None:
    reason = "after 2 attempt(s) (http_4xx): HTTP 400 from sim"
    assert ending(Result(Outcome.FAILED, reason=reason)) == (
        "task-failed",
        {"exception": repr(JobFailed(reason)), "traceback": None},
    )


def test_a_skipped_job_is_skipped_and_never_a_success() -> None:
    result = unclaimed("skipped", 5.0)
    assert ending(result) == (wire.SKIPPED_EVENT, {"result": wire.SKIPPED_RESULT})


def test_a_done_job_shows_its_tokens_and_a_turned_away_one_says_why() -> None:
    assert ending(Result(Outcome.DONE, tokens=12_345)) == (
        "task-succeeded",
        {"result": saferepr("done · 12,345 tokens")},
    )
    assert ending(Result(Outcome.LOST, reason=CLAIM_LOST)) == (
        "task-succeeded",
        {"result": saferepr(f"lost: {CLAIM_LOST}")},
    )
    not_queued = ending(unclaimed("not_queued", 5.0))
    assert not_queued == ("task-succeeded", {"result": saferepr(f"not_claimed: {NOT_QUEUED}")})


def test_a_deferral_waits_the_budget_wait_and_says_so() -> None:
    result = unclaimed("deferred", 2.5)
    assert result.outcome is Outcome.DEFERRED and result.retry_in_s == 2.5
    assert result.reason.startswith("budget deferral:") and "2.5 s" in result.reason
    assert ending(result)[0] == "task-retried"


NOT_QUEUED = "no longer queued (done or taken elsewhere)"
