"""The producer's hand-built task messages are the ones Celery's send_task would publish."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import redis

from eaglegen.queue import TASK_GENERATE, EnvelopeFactory, make_celery
from eaglegen.settings import Settings

# Per-message values: ids, tags, the origin and the reply queue of the sending app.
VARYING = {"id", "root_id", "correlation_id", "delivery_tag", "origin", "reply_to"}


def strip(message: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in message.items():
        if key in VARYING:
            continue
        out[key] = strip(value) if isinstance(value, dict) else value
    return out


def test_envelope_matches_send_task(broker_url: str) -> None:
    app = make_celery(Settings(broker_url=broker_url, queue="q"))
    app.conf.task_send_sent_event = False
    app.send_task(TASK_GENERATE, kwargs={"job_id": 42}, queue="q")
    app.close()
    client = redis.Redis.from_url(broker_url)
    [raw] = client.lrange("q", 0, -1)
    client.close()
    celery_message = json.loads(raw)
    ours = json.loads(EnvelopeFactory("q", "host:1")(42))
    assert strip(ours) == strip(celery_message)
    assert base64.b64decode(ours["body"]) == base64.b64decode(celery_message["body"])
    headers = ours["headers"]
    assert headers["id"] == headers["root_id"] == ours["properties"]["correlation_id"]


def test_every_envelope_has_fresh_ids() -> None:
    factory = EnvelopeFactory('we"ird%q', "h:1")
    first, second = json.loads(factory(1)), json.loads(factory(1))
    assert first["headers"]["id"] != second["headers"]["id"]
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]
    assert first["properties"]["delivery_info"]["routing_key"] == 'we"ird%q'


def test_task_ids_and_delivery_tags_are_unique_and_uuid_shaped() -> None:
    # kombu keys a worker's unacked messages by delivery tag: two alike would lose one.
    seen: set[str] = set()
    for factory in (EnvelopeFactory("q", "h:1"), EnvelopeFactory("q", "h:1")):
        for job_id in (7, 7, 8):  # the same job published twice gets new ids too
            message = json.loads(factory(job_id))
            ids = (message["headers"]["id"], message["properties"]["delivery_tag"])
            for value in ids:
                assert str(uuid.UUID(value)) == value
            seen.update(ids)
    assert len(seen) == 12
