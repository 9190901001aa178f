"""Redis as the transport: publish job messages (``core.wire``) and read the queue back."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis

from core import keys, wire

SCAN_CHUNK = 5000
# One LPUSH carries at most this many bytes of messages: every command must fit the
# server's client-query-buffer-limit (1 GB by default, 1 MB at the least one can set),
# and no batch, however many jobs it publishes, is built whole in memory.
PUSH_BYTES = 256 << 10


class Publisher:
    """Publishes job messages onto one queue; many with one LPUSH per batch."""

    def __init__(self, broker: str | redis.Redis, queue: str) -> None:
        """``broker``: a Redis URL (a client of its own, closed by ``close``), or a client to
        share, which its owner closes: a worker's, whose pool makes its many threads wait for
        a connection where redis-py's default pool fails the 101st (issue 32)."""
        self.queue = queue
        self._envelope = wire.EnvelopeFactory(queue, f"{socket.gethostname()}:{os.getpid()}")
        self._owned = isinstance(broker, str)
        self._client = redis.Redis.from_url(broker) if isinstance(broker, str) else broker

    def publish(self, job_ids: Sequence[int], tags: str | Mapping[int, str] = "") -> int:
        """Publish one message per id, in order (workers pop the oldest first), in
        commands of at most PUSH_BYTES each.

        ``tags``: what Flower shows after each job id (``wire.tag``), one for all or per id.
        """
        published = 0
        batch: list[bytes] = []
        size = 0
        for job_id in job_ids:
            job_tag = tags if isinstance(tags, str) else tags.get(job_id, "")
            message = self._envelope(job_id, job_tag).encode()
            if batch and size + len(message) > PUSH_BYTES:
                published += self._push(batch)
                batch, size = [], 0
            batch.append(message)
            size += len(message)
        return published + self._push(batch)

    def publish_later(
        self,
        job_id: int,
        *,
        countdown: float,
        retries: int,
        task_id: str | None = None,
        job_tag: str = "",
    ) -> None:
        """Send a job back after an attempt, to run in ``countdown`` seconds."""
        message = self._envelope.later(
            job_id, countdown=countdown, retries=retries, task_id=task_id, job_tag=job_tag
        )
        self._push([message.encode()])

    def _push(self, messages: list[bytes]) -> int:
        if not messages:
            return 0
        # One packed LPUSH sent on redis-py's own connection with its retry policy: redis-py
        # would pack the batch argument by argument (see wire.lpush_command).
        command = wire.lpush_command(self.queue, messages)
        pool = self._client.connection_pool
        connection: Any = pool.get_connection()  # redis-py leaves these methods untyped

        def send() -> None:
            connection.send_packed_command([command])  # a list: bytes would be iterated
            connection.read_response()

        try:
            # A push repeated after a lost reply only duplicates messages, which are hints
            # (docs/design.md §2).
            connection.retry.call_with_retry(send, lambda _error: connection.disconnect())
        except BaseException:
            connection.disconnect()  # part of the command may be on the wire: start afresh
            raise
        finally:
            pool.release(connection)
        return len(messages)

    def wake_feeder(self) -> None:
        """Tell the feeder this queue has new work (``wake_feeder``)."""
        wake_feeder(self._client, self.queue)

    def close(self) -> None:
        """Release the connections of its own client (a shared one is its owner's)."""
        if self._owned:
            self._client.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def eviction_warning(client: redis.Redis) -> str | None:
    """What to do when Redis may evict keys under memory pressure (queued messages among
    them, silently), else None. Read from INFO, which managed Redis allows where CONFIG is
    refused; None too where an ACL refuses INFO as well (nothing else here needs it)."""
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except redis.ResponseError:
        return None
    if policy in (None, "noeviction"):
        return None
    return (
        f"Redis maxmemory-policy is {policy}: under memory pressure it drops queued messages "
        "without a word (the reconciler publishes them again from Postgres, late); set "
        "maxmemory-policy noeviction"
    )


def wake_feeder(client: redis.Redis, queue: str) -> None:
    """Tell the feeder there is work to publish now, not at its next look."""
    with client.pipeline(transaction=False) as pipe:
        pipe.lpush(keys.feeder_wake(queue), 1)
        pipe.ltrim(keys.feeder_wake(queue), 0, 0)
        pipe.execute()


def redis_now(client: redis.Redis) -> float:
    """Redis's clock, in seconds: the one clock of every host sharing this Redis."""
    seconds, micros = client.time()
    return seconds + micros / 1e6


def waiting_job_ids(client: redis.Redis, queue: str) -> set[int]:
    """Job ids of every message waiting in ``queue`` (not those a worker already holds)."""
    return {
        job_id
        for raw in _queue_messages(client, queue)
        if (job_id := wire.job_id_of(raw)) is not None
    }


def _queue_messages(client: redis.Redis, queue: str) -> Iterator[Any]:
    start = 0
    while chunk := client.lrange(queue, start, start + SCAN_CHUNK - 1):
        yield from chunk
        start += SCAN_CHUNK


def store_feed_report(
    client: redis.Redis, queue: str, report: Mapping[str, Any], ttl_s: int
) -> None:
    """Leave the feeder's last pass in Redis for `status` (``feed_bound``); it expires."""
    client.set(keys.feeder_report(queue), json.dumps(report), ex=ttl_s)


def feed_bound(client: redis.Redis, queue: str) -> int | None:
    """The window's bound in the feeder's last report; None without one, or from one that
    is not the feeder's (a hand edit, another version)."""
    report = client.get(keys.feeder_report(queue))
    try:
        bound = None if report is None else json.loads(report)["window"]
    except (ValueError, TypeError, KeyError):
        return None
    return bound if isinstance(bound, int) and not isinstance(bound, bool) else None
