"""The one wire format (core.wire) against Celery's and kombu's own, in both directions."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from kombu import Connection

from core import wire
from core.broker import Publisher, waiting_job_ids
from core.settings import Settings
from worker.celeryconfig import make_celery

# Per-message values: ids, tags, the origin, the reply queue of the sending app, the eta.
VARYING = {"id", "root_id", "correlation_id", "delivery_tag", "origin", "reply_to", "eta"}
# Labels as Flower shows them: none, a plain one, and names JSON must escape.
TAGS = ["", wire.tag("chat", "r1"), wire.tag('we"ird\\ · näme', None)]


def strip(message: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in message.items():
        if key in VARYING:
            continue
        out[key] = strip(value) if isinstance(value, dict) else value
    return out


def celery_sends(broker_url: str, queue: str, **options: Any) -> dict[str, Any]:
    """The envelope Celery's send_task LPUSHes for ``generate(job_id=42)`` (labelled as
    ours are with ``argsrepr``: Celery's own option for what monitors show)."""
    options.setdefault("argsrepr", wire.label(42))
    app = make_celery(Settings(queue=queue), broker_url)
    app.conf.task_send_sent_event = False
    app.send_task(wire.TASK_GENERATE, kwargs={"job_id": 42}, queue=queue, **options)
    app.close()
    with redis.Redis.from_url(broker_url) as client:
        [raw] = client.lrange(queue, 0, -1)
        client.delete(queue)
    message: dict[str, Any] = json.loads(raw)
    # send_task hands every option on to kombu, which copies this one into the message
    # properties too; workers and monitors read the header, so ours carries only that.
    assert message["properties"].pop("argsrepr") == options["argsrepr"]
    return message


@pytest.mark.parametrize("tag", TAGS)
def test_envelope_matches_send_task(broker_url: str, tag: str) -> None:
    celery_message = celery_sends(broker_url, "q", argsrepr=wire.label(42, tag))
    ours = json.loads(wire.EnvelopeFactory("q", "host:1")(42, tag))
    assert strip(ours) == strip(celery_message)
    assert ours["headers"]["argsrepr"] == f"job 42{tag}"
    assert base64.b64decode(ours["body"]) == base64.b64decode(celery_message["body"])
    headers = ours["headers"]
    assert headers["id"] == headers["root_id"] == ours["properties"]["correlation_id"]
    assert headers["eta"] is None and celery_message["headers"]["eta"] is None


@pytest.mark.parametrize("countdown", [30, 0.5, 0])
def test_a_message_sent_back_matches_send_task_with_countdown_and_retries(
    broker_url: str, countdown: float
) -> None:
    tag = wire.tag("chat", "r1")
    celery_message = celery_sends(
        broker_url, "q", countdown=countdown, retries=3, argsrepr=wire.label(42, tag)
    )
    ours = json.loads(
        wire.EnvelopeFactory("q", "h:1").later(42, countdown=countdown, retries=3, job_tag=tag)
    )
    assert strip(ours) == strip(celery_message)
    assert ours["headers"]["retries"] == 3
    for message in (ours, celery_message):
        if not countdown:
            assert message["headers"]["eta"] is None
            continue
        eta = datetime.fromisoformat(message["headers"]["eta"])
        assert abs((eta - datetime.now(UTC)).total_seconds() - countdown) < 5


def test_a_message_sent_back_keeps_its_task_id() -> None:
    factory = wire.EnvelopeFactory("q", "h:1")
    first = json.loads(factory.later(7, countdown=1, retries=1, task_id="abc"))
    second = json.loads(factory.later(7, countdown=1, retries=2, task_id="abc"))
    assert first["headers"]["id"] == second["headers"]["id"] == "abc"
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]


@pytest.mark.parametrize("tag", TAGS)
def test_the_fast_rendering_is_the_defined_envelope(tag: str) -> None:
    factory = wire.EnvelopeFactory('we"ird%q', "h:1")
    for _ in range(2):  # the second from the factory's escaped tags
        fast = json.loads(factory(2**40, tag))
        defined = wire.envelope(
            2**40,
            queue='we"ird%q',
            origin="h:1",
            task_id=fast["headers"]["id"],
            delivery_tag=fast["properties"]["delivery_tag"],
            job_tag=tag,
        )
        assert fast == defined


def test_a_label_gives_back_its_tag_and_nothing_else() -> None:
    tag = wire.tag("chat · v2", "r1")
    assert wire.tag_of(7, wire.label(7, tag)) == tag
    assert wire.tag_of(7, wire.label(77, tag)) == ""  # another job's label
    for other in ("()", "job 7", None, "job 7x · dataset d"):
        assert wire.tag_of(7, other) == ""


def test_kombu_decodes_what_we_publish(broker_url: str) -> None:
    tag = wire.tag("chat", "r1")
    with Publisher(broker_url, "q") as publisher:
        publisher.publish([5, 7], {5: tag})
        publisher.publish_later(6, countdown=2, retries=1, job_tag=tag)
    with Connection(broker_url) as connection:
        channel = connection.default_channel
        decoded = []
        for _ in range(3):
            message = channel.basic_get("q", no_ack=True)
            assert message.content_type == "application/json"
            assert message.headers["task"] == wire.TASK_GENERATE
            decoded.append((message.payload, message.headers["retries"]))
            decoded.append(message.headers["argsrepr"])
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    assert decoded == [
        ([[], {"job_id": 5}, embed], 0),
        "job 5 · dataset chat · run r1",
        ([[], {"job_id": 7}, embed], 0),
        "job 7",
        ([[], {"job_id": 6}, embed], 1),
        "job 6 · dataset chat · run r1",
    ]


def test_we_read_back_what_celery_publishes(broker_url: str) -> None:
    celery_message = celery_sends(broker_url, "q")
    assert wire.job_id_of(json.dumps(celery_message)) == 42
    assert wire.job_id_of(b"not json") is None
    other = {**celery_message, "headers": {**celery_message["headers"], "task": "other.task"}}
    assert wire.job_id_of(json.dumps(other)) is None


def test_the_queue_is_read_back_through_the_same_format(broker_url: str) -> None:
    with Publisher(broker_url, "q") as publisher:
        publisher.publish([1, 2, 3])
        publisher.publish_later(4, countdown=60, retries=2)
    with redis.Redis.from_url(broker_url) as client:
        client.lpush("q", b"garbage")
        assert waiting_job_ids(client, "q") == {1, 2, 3, 4}


def test_delivery_tags_are_unique_and_a_jobs_task_id_is_its_own() -> None:
    # kombu keys a worker's unacked messages by delivery tag: two alike would lose one. The
    # task id is the job's, so that Flower follows a job through all of its messages.
    tags: set[str] = set()
    task_ids: dict[int, set[str]] = {7: set(), 8: set()}
    for factory in (wire.EnvelopeFactory("q", "h:1"), wire.EnvelopeFactory("q", "h:2")):
        for job_id in (7, 7, 8):
            message = json.loads(factory(job_id))
            task_id, tag = message["headers"]["id"], message["properties"]["delivery_tag"]
            for value in (task_id, tag):
                assert str(uuid.UUID(value)) == value
            tags.add(tag)
            task_ids[job_id].add(task_id)
        later = json.loads(factory.later(8, countdown=1, retries=1))
        task_ids[8].add(later["headers"]["id"])
    assert len(tags) == 6
    assert task_ids == {7: {wire.job_task_id("q", 7)}, 8: {wire.job_task_id("q", 8)}}
    assert wire.job_task_id("q", 7) != wire.job_task_id("other-queue", 7)
