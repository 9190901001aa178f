"""`eaglegen worker`: place worker processes on NUMA nodes, start them, check their health."""

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
    sysfs_root: Path = Path("/sys"),
) -> int:
    """Start one pinned worker, or (``auto``, ``0,1``) one child process per NUMA node."""
    from worker.app import start

    port = settings.metrics_port
    if numa_spec is None:
        return start(settings, services, metrics_port=port)
    topology = numa.read_topology(sysfs_root)
    nodes = numa.resolve_nodes(numa_spec, topology)
    if len(nodes) > 1:
        # Service URLs go to the children by environment: argv is visible to every user.
        env = {
            "EAGLEGEN_DATABASE_URL": services.database_url,
            "EAGLEGEN_BROKER_URL": services.broker_url,
        }
        return _supervise(nodes, argv_rest, env)
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


def _supervise(nodes: list[int], argv_rest: list[str], env: dict[str, str]) -> int:
    """One `eaglegen worker --numa-node N` child per node; SIGTERM is passed on to all."""
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "eaglegen", "worker", "--numa-node", str(n), *argv_rest],
            env={**os.environ, **env},
        )
        for n in nodes
    ]

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, default=0)
