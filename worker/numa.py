"""NUMA placement for worker processes: read the topology, pin a process, pick its servers.

Everything but ``pin_to_node`` is pure and reads sysfs from an injectable root, so tests run
against small fixture trees. ``pin_to_node`` acts on the calling thread only (both
``sched_setaffinity(0)`` and the libnuma memory policy are per thread, inherited by threads
started later), so the worker calls it first thing, before Celery starts its thread pool.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable, Sequence
from ctypes.util import find_library
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.settings import ServerSpec

NODE_DIR = Path("devices/system/node")
_NODE_NAME = re.compile(r"node(\d+)")
_MEM_TOTAL = re.compile(r"MemTotal:\s*(\d+)\s*kB")
_LIST_ITEM = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def parse_cpulist(text: str) -> frozenset[int]:
    """The ids in a kernel list such as ``0-3,8,10-11`` (sysfs ``cpulist``, ``online``)."""
    ids: set[int] = set()
    body = text.strip()
    for item in body.split(",") if body else ():
        ids.update(_parse_item(item.strip(), text))
    return frozenset(ids)


def _parse_item(item: str, text: str) -> range:
    """One ``N`` or ``A-B`` item of a kernel list."""
    match = _LIST_ITEM.fullmatch(item)
    if match is None:
        raise ValueError(f"malformed list item {item!r} in {text!r}")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if high < low:
        raise ValueError(f"descending range {item!r} in {text!r}")
    return range(low, high + 1)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact kernel form of a set of ids: ``{0, 1, 2, 5}`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, its CPUs (empty for a memory-only node) and its memory size."""

    id: int
    cpus: frozenset[int]
    mem_total_kb: int | None = None


def read_topology(sysfs_root: Path = Path("/sys")) -> list[NumaNode]:
    """Every online node with its CPUs, or one node 0 when the machine exposes no NUMA sysfs."""
    base = sysfs_root / NODE_DIR
    if not base.is_dir():
        # Containers without /sys and macOS: the process's CPUs form one node, and pinning to
        # it is a no-op, so `--numa-node auto` still starts exactly one worker.
        return [NumaNode(id=0, cpus=_allowed_cpus())]
    return [_read_node(base, node_id) for node_id in sorted(_online_ids(base))]


def _online_ids(base: Path) -> frozenset[int]:
    """Node ids from ``online``, or from the ``nodeN`` folders when that file is missing."""
    online = base / "online"
    if online.is_file():
        return parse_cpulist(online.read_text())
    return frozenset(
        int(match.group(1))
        for entry in base.iterdir()
        if entry.is_dir() and (match := _NODE_NAME.fullmatch(entry.name))
    )


def _read_node(base: Path, node_id: int) -> NumaNode:
    """One node's CPUs and MemTotal; missing files read as no CPUs and unknown memory."""
    folder = base / f"node{node_id}"
    cpulist, meminfo = folder / "cpulist", folder / "meminfo"
    cpus = parse_cpulist(cpulist.read_text()) if cpulist.is_file() else frozenset()
    match = _MEM_TOTAL.search(meminfo.read_text()) if meminfo.is_file() else None
    return NumaNode(id=node_id, cpus=cpus, mem_total_kb=int(match.group(1)) if match else None)


