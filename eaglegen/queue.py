"""Celery names and configuration shared by the producer (publishes) and the worker (consumes).

Messages carry ``{"job_id": int}`` only, JSON-serialized: Redis is transport, Postgres decides.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import socket
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis
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
        # kombu's Redis transport, with one failure mapped to the error it means (see there).
        "broker_transport": "eaglegen.redis_transport:Transport",
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


# Celery's task-message protocol 2 in kombu's Redis envelope, built directly: enqueueing 1M
# prompts through send_task costs ~120 us a message, this a few. A unit test pins the
# envelope to what send_task produces, and every integration test consumes these messages.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_SLOTS = {
    "id": "\x01id\x01",
    "kwargsrepr": "\x01kw\x01",
    "body": "\x01body\x01",
    "tag": "\x01tag\x01",
}
_SLOT_ORDER = list(_SLOTS)


def _envelope(queue: str, origin: str) -> dict[str, Any]:
    return {
        "body": _SLOTS["body"],
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": TASK_GENERATE,
            "id": _SLOTS["id"],
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": _SLOTS["id"],
            "parent_id": None,
            "argsrepr": "()",
            "kwargsrepr": _SLOTS["kwargsrepr"],
            "origin": origin,
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": _SLOTS["id"],
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": _SLOTS["tag"],
        },
    }


class EnvelopeFactory:
    """Renders the envelope for one job id from a template serialized once."""

    def __init__(self, queue: str, origin: str) -> None:
        template = json.dumps(_envelope(queue, origin))
        # The template cut at its slots: each envelope is a join of these pieces and the
        # slot values (formatting the whole template per message cost twice as much).
        names = {json.dumps(slot)[1:-1]: name for name, slot in _SLOTS.items()}
        pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", template)
        self._literals = pieces[0::2]
        self._slots = [_SLOT_ORDER.index(names[slot]) for slot in pieces[1::2]]
        # Task ids and delivery tags must be unique per message (kombu keys its unacked
        # messages by the tag): a random prefix per factory for each and a counter make
        # them so, in UUID shape, without the two uuid4() calls a message that cost a third
        # of its time.
        self._id_prefix = str(uuid.uuid4())[:24]
        self._tag_prefix = str(uuid.uuid4())[:24]
        self._serial = itertools.count()

    def __call__(self, job_id: int) -> str:
        """The JSON string kombu's Redis transport would LPUSH for ``generate(job_id)``."""
        job_id = int(job_id)  # never anything but digits inside the template
        serial = f"{next(self._serial):012x}"
        body = b'[[], {"job_id": %d}, ' % job_id + _EMBED_JSON + b"]"
        values = (  # in _SLOT_ORDER
            self._id_prefix + serial,
            f"{{'job_id': {job_id}}}",
            base64.b64encode(body).decode(),
            self._tag_prefix + serial,
        )
        literals = self._literals
        out = [literals[0]]
        for i, slot in enumerate(self._slots, 1):
            out.append(values[slot])
            out.append(literals[i])
        return "".join(out)


_EMBED_JSON = json.dumps(_EMBED).encode()


class BulkPublisher:
    """Publishes many job ids with one LPUSH per batch (the producer's hot path)."""

    def __init__(self, broker_url: str, queue: str) -> None:
        self.queue = queue
        self._envelope = EnvelopeFactory(queue, f"{socket.gethostname()}:{os.getpid()}")
        self._client = redis.Redis.from_url(broker_url)

    def publish(self, job_ids: Sequence[int]) -> int:
        """Publish one message per id, in order (workers pop the oldest first)."""
        if not job_ids:
            return 0
        command = lpush_command(self.queue, [self._envelope(i).encode() for i in job_ids])
        pool = self._client.connection_pool
        connection: Any = pool.get_connection()  # redis-py leaves these methods untyped

        def send() -> None:
            connection.send_packed_command([command])  # a list: bytes would be iterated
            connection.read_response()

        try:
            # Retried as redis-py retries its own commands; a push repeated after a lost
            # reply only duplicates messages, which are hints (DESIGN §2).
            connection.retry.call_with_retry(send, lambda _error: connection.disconnect())
        except BaseException:
            connection.disconnect()  # part of the command may be on the wire: start afresh
            raise
        finally:
            pool.release(connection)
        return len(job_ids)

    def close(self) -> None:
        """Release the connection."""
        self._client.close()


def lpush_command(key: str, values: Sequence[bytes]) -> bytes:
    """``LPUSH key values...`` in the Redis protocol (RESP).

    redis-py builds it argument by argument in Python: for a batch of envelopes that took
    four times the CPU of this join (measured: 2.8 vs 0.5 us a message).
    """
    name = key.encode()
    parts = [b"*%d\r\n$5\r\nLPUSH\r\n$%d\r\n%s\r\n" % (len(values) + 2, len(name), name)]
    for value in values:
        parts.append(b"$%d\r\n" % len(value))
        parts.append(value)
        parts.append(b"\r\n")
    return b"".join(parts)
