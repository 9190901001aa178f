"""The worker's Redis transport (worker.transport) sends kombu's ack emulation's writes to the
unacked index in batches, not in a round trip per delivery and per ack: checked here with
kombu's own consumer on a real Redis, and with a real worker, whose writes all reach Redis by
the time it is idle, and which leaves nothing to come back to the queue at its stop."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from core.settings import Settings
from tests.helpers import InspectRepository, enqueue_file, sample_rows, write_jsonl
from tests.integration.test_worker_processes import wait_for, worker_env, worker_process
from tests.workers import CELERY_ONLY
from worker.transport import Channel, Transport

QUEUE = "acks-test"
# kombu's ack emulation keeps each delivered message here until its ack.
UNACKED, UNACKED_INDEX = Channel.unacked_key, Channel.unacked_index_key


@pytest.fixture
def broker(broker_url: str) -> redis.Redis:
    return redis.Redis.from_url(broker_url)


def _connection(broker_url: str) -> Connection:
    return Connection(broker_url, transport=Transport)


def _publish(broker_url: str, n: int) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    with _connection(broker_url) as conn:
        producer = Producer(conn.channel(), exchange=queue.exchange, routing_key=QUEUE)
        for i in range(n):
            producer.publish({"n": i}, declare=[queue], serializer="json")


def _unacked(broker: redis.Redis) -> tuple[int, int]:
    return int(broker.hlen(UNACKED)), int(broker.zcard(UNACKED_INDEX))


@contextmanager
def _consuming(broker_url: str, prefetch: int) -> Iterator[tuple[Connection, list[Any]]]:
    """kombu's own consumer of QUEUE on the worker's transport, taking ``prefetch`` messages
    at most before an ack; the connection and the messages received so far. Its channel
    is closed at the end, as a stopping worker's is."""
    received: list[Any] = []
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    with _connection(broker_url) as conn:
        channel = conn.channel()
        channel.basic_qos(0, prefetch, False)
        with Consumer(channel, [queue], callbacks=[lambda _body, m: received.append(m)]):
            yield conn, received
        channel.close()


def test_deliveries_and_acks_reach_the_index_together_and_an_early_ack_never_does(
    broker_url: str, broker: redis.Redis
) -> None:
    _publish(broker_url, 3)
    with _consuming(broker_url, 2) as (conn, received):
        while len(received) < 2:
            conn.drain_events(timeout=5)
        # Counted as delivered (the prefetch limit reads that), not written yet.
        assert _unacked(broker) == (0, 0)
        received[0].ack()
        received[0].channel.qos.flush_unacked()  # now, as the event loop would in a while
        # One batch: the second's delivery; the first, acked before its write, not at all.
        assert broker.hkeys(UNACKED) == [received[1].delivery_tag.encode()]
        assert _unacked(broker) == (1, 1)
        received[1].ack()
        assert _unacked(broker) == (1, 1)  # its removal waits for the next batch
    # The close sent it: nothing left unacked, nothing back in the queue.
    assert _unacked(broker) == (0, 0)
    assert broker.llen(QUEUE) == 1  # only the third, never delivered


def test_the_event_loops_flush_writes_a_held_message_once_it_has_waited(
    broker_url: str, broker: redis.Redis
) -> None:
    _publish(broker_url, 1)
    with _consuming(broker_url, 1) as (conn, _):
        conn.drain_events(timeout=5)

        def written() -> bool:
            conn.transport.flush_unacked()  # what the worker's event loop calls at each turn
            return _unacked(broker) == (1, 1)

        wait_for(written, 10, "the held message written to the unacked index")
        assert broker.llen(QUEUE) == 0
    assert broker.llen(QUEUE) == 1  # the close gave it back


