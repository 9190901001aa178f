"""`eaglegen worker`: start worker processes (several, or one per NUMA node, pinned)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.settings import Services, Settings
from worker import numa

log = logging.getLogger(__name__)


def run_worker(
    settings: Settings,
    services: Services,
    numa_spec: str | None,
    argv_rest: list[str],
    processes: int = 1,
    sysfs_root: Path = Path("/sys"),
) -> int:
    """Start one worker; ``processes`` unpinned child processes; or (``auto``, ``0,1``) one
    pinned child process per NUMA node. ``argv_rest``: the options every child gets (each
    child's metrics port is added here)."""
    if settings.worker_engine == "loop":
        from worker.loop import start
    else:
        from worker.app import start

    port = settings.metrics_port
    if processes > 1:
        if numa_spec is not None:
            raise ValueError(
                "--processes starts unpinned worker processes and --numa-node pins them, one "
                "per node: give one of the two"
            )
        return _supervise(
            [[*argv_rest, *_metrics_port(port, k)] for k in range(processes)], services
        )
    if numa_spec is None:
        return start(settings, services, metrics_port=port)
    topology = numa.read_topology(sysfs_root)
    nodes = numa.resolve_nodes(numa_spec, topology)
    if len(nodes) > 1:
        # Each pinned child adds its node to the port (below).
        return _supervise(
            [["--numa-node", str(n), *argv_rest, *_metrics_port(port, 0)] for n in nodes],
            services,
        )
    node = numa.find_node(topology, nodes[0])
    servers = numa.servers_for_node(settings.servers, node.id)
    pinned = numa.pin_to_node(node)
    log.warning("worker pinned: %s; servers: %s", pinned, ", ".join(s.name for s in servers))
    return start(
        settings,
        services,
        servers=servers,
        pinned=pinned,
        metrics_port=None if port is None else port + node.id,
    )


def _metrics_port(port: int | None, offset: int) -> list[str]:
    return [] if port is None else [f"--metrics-port={port + offset}"]


def _supervise(children_args: list[list[str]], services: Services) -> int:
    """One `eaglegen worker ARGS` child per entry, each signal that stops a worker passed on
    to every child once (SIGHUP, a closed terminal, as SIGTERM).

    The children run in sessions of their own, so a Ctrl-C on the terminal reaches this
    process alone: passed on, it is one SIGINT for each child, as for a worker started by
    hand (a second one is Celery's cold shutdown, which abandons the requests in flight).
    """
    # Service URLs go to the children by environment: argv is visible to every user.
    env = {
        **os.environ,
        "EAGLEGEN_DATABASE_URL": services.database_url,
        "EAGLEGEN_BROKER_URL": services.broker_url,
    }
    passed_on = {
        signal.SIGTERM: signal.SIGTERM,
        signal.SIGINT: signal.SIGINT,
        signal.SIGHUP: signal.SIGTERM,
    }
    children: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(passed_on[signal.Signals(signum)])

    # Handlers first, and no child started once a signal came: none misses its signal.
    for received in passed_on:
        signal.signal(received, forward)
    for args in children_args:
        if stopping:
            break
        command = [sys.executable, "-m", "eaglegen", "worker", *args]
        children.append(subprocess.Popen(command, env=env, start_new_session=True))
    codes = [child.wait() for child in children]
    return max(codes, default=0)
