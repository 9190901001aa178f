"""The worker's Celery app configuration (docs/design.md §7)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from core.settings import Settings
from core.urls import password_in_userinfo

# Far above the longest generation: a message not acked by then is redelivered, and a
# redelivery is only a hint (the claim in Postgres decides), but it wastes a slot.
VISIBILITY_TIMEOUT_S = 12 * 3600


def celery_config(settings: Settings, broker_url: str) -> dict[str, Any]:
    """The Celery settings of docs/design.md §7: JSON only, late acks, one message prefetched."""
    return {
        "broker_url": password_in_userinfo(broker_url),  # the one form kombu reads
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
        # kombu's Redis transport, with one failure mapped to the error it means (see there).
        "broker_transport": "worker.transport:Transport",
    }


def make_celery(settings: Settings, broker_url: str) -> Celery:
    """A configured Celery app with no tasks registered."""
    app = Celery("eaglegen", set_as_current=False)
    app.conf.update(celery_config(settings, broker_url))
    return app
