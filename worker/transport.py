"""kombu's Redis transport, hardened against a crash after a lost broker connection, with
one Redis client per connection pool instead of one per operation, and its ack emulation's
writes sent in batches instead of in a round trip per delivery and per ack."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from worker.outages import one_line

logger = logging.getLogger(__name__)

# How long a delivery's or an ack's write to the unacked index waits to go with others: a
# busy worker takes and acks a message every few milliseconds, an idle one none.
WRITE_WAIT_S = 0.05


class QoS(kombu_redis.QoS):
    """kombu's ack emulation, its writes to the unacked index sent in batches.

    kombu keeps each delivered message in an "unacked" hash and index until its ack, so that
    a stopping worker gives back what it holds, and writes each delivery there and removes
    each ack in a round trip of its own: a large share of a busy worker's one consumer thread
    (BENCHMARKS.md, "Task events in batches, acks with the next delivery", and "Deliveries
    written in batches"). Here both are counted at once (kombu's bookkeeping, which the
    prefetch limit reads) and wait to go out together in one pipeline: once the oldest has
    waited WRITE_WAIT_S (`Transport.flush_unacked`, at each turn of the event loop), and
    before anything reads the hash back (a requeue, the channel's close). A message acked
    before its delivery was written is neither written nor removed.

    What a lost connection or a killed worker loses: a removal not sent leaves the message
    in the index, as an ack that fails does in kombu (it comes back after the visibility
    timeout, and the claim in Postgres turns the duplicate away); a delivery not written
    leaves the message in neither queue nor index, as kombu does between its read and its
    write: the reconciler publishes its job again (worker/reconcile.py), as it does for the
    messages a dead worker held.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._unwritten: dict[str, tuple[float, Any]] = {}  # tag: (delivered at, message)
        self._acked: list[str] = []  # tags written, to be removed
        self._waiting_since = 0.0  # when the oldest of them came (time.monotonic)
        self._lock = threading.Lock()
        # One batch in flight at a time: a removal must not reach Redis before its write.
        self._sending = threading.Lock()

    def append(self, message: Any, delivery_tag: str) -> None:
        with self._lock:
            self._note_waiting()
            self._unwritten[delivery_tag] = (time.time(), message)
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]

    def ack(self, delivery_tag: str) -> None:
        with self._lock:
            if self._unwritten.pop(delivery_tag, None) is None:
                self._note_waiting()
                self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # bookkeeping only

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:  # kombu's reject without requeue is an ack
            self.ack(delivery_tag)
            return
        self.flush_unacked()  # the requeue reads the message back from the hash
        super().reject(delivery_tag, requeue=True)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> None:
        """kombu's give-back at the channel's close reads each message from the hash."""
        self.flush_unacked()
        super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def _note_waiting(self) -> None:
        if not self._unwritten and not self._acked:
            self._waiting_since = time.monotonic()

    def flush_unacked(self, waited_s: float = 0.0) -> None:
        """Send the writes waiting, if the oldest has waited ``waited_s``: the deliveries
        (kombu's ZADD and HSET) and the removals (its ZREM and HDEL), one command each."""
        if not (self._unwritten or self._acked):
            return
        if time.monotonic() - self._waiting_since < waited_s:
            return
        with self._sending, self.channel.conn_or_acquire() as client:
            with self._lock:
                unwritten, self._unwritten = self._unwritten, {}
                acked, self._acked = self._acked, []
            pipe = client.pipeline()
            if unwritten:
                pipe.zadd(self.unacked_index_key, {t: at for t, (at, _) in unwritten.items()})
                pipe.hset(
                    self.unacked_key, mapping={t: _entry(m) for t, (_, m) in unwritten.items()}
                )
            if acked:
                pipe.zrem(self.unacked_index_key, *acked).hdel(self.unacked_key, *acked)
            pipe.execute()


def _entry(message: Any) -> str:
    """A delivered message as kombu's ack emulation stores it in the unacked hash."""
    delivery = message.delivery_info
    entry = [message._raw, delivery["exchange"], delivery["routing_key"]]
    return str(dumps(entry))  # type: ignore[no-untyped-call]