def test_a_requeued_message_goes_back_to_the_queue_before_any_flush(
    broker_url: str, broker: redis.Redis
) -> None:
    _publish(broker_url, 2)
    with _consuming(broker_url, 1) as (conn, received):
        conn.drain_events(timeout=5)
        received[0].requeue()  # its delivery was never written: the requeue writes it first
        assert _unacked(broker) == (0, 0)
        assert broker.llen(QUEUE) == 2
        tag = received[0].delivery_tag
        assert any(tag in m.decode() for m in broker.lrange(QUEUE, 0, -1))
        while len(received) < 3:
            conn.drain_events(timeout=5)
            received[-1].ack()
    assert [m.delivery_tag for m in received].count(tag) == 2
    assert _unacked(broker) == (0, 0)
    assert broker.llen(QUEUE) == 0


def test_a_channel_closed_with_a_message_unacked_gives_it_back_and_keeps_the_acked(
    broker_url: str, broker: redis.Redis
) -> None:
    _publish(broker_url, 2)
    with _consuming(broker_url, 2) as (conn, received):
        while len(received) < 2:
            conn.drain_events(timeout=5)
        received[0].ack()
    # kombu gives back what was delivered and not acked; the acked one is gone for good.
    assert _unacked(broker) == (0, 0)
    assert broker.llen(QUEUE) == 1
    assert received[1].delivery_tag in broker.lindex(QUEUE, 0).decode()


@CELERY_ONLY  # the loop engine reads its messages without kombu (worker.loop)
def test_a_worker_leaves_no_ack_unsent_once_idle_and_nothing_requeued_at_its_stop(
    settings: Settings, repo: InspectRepository, broker: redis.Redis, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    servers = [{"name": s.name, "url": s.url} for s in settings.servers]
    enqueue_file(settings, write_jsonl(tmp_path / "rows.jsonl", sample_rows(18)), max_new_tokens=24)
    with worker_process(worker_env(settings, servers), log, "--concurrency", "8"):
        wait_for(lambda: _done(repo) == 18, 120, "18 jobs done", log)
        # Idle now: a turn of its event loop sent the last writes.
        wait_for(lambda: _unacked(broker) == (0, 0), 30, "no message left unacked", log)
    assert _unacked(broker) == (0, 0)
    assert broker.llen(settings.queue) == 0  # nothing given back to the queue at its stop


def _done(repo: InspectRepository) -> int:
    return sum(c.states.get("done", 0) for c in repo.counts())


def test_one_turn_takes_as_many_messages_as_the_prefetch_limit_has_room_for_in_order(
    broker_url: str, broker: redis.Redis
) -> None:
    _publish(broker_url, 5)
    with _consuming(broker_url, 3) as (conn, received):
        conn.drain_events(timeout=5)  # one BRPOP answered: it and two more, one round trip
        assert [m.payload["n"] for m in received] == [0, 1, 2]
        assert broker.llen(QUEUE) == 2
        for message in received:
            message.ack()
        conn.drain_events(timeout=5)
        assert [m.payload["n"] for m in received] == [0, 1, 2, 3, 4]


def test_a_broker_that_refuses_scripts_is_read_one_message_a_turn(
    broker_url: str, broker: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis whose user may not run Lua (an ACL without @scripting, as some managed
    services and proxies set): the worker logs it once and reads as kombu does."""
    user = f"eaglegen-noscript-{uuid.uuid4().hex[:8]}"
    scripts_denied = ["+@all", "-@scripting"]
    broker.acl_setuser(
        user, enabled=True, nopass=True, keys=["*"], channels=["*"], commands=scripts_denied
    )
    try:
        url = broker_url.replace("redis://", f"redis://{user}@", 1)
        _publish(url, 3)
        with caplog.at_level(logging.WARNING), _consuming(url, 3) as (conn, received):
            conn.drain_events(timeout=5)
            assert [m.payload["n"] for m in received] == [0]
            while len(received) < 3:
                conn.drain_events(timeout=5)
            assert [m.payload["n"] for m in received] == [0, 1, 2]
            for message in received:
                message.ack()
        refused = [r for r in caplog.records if "refused a Lua script" in r.getMessage()]
        assert len(refused) == 1
        assert _unacked(broker) == (0, 0)
    finally:
        broker.acl_deluser(user)
