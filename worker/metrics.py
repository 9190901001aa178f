"""A worker process's Prometheus metrics: requests, tokens, latency, errors, in flight, jobs.

One registry per WorkerContext, not prometheus-client's global one: Celery's threads pool
runs every task of a process in one interpreter, so one registry counts the whole process,
and a process that builds two contexts (the tests do, one after another) starts each from
zero. ``serve`` exposes it on a port (``eaglegen worker --metrics-port``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

PREFIX = "eaglegen_worker"
# A generation takes from milliseconds (a short answer, a refusal) to the hour-long request
# timeout: buckets up to it.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class WorkerMetrics:
    """The metrics of one worker process, and the calls that record them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "/generate requests by server and outcome (ok: a response that passed every check)",
            ["server", "outcome"],
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors",
            "Failed /generate attempts by server and error class (worker.retry.ErrorKind)",
            ["server", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            f"{PREFIX}_request_seconds",
            "/generate request time, until the response is checked, by server and outcome",
            ["server", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "/generate requests this process has open, by server",
            ["server"],
            registry=r,
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_generated_tokens",
            "Completion tokens of the generations this process recorded, by server",
            ["server"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens of the generations this process recorded, by server",
            ["server"],
            registry=r,
        )
        self.jobs = Counter(
            f"{PREFIX}_job_attempts",
            "Messages this process handled, by how the attempt ended (runner.Outcome)",
            ["outcome"],
            registry=r,
        )

    def known_servers(self, names: list[str]) -> None:
        """Show every server's series at 0 from the start (a rate needs a first sample)."""
        for name in names:
            self.in_flight.labels(name)
            self.requests.labels(name, "ok")
            self.requests.labels(name, "error")
            self.completion_tokens.labels(name)
            self.prompt_tokens.labels(name)

    @contextmanager
    def request(self, server: str) -> Iterator[RequestTimer]:
        """Around one /generate call: in flight meanwhile; its time and outcome after."""
        timer = RequestTimer()
        gauge = self.in_flight.labels(server)
        gauge.inc()
        start = time.perf_counter()
        try:
            yield timer
        finally:
            gauge.dec()
            outcome = "ok" if timer.kind is None else "error"
            self.requests.labels(server, outcome).inc()
            self.latency.labels(server, outcome).observe(time.perf_counter() - start)
            if timer.kind is not None:
                self.errors.labels(server, timer.kind).inc()

    def recorded(self, server: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A generation stored in Postgres."""
        self.completion_tokens.labels(server).inc(completion_tokens)
        self.prompt_tokens.labels(server).inc(prompt_tokens)

    def attempt(self, outcome: str) -> None:
        """How one message's attempt ended."""
        self.jobs.labels(outcome).inc()


class RequestTimer:
    """What ``WorkerMetrics.request`` learns from its block: the error class, if any."""

    def __init__(self) -> None:
        self.kind: str | None = None

    def failed(self, kind: str) -> None:
        """The request failed with error class ``kind``."""
        self.kind = kind


def serve(metrics: WorkerMetrics, port: int, address: str = "0.0.0.0") -> WSGIServer:
    """Serve ``metrics`` on ``address:port`` (all interfaces by default: Prometheus scrapes
    from another host; they hold counts and server names, no secret) from a daemon thread;
    the server, to ``shutdown()``."""
    server, _thread = start_http_server(port, addr=address, registry=metrics.registry)
    return server