# Pops up to ARGV[1] messages from KEYS in order (a queue's lists by priority, as kombu's BRPOP
# names them), in one round trip: each key and its message.
_POP_MORE = """
local out, n = {}, tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  while #out < 2 * n do
    local item = redis.call('RPOP', key)
    if not item then break end
    out[#out + 1] = key
    out[#out + 1] = item
  end
end
return out
"""


class Channel(kombu_redis.Channel):
    """A channel whose operations fail like a lost connection once its connection is gone,
    that reuses its Redis client, and that sends its unacked index's writes waiting (QoS)
    as it closes.

    After a broker failure Celery 5.7 ``collect()``s the connection, which drops the
    transport's client, while the channel still has work queued: restoring unacked messages
    on close, acks the pool's threads handed to the event loop. Each then builds a Redis
    client from the missing client and raises AttributeError, which Celery treats as
    unrecoverable: the worker exits. A ConnectionError is what Celery retries on.
    """

    QoS = QoS
    _shared: redis.Redis | None = None
    _pops_several = True  # until the broker refuses _POP_MORE

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

    def _brpop_read(self, **options: Any) -> bool:
        """kombu's read of the message its BRPOP brought, then as many more as the channel
        may take now (``qos.can_consume_max_estimate()``, held to the worker's intake),
        popped in one round trip. kombu takes one message per turn of the event loop, each
        with a BRPOP of its own: when a wave of answers frees many slots at once, the next
        requests would reach the server one turn apart, to be admitted in more, smaller
        prefill passes (BENCHMARKS.md, "Several messages a turn")."""
        delivered = bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        # Prefixed keys, or a broker that refused the script: kombu's one at a time.
        several = self._pops_several and not self.global_keyprefix
        if several and (room := self.qos.can_consume_max_estimate()):
            self._deliver_more(room)
        return delivered

    def _deliver_more(self, room: int) -> None:
        queues = [q for q in self.active_queues if q not in self.active_fanout_queues]
        keys = [self._priority_key(q, pri) for pri in self.priority_steps for q in queues]
        try:
            with self.conn_or_acquire() as client:
                found = client.eval(_POP_MORE, len(keys), *keys, room)
        except redis.ResponseError as exc:  # scripting denied (an ACL, a proxy): nothing popped
            self._pops_several = False
            logger.warning(
                "the broker refused a Lua script (%s): this worker takes one message per turn",
                one_line(exc),
            )
            return
        for key, item in zip(found[::2], found[1::2], strict=True):
            # As kombu's own read (_brpop_read) decodes and names them.
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]  # type: ignore[no-untyped-call]
            message = loads(bytes_to_str(item))  # type: ignore[no-untyped-call]
            self.connection._deliver(message, queue)

    def _priority_key(self, queue: str, pri: int) -> str:
        return str(self._q_for_pri(queue, pri))  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Send the writes waiting, then close as kombu does (which gives back to the
        queue the messages delivered and not acked)."""
        qos = self._qos
        if qos is not None and not self.closed:
            # Redis gone: what they would have written is lost with it (QoS).
            with contextlib.suppress(redis.RedisError):
                qos.flush_unacked()
        super().close()  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    """The Redis transport with the channel above."""

    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """kombu's registration, and at each turn of the loop the unacked index's writes
        that have waited WRITE_WAIT_S sent (the loop turns every 0.1 s while task events are
        on, worker.events.EventBatches' timer; every second at most otherwise)."""
        super().register_with_event_loop(connection, loop)  # type: ignore[no-untyped-call]
        loop.on_tick.add(self.flush_unacked)
        loop.on_close.add(self._unregister_flush)  # the loop's reset after a lost connection

    def _unregister_flush(self, loop: Any) -> None:
        loop.on_tick.discard(self.flush_unacked)
        loop.on_close.discard(self._unregister_flush)

    def flush_unacked(self) -> None:
        """Send each channel's unacked index's writes that have waited WRITE_WAIT_S."""
        for channel in list(self.channels):
            if channel._qos is not None and not channel.closed:
                channel._qos.flush_unacked(WRITE_WAIT_S)
