"""kombu's Redis transport, hardened against a crash after a lost broker connection."""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    """A channel whose operations fail like a lost connection once its connection is gone.

    After a broker failure Celery 5.7 ``collect()``s the connection, which drops the
    transport's client, while the channel still has work queued: restoring unacked messages
    on close, acks the pool's threads handed to the event loop. Each then builds a Redis
    client from the missing client and raises AttributeError, which Celery treats as
    unrecoverable: the worker exits. A ConnectionError is what Celery retries on.
    """

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError("broker connection already closed")
        return super()._connparams(asynchronous)  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    """The Redis transport with the channel above."""

    Channel = Channel