def _allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (all CPUs where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def find_node(topology: Sequence[NumaNode], node_id: int) -> NumaNode:
    """The node with this id; ValueError naming the available ones otherwise."""
    for node in topology:
        if node.id == node_id:
            return node
    raise ValueError(f"NUMA node {node_id} does not exist; available: {_names(topology)}")


def resolve_nodes(spec: str, topology: Sequence[NumaNode]) -> list[int]:
    """Node ids for ``--numa-node``: ``auto`` (every node with CPUs), ``N``, ``0,1`` or ``0-1``."""
    if spec.strip().lower() == "auto":
        ids = [node.id for node in topology if node.cpus]
        if not ids:
            raise ValueError(f"no NUMA node has CPUs; nodes: {_names(topology)}")
        return ids
    try:
        wanted = sorted(parse_cpulist(spec))
    except ValueError as error:
        raise ValueError(f"--numa-node must be 'auto', N or a list like 0,1: {error}") from None
    if not wanted:
        raise ValueError("--numa-node is empty; use 'auto', N or a list like 0,1")
    for node_id in wanted:
        if not find_node(topology, node_id).cpus:
            raise ValueError(f"NUMA node {node_id} has no CPUs; available: {_names(topology)}")
    return wanted


def _names(topology: Sequence[NumaNode]) -> str:
    """The nodes for an error message, memory-only ones marked."""
    return ", ".join(f"{n.id}" if n.cpus else f"{n.id} (no CPUs)" for n in topology) or "none"


def servers_for_node(servers: Sequence[ServerSpec], node: int) -> list[ServerSpec]:
    """Servers attached to ``node`` plus those with no node; ValueError when none."""
    chosen = [server for server in servers if server.numa_node in (node, None)]
    if not chosen:
        attached = sorted({s.numa_node for s in servers if s.numa_node is not None})
        raise ValueError(
            f"no server is attached to NUMA node {node}; "
            f"servers are on nodes {attached or 'none'} ({len(servers)} configured)"
        )
    return chosen


class MemPolicy(StrEnum):
    """What ``pin_to_node`` did about memory placement."""

    PREFERRED = "preferred"  # libnuma numa_set_preferred(node) is in force
    UNAVAILABLE = "unavailable"  # no libnuma, or a kernel without NUMA support
    OFF = "off"  # the caller asked for CPU pinning only
    FAILED = "failed"  # libnuma did not report the node as preferred afterwards


@dataclass(frozen=True)
class PinResult:
    """What ``pin_to_node`` applied: for the worker's log line and its heartbeat."""

    node: int
    cpus: str  # compact cpulist actually applied; empty where the platform cannot pin
    membind: MemPolicy

    def __str__(self) -> str:
        return f"NUMA node {self.node}: cpus {self.cpus or 'unpinned'}, memory {self.membind}"


def pin_to_node(node: NumaNode, *, membind: bool = True) -> PinResult:
    """Restrict the calling thread to ``node``'s CPUs and prefer its memory."""
    cpus = _set_affinity(node)
    policy = _prefer_memory(node.id) if membind else MemPolicy.OFF
    return PinResult(node=node.id, cpus=format_cpulist(cpus), membind=policy)


def _set_affinity(node: NumaNode) -> frozenset[int]:
    """Apply node CPUs ∩ allowed CPUs (cgroups, taskset); ValueError naming both when empty."""
    if not hasattr(os, "sched_setaffinity"):
        return frozenset()
    allowed = frozenset(os.sched_getaffinity(0))
    cpus = node.cpus & allowed
    if not cpus:
        raise ValueError(
            f"cannot pin to NUMA node {node.id}: its CPUs {format_cpulist(node.cpus) or 'none'} "
            f"are not among this process's allowed CPUs {format_cpulist(allowed)}"
        )
    os.sched_setaffinity(0, cpus)
    return cpus


def _prefer_memory(node_id: int) -> MemPolicy:
    """Make ``node_id`` the preferred memory node through libnuma when it is installed."""
    # Preferred rather than strict membind: under membind a full node OOM-kills the worker,
    # while a preferred policy spills to the other node, which only costs bandwidth.
    libnuma = _load_libnuma()
    if libnuma is None or libnuma.numa_available() < 0:
        return MemPolicy.UNAVAILABLE
    if node_id > libnuma.numa_max_node():
        return MemPolicy.FAILED
    libnuma.numa_set_preferred(node_id)
    # numa_set_preferred returns nothing; reading the policy back is the only confirmation.
    return MemPolicy.PREFERRED if libnuma.numa_preferred() == node_id else MemPolicy.FAILED


def _load_libnuma() -> ctypes.CDLL | None:
    """libnuma through ctypes with the prototypes used here, or None when it is absent."""
    path = find_library("numa")
    if path is None:
        return None
    try:
        libnuma = ctypes.CDLL(path)
    except OSError:
        return None
    for name in ("numa_available", "numa_max_node", "numa_preferred"):
        getattr(libnuma, name).restype = ctypes.c_int
        getattr(libnuma, name).argtypes = []
    libnuma.numa_set_preferred.restype = None
    libnuma.numa_set_preferred.argtypes = [ctypes.c_int]
    return libnuma
