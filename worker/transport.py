"""kombu's Redis transport, hardened against a crash after a lost broker connection, and
with one Redis client per connection pool instead of one per operation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    """A channel whose operations fail like a lost connection once its connection is gone,
    and that reuses its Redis client.

    After a broker failure Celery 5.7 ``collect()``s the connection, which drops the
    transport's client, while the channel still has work queued: restoring unacked messages
    on close, acks the pool's threads handed to the event loop. Each then builds a Redis
    client from the missing client and raises AttributeError, which Celery treats as
    unrecoverable: the worker exits. A ConnectionError is what Celery retries on.
    """

    _shared: redis.Redis | None = None

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError("broker connection already closed")
        return super()._connparams(asynchronous)  # type: ignore[no-untyped-call]

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        """kombu builds a new ``redis.Redis`` for every delivery, ack and event, and each
        one builds its table of response callbacks: a measurable share of a busy worker's
        CPU. A client only borrows a connection from its pool for each command, so one per
        pool serves every thread; a new pool (after a reconnect) gets a new client."""
        if client is not None:
            yield client
            return
        pool = self.pool
        shared = self._shared
        if shared is None or shared.connection_pool is not pool:
            shared = self._shared = self._create_client()  # type: ignore[no-untyped-call]
        yield shared


class Transport(kombu_redis.Transport):
    """The Redis transport with the channel above."""

    Channel = Channel
