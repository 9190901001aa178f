"""kombu's Redis transport, hardened against a crash after a lost broker connection, with
one Redis client per connection pool instead of one per operation, and acks sent with the
next delivery instead of in a round trip each."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

# How long an ack's removal waits for a delivery's pipeline before it is sent by itself: a
# busy worker takes a message every few milliseconds, an idle one none.
ACK_WAIT_S = 0.05


class QoS(kombu_redis.QoS):
    """kombu's ack emulation, with each ack's removal from the unacked index sent later.

    kombu keeps a delivered message in an "unacked" hash and index until its ack, and sends
    each ack's removal in a transaction of its own: a round trip and a pipeline per message,
    a large share of a busy worker's CPU (BENCHMARKS.md, "Task events in batches, acks with
    the next delivery"). Here an ack is counted at once (kombu's own bookkeeping, which the
    prefetch limit reads) and its removal waits to go in the next pipeline this channel
    sends: the next delivery's, else one the event loop sends once the oldest removal has
    waited ACK_WAIT_S (`Transport.flush_acks`, at each turn of the loop), else the one sent
    as the channel closes. A removal lost with the connection leaves the message in the
    index, as an ack that fails does in kombu: it comes back after the visibility timeout,
    and the claim in Postgres turns the duplicate away.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._acked: list[str] = []
        self._acked_since = 0.0  # when the oldest of them was acked (time.monotonic)
        self._acked_lock = threading.Lock()

    def ack(self, delivery_tag: str) -> None:
        with self._acked_lock:
            if not self._acked:
                self._acked_since = time.monotonic()
            self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # bookkeeping only

    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Iterator[Any]:
        """kombu's pipeline for a delivery, a reject or a removal, carrying the removals of
        the acks not sent yet (a pipeline handed in is someone else's: left alone)."""
        with super().pipe_or_acquire(pipe, client) as found:
            if pipe is None:
                with self._acked_lock:
                    acked, self._acked = self._acked, []
                if acked:  # kombu's _remove_from_indices, one command for all of them
                    found.zrem(self.unacked_index_key, *acked).hdel(self.unacked_key, *acked)
            yield found

    def flush_acks(self, waited_s: float = 0.0) -> None:
        """Send the removals of the acks not sent yet, if the oldest has waited ``waited_s``."""
        if self._acked and time.monotonic() - self._acked_since >= waited_s:
            with self.pipe_or_acquire() as pipe:
                pipe.execute()


class Channel(kombu_redis.Channel):
    """A channel whose operations fail like a lost connection once its connection is gone,
    that reuses its Redis client, and that sends its acks not sent yet (QoS) as it closes.

    After a broker failure Celery 5.7 ``collect()``s the connection, which drops the
    transport's client, while the channel still has work queued: restoring unacked messages
    on close, acks the pool's threads handed to the event loop. Each then builds a Redis
    client from the missing client and raises AttributeError, which Celery treats as
    unrecoverable: the worker exits. A ConnectionError is what Celery retries on.
    """

    QoS = QoS
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

    def close(self) -> None:
        """Send the acks not sent yet, then close as kombu does (which gives back to the
        queue the messages delivered and not acked)."""
        qos = self._qos
        if qos is not None and not self.closed:
            # Redis gone: their messages come back after the visibility timeout (QoS).
            with contextlib.suppress(redis.RedisError):
                qos.flush_acks()
        super().close()  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    """The Redis transport with the channel above."""

    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """kombu's registration, and at each turn of the loop the acks that have waited
        ACK_WAIT_S for a delivery to ride on sent by themselves (the loop turns every 0.1 s
        while task events are on, worker.events.EventBatches' timer; every second at most
        otherwise)."""
        super().register_with_event_loop(connection, loop)  # type: ignore[no-untyped-call]
        loop.on_tick.add(self.flush_acks)
        loop.on_close.add(self._unregister_flush)  # the loop's reset after a lost connection

    def _unregister_flush(self, loop: Any) -> None:
        loop.on_tick.discard(self.flush_acks)
        loop.on_close.discard(self._unregister_flush)

    def flush_acks(self) -> None:
        """Send each channel's acks that have waited ACK_WAIT_S."""
        for channel in list(self.channels):
            if channel._qos is not None and not channel.closed:
                channel._qos.flush_acks(ACK_WAIT_S)
