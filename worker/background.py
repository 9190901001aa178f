"""The worker's side loops: server health, lease renewal, heartbeat, and those that one
worker of the cluster runs (a Redis lock decides which, worker.leader): the feeder, the
reconciler and each server's concurrency controller."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

from core import heartbeat, keys, wire
from core.broker import redis_now, wake_feeder
from core.heartbeat import Heartbeat, ServerBeat
from worker.advancer import INTERVAL_S as ADVANCE_INTERVAL_S
from worker.advancer import LOCK_TTL_S as ADVANCE_LOCK_TTL_S
from worker.advancer import Advancer
from worker.controller import LimitControllers
from worker.feeder import Feeder, FeedLog
from worker.intake import INTERVAL_S as INTAKE_INTERVAL_S
from worker.leader import Leadership
from worker.numa import PinResult
from worker.reconcile import reconcile
from worker.runner import WorkerContext, heartbeat_ttl
from worker.servers import Server, probe
from worker.slots import SlotPool

log = logging.getLogger(__name__)


class Background:
    """Starts the side loops of one worker process; each runs on a daemon thread."""

    def __init__(
        self,
        ctx: WorkerContext,
        app: Celery | None,
        nodename: str,
        pinned: PinResult | None = None,
        flower: Celery | None = None,
    ) -> None:
        """``app``: the Celery engine's app (None for the loop engine, worker.loop, which
        has no consumer to pause); ``flower``: the app whose events tell Flower of the
        jobs the feeder skips (by default ``app``)."""
        self.ctx = ctx
        self.app = app
        self.flower = app if flower is None else flower
        self.nodename = nodename
        self.pinned = pinned  # where `--numa-node` pinned this process, for the heartbeat
        self.consuming = True
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consuming_lock = threading.Lock()
        self._leadership = Leadership(ctx.redis, ctx.name)
        s = ctx.settings
        self._advancer = Advancer(
            ctx.repo,
            hold=lambda run: self._leadership.hold(
                keys.advancer_lock(s.queue, run), ADVANCE_LOCK_TTL_S
            ),
            release=lambda run: self._leadership.release(keys.advancer_lock(s.queue, run)),
            redis=ctx.redis if s.turn_affinity else None,
            queue=s.queue,
        )
        # One concurrency controller per server whose limit is not fixed (worker.controller).
        self.limits = LimitControllers.for_worker(
            ctx.router.servers,
            ctx.redis,
            ctx.name,
            SlotPool(ctx.redis, lease_seconds=s.slot_lease_seconds),
            s,
        )
        # A request that finds its server gone pauses consumption at once, not a loop later.
        ctx.router.on_change.append(lambda: self._set_consuming(ctx.router.any_ready()))

    def start(self) -> None:
        """Start every loop (the heartbeat first, so `worker --check` sees us at once)."""
        s = self.ctx.settings
        # What each server serves; one that does not answer is asked again from the loops.
        # Until one has said, the worker takes no job (it could run none): see
        # `_consumer_ready`.
        self.ctx.router.identify_unknown(5.0, s.health_interval_s)
        self._step("intake", self.take)  # before the consumer takes its first message
        self.beat()
        # A worker whose servers are all down or unidentified when its consumer starts pauses
        # it then: a pause asked for before (a server found down) reached no consumer.
        if self.app is not None:
            worker_ready.connect(self._consumer_ready, weak=False)
        self._loop("heartbeat", s.heartbeat_interval_s, self.beat)
        self._loop("health", s.health_interval_s, self.check_health)
        self._loop("identity", s.reidentify_interval_s, self.reidentify)
        self._loop("leases", min(s.lease_seconds, s.slot_lease_seconds) / 3, self.renew)
        self._loop("intake", INTAKE_INTERVAL_S, self.take)
        self._loop("reconciler", s.reconcile_interval_s, self.reconcile_if_leader)
        self._loop("advancer", ADVANCE_INTERVAL_S, self.advance_if_leader)
        self._start_thread("feeder", self._feed_loop)
        if self.limits.controllers:
            self._loop("concurrency", s.concurrency_interval_s, self.limits.step)

    def stop(self) -> None:
        """Stop the loops, remove the heartbeat and hand the feeder's lock on."""
        self._stop.set()
        if self.app is not None:
            worker_ready.disconnect(self._consumer_ready)
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            heartbeat.remove(self.ctx.redis, socket.gethostname(), os.getpid())
            self._leadership.release(keys.feeder_lock(self.ctx.settings.queue))
            self._advancer.release_all()
        except redis.RedisError:  # Redis down: the heartbeat expires by itself
            log.warning("could not remove the heartbeat; it expires in a few beats")

    def _loop(self, name: str, interval_s: float, step: Callable[[], None]) -> None:
        def run() -> None:
            while not self._stop.wait(interval_s):
                self._step(name, step)

        self._start_thread(name, run)

    def _step(self, name: str, step: Callable[[], None]) -> bool:
        """One pass of a side loop; whether it went through. It must outlive Redis and
        Postgres restarts, and say so once: a service out of reach is one line per outage
        (worker.outages), an error nobody foresaw its trace once, then reminders."""
        try:
            step()
        except Exception as exc:
            self.ctx.outages.failed(f"{name} loop", exc)
            return False
        self.ctx.outages.passed(f"{name} loop")
        return True

    def _start_thread(self, name: str, run: Callable[[], None]) -> None:
        thread = threading.Thread(target=run, name=f"eaglegen-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def beat(self) -> None:
        """Write this process's heartbeat (expires after three missed beats)."""
        s = self.ctx.settings
        # Redis's clock, the one every reader compares it with (hosts' clocks differ).
        now = redis_now(self.ctx.redis)
        record = Heartbeat(
            worker=self.ctx.name,
            nodename=self.nodename,
            host=socket.gethostname(),
            pid=os.getpid(),
            ts=now,
            in_flight=len(self.ctx.running_jobs()),
            threads=self.ctx.threads,
            consuming=self.consuming,
            db_pool=s.db_pool_size,
            servers={srv.name: self._server_beat(srv, now) for srv in self.ctx.router.servers},
            unserved_runs=dict(self.ctx.unserved),
            numa_node=None if self.pinned is None else self.pinned.node,
            cpus=None if self.pinned is None else self.pinned.cpus,
            membind=None if self.pinned is None else str(self.pinned.membind),
        )
        heartbeat.write(self.ctx.redis, record, heartbeat_ttl(s))
        self.ctx.outages.redis_ok(wrote=True)
        for conflict in self.ctx.hold_server_names():
            log.error("%s", conflict)

    def take(self) -> None:
        """Work out again how many messages this process takes (worker.intake)."""
        self.ctx.intake.update(self.ctx.router.rooms())

    def _server_beat(self, server: Server, now: float) -> ServerBeat:
        """One server in the heartbeat; ``now`` is Redis's clock."""
        changed_at = None
        if server.changed_at is not None:  # monotonic here: told on Redis's clock
            changed_at = now - (time.monotonic() - server.changed_at)
        return ServerBeat(
            healthy=server.healthy,
            reason=server.reason,
            held=len(server.held),
            limit=self.ctx.router.limit(server),
            adaptive=server.name in {c.server.name for c in self.limits.controllers},
            model=server.served.model_path if server.served else None,
            previous_model=server.previous.model_path if server.previous else None,
            model_changed_at=changed_at,
        )

    def check_health(self) -> None:
        """Probe every attached server, then ask those that came back (or were never
        identified) what they serve; stop consuming while none is up and identified."""
        timeout = self._identify_timeout()
        for server in self.ctx.router.servers:
            reason = probe(server, timeout)
            # Said when it goes down or comes back, reminded of while it stays down. Either
            # edge forgets its model: one back up takes no job before it said it again, here.
            self.ctx.router.mark(server, healthy=reason is None, reason=reason or "")
        self.ctx.router.identify_unknown(timeout, self.ctx.settings.health_interval_s)
        self._set_consuming(self.ctx.router.any_ready())

    def reidentify(self) -> None:
        """Ask the identified servers again what they serve (EAGLEGEN_REIDENTIFY_INTERVAL_S):
        one swapped behind its URL between two health probes never looked down."""
        self.ctx.router.reidentify(self._identify_timeout())

    def _identify_timeout(self) -> float:
        return min(self.ctx.settings.health_interval_s * 3, 60.0)

    def _set_consuming(self, consume: bool) -> None:
        with self._consuming_lock:
            if consume != self.consuming:
                self._switch_consumer(consume)

    def _consumer_ready(self, sender: Any = None, **_: Any) -> None:
        """worker_ready receiver, in the consumer's own thread, before it takes a message:
        pause it there while none of this worker's servers is up and identified."""
        if getattr(sender, "hostname", None) != self.nodename:
            return
        with self._consuming_lock:
            if self.consuming and self.ctx.router.any_ready():
                return
            sender.cancel_task_queue(self.ctx.settings.queue)
            if self.consuming:
                self.consuming = False
                log.warning(
                    "pausing queue %s: none of this worker's servers is up and identified",
                    self.ctx.settings.queue,
                )

    def _switch_consumer(self, consume: bool) -> None:
        queue = self.ctx.settings.queue
        # Control messages go through the broker to this worker's own consumer thread (the
        # loop engine's intake takes nothing while no server is ready, by itself).
        if self.app is None:
            pass
        elif consume:
            self.app.control.add_consumer(queue, destination=[self.nodename], reply=False)
        else:
            self.app.control.cancel_consumer(queue, destination=[self.nodename], reply=False)
        self.consuming = consume
        if consume:
            log.warning("resuming queue %s: a server is up and identified", queue)
        else:
            log.warning(
                "pausing queue %s: none of this worker's servers is up and identified", queue
            )

    def renew(self) -> None:
        """Extend the leases of running jobs and held slots, each whatever became of the
        other (Postgres and Redis fail apart). Job leases go through their own connection
        (WorkerContext.leases): in the task threads' pool they waited behind busy tasks
        under load, and the leases of live jobs lapsed."""
        try:
            if running := self.ctx.running_jobs():
                s = self.ctx.settings
                self.ctx.leases.extend_leases(running, self.ctx.name, s.lease_seconds)
                self.ctx.outages.database_ok()
        finally:
            self.ctx.router.renew()

    def reconcile_if_leader(self) -> None:
        """Run the reconciler when this worker holds (or wins) the Redis lock."""
        s = self.ctx.settings
        if not self._leadership.hold(keys.reconciler_lock(s.queue), 2 * s.reconcile_interval_s):
            return
        report = reconcile(
            self.ctx.repo,
            self.ctx.redis,
            s.queue,
            max_attempts=s.max_attempts,
            republish_after_s=s.republish_after_s,
        )
        self.ctx.outages.database_ok()
        if report.expired_leases or report.republished:
            log.warning("reconciler: %s", report.as_dict())
            wake_feeder(self.ctx.redis, s.queue)

    def advance_if_leader(self) -> None:
        """Create conversations' next turns (worker.advancer) of the runs whose lock this
        worker holds (or wins); wake the feeder for them."""
        if self._advancer.advance():
            wake_feeder(self.ctx.redis, self.ctx.settings.queue)

    def _announce_skipped(self, job_ids: list[int]) -> None:
        """Tell Flower that these jobs, which it saw sent back, ended skipped (as the task
        does for a job it skips itself)."""
        if self.flower is None:
            return
        queue = self.ctx.settings.queue
        with self.flower.events.default_dispatcher(hostname=self.nodename) as dispatcher:
            for job_id in job_ids:
                dispatcher.send(
                    wire.SKIPPED_EVENT,
                    uuid=wire.job_task_id(queue, job_id),
                    result=wire.SKIPPED_RESULT,
                )

    def _feed_loop(self) -> None:
        """Feed while this worker holds the feeder's lock; between passes, wait for a wake
        (or the interval), or go again at once while workers drain the window."""
        s = self.ctx.settings
        feeder = Feeder(
            self.ctx.repo,
            self.ctx.redis,
            self.ctx.publisher,
            window=s.window,
            on_skipped=self._announce_skipped,
        )
        said = FeedLog(s.queue)  # changes of state and a summary, not a line per pass
        wake = keys.feeder_wake(s.queue)
        wait = 0.0  # before the next pass

        def one_pass() -> None:
            nonlocal wait
            wait = s.feed_interval_s
            lock_ttl_s = max(10.0, 5 * s.feed_interval_s)
            leader = self._leadership.hold(keys.feeder_lock(s.queue), lock_ttl_s)
            said.leading(leader)
            if not leader:
                return
            report = feeder.feed()
            if report.queried:
                self.ctx.outages.database_ok()
            said.passed(report)
            wait = report.next_pass_s(s.feed_interval_s)
            if wait >= s.feed_interval_s:  # BLPOP takes whole seconds on older Redis servers
                self.ctx.redis.blpop([wake], timeout=max(1, round(s.feed_interval_s)))
                wait = 0.0

        while not self._stop.is_set():
            if not self._step("feeder", one_pass):
                wait = s.feed_interval_s
            if wait:
                self._stop.wait(wait)
