"""The SGLang servers a worker calls: health, free slots, and which one takes the next job."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from core.settings import ServerSpec
from models.records import RunModel
from worker.identity import Served, mismatch
from worker.outages import Outages
from worker.sglang import SGLangClient
from worker.slots import SlotPool

log = logging.getLogger(__name__)


@dataclass
class Server:
    """One attached server: its client, health and the slot leases this process holds."""

    spec: ServerSpec
    client: SGLangClient
    limit: int
    healthy: bool = True
    reason: str = ""
    held: set[str] = field(default_factory=set)
    # What /get_model_info said; until it has, the server generates nothing (see `serves`).
    served: Served | None = None
    identify_after: float = 0.0  # monotonic time before which it is not asked again

    @property
    def name(self) -> str:
        """The server's name in settings, logs and generation rows."""
        return self.spec.name

    def serves(self, wanted: RunModel) -> str | None:
        """None when this server may generate the run's jobs, else why not."""
        if self.served is None:
            return self.unknown_reason()
        difference = mismatch(wanted, self.served)
        return None if difference is None else f"{self.name}: {difference}"

    def unknown_reason(self) -> str | None:
        """Why this server generates nothing yet (None once its model is known)."""
        if self.served is not None:
            return None
        return f"{self.name}: its model is not known yet (/get_model_info unanswered)"


@dataclass(frozen=True)
class Lease:
    """A slot on a server, held for one request."""

    server: Server
    token: str


class Router:
    """Hands out slots on healthy servers, least busy first; routing is by pull."""

    def __init__(
        self,
        servers: list[Server],
        slots: SlotPool,
        poll_s: float = 0.05,
        limits: Callable[[Server], int] | None = None,
        outages: Outages | None = None,
    ) -> None:
        self.servers = servers
        # Says a server down or unidentified once, reminds of it, says when it is back.
        self.outages = outages or Outages()
        self._slots = slots
        self._poll_s = poll_s
        # A server's in-flight limit now (the adaptive one, worker.controller.SharedLimits).
        self.limit: Callable[[Server], int] = limits or (lambda server: server.limit)
        self._lock = threading.Lock()
        self._identifying = threading.Lock()
        # Called after any server changes health (the worker pauses or resumes consuming).
        self.on_change: list[Callable[[], None]] = []

    def any_healthy(self) -> bool:
        """Whether at least one attached server is up."""
        return any(s.healthy for s in self.servers)

    def any_ready(self) -> bool:
        """Whether at least one attached server is up and said what it serves: the worker
        can run a job (it takes none from the queue otherwise)."""
        return any(s.healthy and s.served is not None for s in self.servers)

    def identify_unknown(self, timeout_s: float, retry_after_s: float) -> bool:
        """Ask the servers whose model is not known yet what they serve; whether any was.

        One thread asks, the others wait for its answer; each server is asked at most once
        per ``retry_after_s``, counted from the end of its last try, so a server that never
        answers costs one timeout per interval, not one per waiting thread.
        """
        if all(s.served is not None for s in self.servers):
            return False
        with self._identifying:
            for server in self.servers:
                if server.served is None and server.identify_after <= time.monotonic():
                    reason = identify(server, timeout_s)
                    server.identify_after = time.monotonic() + retry_after_s
                    unknown = f"server {server.name}: its model is not known yet"
                    if reason is None:
                        self.outages.up(unknown)  # identify said what it serves
                    else:
                        self.outages.down(unknown, reason, then="asking again")
        return True

    def identified(self, timeout_s: float, retry_after_s: float) -> list[Server]:
        """The servers whose model is known. Only when none is does the caller wait for the
        others to be asked (``identify_unknown``); else the health loop asks them."""
        known = [s for s in self.servers if s.served is not None]
        if not known and self.identify_unknown(timeout_s, retry_after_s):
            known = [s for s in self.servers if s.served is not None]
        return known

    def acquire(self, timeout_s: float, among: Sequence[Server] | None = None) -> Lease | None:
        """A slot on some healthy server (of ``among``, default all), waiting up to
        ``timeout_s``; None if none came."""
        candidates = self.servers if among is None else among
        deadline = time.monotonic() + timeout_s
        while True:
            lease = self._try_once(candidates)
            healthy = any(s.healthy for s in candidates)
            if lease is not None or not healthy or time.monotonic() >= deadline:
                return lease
            time.sleep(self._poll_s)

    def _try_once(self, candidates: Sequence[Server]) -> Lease | None:
        for server in sorted(candidates, key=lambda s: len(s.held)):
            if not server.healthy:
                continue
            token = self._slots.try_acquire(server.name, self.limit(server))
            if token is not None:
                with self._lock:
                    server.held.add(token)
                return Lease(server, token)
        return None

    def release(self, lease: Lease) -> None:
        """Return the slot."""
        with self._lock:
            lease.server.held.discard(lease.token)
        self._slots.release(lease.server.name, lease.token)

    def release_all(self) -> None:
        """Give back every slot this process holds (it is about to exit)."""
        for server in self.servers:
            with self._lock:
                tokens, server.held = list(server.held), set()
            for token in tokens:
                self._slots.release(server.name, token)

    def renew(self) -> None:
        """Keep this process's leases alive (called periodically)."""
        for server in self.servers:
            with self._lock:
                tokens = list(server.held)
            self._slots.renew(server.name, tokens)

    def mark(self, server: Server, healthy: bool, reason: str = "") -> bool:
        """Set a server's health; True when that changed it."""
        changed = server.healthy != healthy
        server.healthy, server.reason = healthy, reason
        down = f"server {server.name} is down"
        if healthy:
            self.outages.up(down)
        else:  # said when it goes down, reminded of while it stays down (each probe marks it)
            self.outages.down(
                down,
                reason,
                then="its jobs go to other workers",
                ended=f"server {server.name} is back up",
            )
        if changed:
            for notify in self.on_change:
                notify()
        return changed


def identify(server: Server, timeout_s: float) -> str | None:
    """Ask ``/get_model_info`` what the server serves; None when it said, else the reason."""
    try:
        response = server.client.get("/get_model_info", timeout_s)
        response.raise_for_status()
        served = Served.of(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        return f"/get_model_info: {type(exc).__name__}: {exc}"
    if served != server.served:
        log.warning(
            "server %s serves model %s (tokenizer %s)",
            server.name,
            served.model_path,
            served.tokenizer_path or "not said",
        )
    server.served = served
    _choose_streaming(server, timeout_s)
    return None


def _choose_streaming(server: Server, timeout_s: float) -> None:
    """Stream from a server that streams incrementally, when the settings leave it open
    (EAGLEGEN_STREAM unset); a server that does not say keeps whole answers."""
    if server.client.stream_choice is not None:
        return
    try:
        response = server.client.get("/get_server_info", timeout_s)
        response.raise_for_status()
        info = response.json()
    except (httpx.HTTPError, ValueError):
        return
    # The server argument's name since SGLang 0.4.x, and its older one.
    incremental = isinstance(info, dict) and any(
        info.get(key) is True for key in ("incremental_streaming_output", "stream_output")
    )
    if server.client.adopt_streaming(incremental):
        log.warning(
            "server %s streams %s: answers %s",
            server.name,
            "incrementally" if incremental else "cumulatively",
            "streamed (a stalled request fails after EAGLEGEN_STALL_TIMEOUT_S)"
            if incremental
            else "whole",
        )


def probe(server: Server, timeout_s: float) -> str | None:
    """Check ``/health_generate``; None when healthy, else the reason."""
    try:
        response = server.client.get("/health_generate", timeout_s)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"/health_generate answered HTTP {response.status_code}"
    return None
