"""Celery names and configuration shared by the producer (publishes) and the worker (consumes).

Messages carry ``{"job_id": int}`` only, JSON-serialized: Redis is transport, Postgres decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery import Celery

from eaglegen.settings import Settings

TASK_GENERATE = "eaglegen.generate"
# Far above the longest generation: a message not acked by then is redelivered, and a
# redelivery is only a hint (the claim in Postgres decides), but it wastes a slot.
VISIBILITY_TIMEOUT_S = 12 * 3600


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings of DESIGN §7."""
    if settings.broker_url is None:
        raise ValueError("no broker url: set EAGLEGEN_BROKER_URL or pass --broker-url")
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT_S},
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "task_default_queue": settings.queue,
        "worker_hijack_root_logger": False,
    }


def make_celery(settings: Settings) -> Celery:
    """A configured Celery app with no tasks registered."""
    app = Celery("eaglegen", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def publish(app: Celery, job_ids: Iterable[int], queue: str, countdown: float | None = None) -> int:
    """Publish one message per job id over a single broker connection; the count sent."""
    sent = 0
    with app.producer_or_acquire() as producer:
        for job_id in job_ids:
            app.send_task(
                TASK_GENERATE,
                kwargs={"job_id": int(job_id)},
                queue=queue,
                countdown=countdown,
                producer=producer,
            )
            sent += 1
    return sent
