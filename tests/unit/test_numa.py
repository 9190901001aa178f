"""NUMA topology, node selection, server choice and pinning (real pinning in subprocesses)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from ctypes.util import find_library
from pathlib import Path
from typing import Any

import pytest

from core.settings import ServerSpec
from worker import numa
from worker.numa import (
    MemPolicy,
    NumaNode,
    PinResult,
    find_node,
    format_cpulist,
    parse_cpulist,
    pin_to_node,
    read_topology,
    resolve_nodes,
    servers_for_node,
)

ROOT = Path(__file__).resolve().parents[2]
SYSFS = ROOT / "tests" / "data" / "sysfs"
TWO_NODE = read_topology(SYSFS / "two-node")
MEMORY_ONLY = read_topology(SYSFS / "memory-only-node")

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity needs Linux"
)


# --- cpulist parsing and formatting ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("0-23,48-71\n", set(range(24)) | set(range(48, 72))),
        ("5", {5}),
        ("7-7", {7}),
        ("3,1,2", {1, 2, 3}),
        (" 0 , 2-3 \n", {0, 2, 3}),
        ("0-1,1-2", {0, 1, 2}),
        ("", set()),
        ("\n", set()),
        ("   ", set()),
    ],
)
def test_parse_cpulist(text: str, expected: set[int]) -> None:
    assert parse_cpulist(text) == frozenset(expected)


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "1,,2", "1,", "0-3:2/4", "1 2", "²"])
def test_parse_cpulist_rejects_malformed_lists(text: str) -> None:
    with pytest.raises(ValueError, match=r"list item|descending"):
        parse_cpulist(text)


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [
        (set(), ""),
        ({4}, "4"),
        ({0, 1}, "0-1"),
        ({0, 1, 2, 5}, "0-2,5"),
        ({11, 10, 8, 3, 2, 1, 0}, "0-3,8,10-11"),
        ([2, 2, 3], "2-3"),
    ],
)
def test_format_cpulist(cpus: set[int] | list[int], expected: str) -> None:
    assert format_cpulist(cpus) == expected


@pytest.mark.parametrize("text", ["", "0", "0-23,48-71", "24-47,72-95", "0,2,4-5,9"])
def test_canonical_lists_round_trip(text: str) -> None:
    assert format_cpulist(parse_cpulist(text)) == text


def test_random_sets_round_trip() -> None:
    rng = random.Random(7)
    for _ in range(200):
        cpus = frozenset(rng.sample(range(256), rng.randint(0, 64)))
        assert parse_cpulist(format_cpulist(cpus)) == cpus


# --- topology from sysfs --------------------------------------------------------------------


def test_two_node_box() -> None:
    assert [node.id for node in TWO_NODE] == [0, 1]
    assert TWO_NODE[0].cpus == frozenset(range(24)) | frozenset(range(48, 72))
    assert TWO_NODE[1].cpus == frozenset(range(24, 48)) | frozenset(range(72, 96))
    assert TWO_NODE[1].mem_total_kb == 1056965632


def test_one_node_box() -> None:
    assert read_topology(SYSFS / "one-node") == [
        NumaNode(id=0, cpus=frozenset(range(16)), mem_total_kb=65536000)
    ]


def test_memory_only_node_is_reported_without_cpus() -> None:
    assert [(node.id, format_cpulist(node.cpus)) for node in MEMORY_ONLY] == [
        (0, "0-7"),
        (1, "8-15"),
        (2, ""),
    ]
    assert MEMORY_ONLY[2].mem_total_kb == 268435456


def test_node_folders_are_scanned_when_online_is_missing(tmp_path: Path) -> None:
    shutil.copytree(SYSFS / "memory-only-node", tmp_path, dirs_exist_ok=True)
    (tmp_path / numa.NODE_DIR / "online").unlink()
    assert read_topology(tmp_path) == MEMORY_ONLY


def test_online_decides_which_nodes_are_read(tmp_path: Path) -> None:
    shutil.copytree(SYSFS / "two-node", tmp_path, dirs_exist_ok=True)
    (tmp_path / numa.NODE_DIR / "online").write_text("1\n")
    assert read_topology(tmp_path) == [TWO_NODE[1]]


@linux_only
def test_no_sysfs_means_one_node_with_the_allowed_cpus(tmp_path: Path) -> None:
    assert read_topology(tmp_path) == [NumaNode(id=0, cpus=frozenset(os.sched_getaffinity(0)))]


def test_no_sysfs_and_no_affinity_uses_the_cpu_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert read_topology(tmp_path) == [NumaNode(id=0, cpus=frozenset(range(6)))]


def test_real_topology_is_readable() -> None:
    topology = read_topology()
    assert topology and any(node.cpus for node in topology)


# --- choosing nodes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("auto", [0, 1]), ("AUTO ", [0, 1]), ("1", [1]), ("0", [0]), ("0,1", [0, 1]), ("1,0", [0, 1])],
)
def test_resolve_nodes(spec: str, expected: list[int]) -> None:
    assert resolve_nodes(spec, TWO_NODE) == expected


def test_auto_skips_memory_only_nodes() -> None:
    assert resolve_nodes("auto", MEMORY_ONLY) == [0, 1]


def test_unknown_node_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"NUMA node 5 does not exist; available: 0, 1$"):
        resolve_nodes("5", TWO_NODE)
    with pytest.raises(ValueError, match="node 2 does not exist"):
        resolve_nodes("0,2", TWO_NODE)


def test_memory_only_node_cannot_host_a_worker() -> None:
    with pytest.raises(ValueError, match=r"node 2 has no CPUs; available: 0, 1, 2 \(no CPUs\)"):
        resolve_nodes("2", MEMORY_ONLY)


@pytest.mark.parametrize("spec", ["", " ", "one", "-1", "0;1"])
def test_bad_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="--numa-node"):
        resolve_nodes(spec, TWO_NODE)


def test_auto_without_any_cpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="no NUMA node has CPUs"):
        resolve_nodes("auto", [NumaNode(id=0, cpus=frozenset())])


def test_find_node() -> None:
    assert find_node(TWO_NODE, 1) is TWO_NODE[1]
    with pytest.raises(ValueError, match="available: 0, 1"):
        find_node(TWO_NODE, 3)


# --- choosing servers -----------------------------------------------------------------------

SERVERS = [
    ServerSpec(name="gpu0", url="http://h:30000", numa_node=0),
    ServerSpec(name="gpu4", url="http://h:30004", numa_node=1),
    ServerSpec(name="remote", url="http://r:30000"),
    ServerSpec(name="gpu1", url="http://h:30001", numa_node=0),
]


def test_servers_on_the_node_plus_unattached_ones() -> None:
    assert [s.name for s in servers_for_node(SERVERS, 0)] == ["gpu0", "remote", "gpu1"]
    assert [s.name for s in servers_for_node(SERVERS, 1)] == ["gpu4", "remote"]


def test_unattached_servers_serve_every_node() -> None:
    assert servers_for_node(SERVERS[2:3], 7) == SERVERS[2:3]


def test_no_server_for_the_node_is_an_error() -> None:
    attached = [s for s in SERVERS if s.numa_node is not None]
    with pytest.raises(ValueError, match=r"node 2; servers are on nodes \[0, 1\] \(3 configured"):
        servers_for_node(attached, 2)
    with pytest.raises(ValueError, match="nodes none"):
        servers_for_node([], 0)


# --- pinning, with the OS calls replaced (the pytest process is never pinned) ---------------


@pytest.fixture
def fake_affinity(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[int]]:
    """Allowed CPUs 0-3; records sched_setaffinity calls instead of making them."""
    calls: list[frozenset[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(
        os, "sched_setaffinity", lambda pid, cpus: calls.append(frozenset(cpus)), raising=False
    )
    return calls


def test_pin_applies_node_cpus_within_the_allowed_ones(fake_affinity: list[frozenset[int]]) -> None:
    result = pin_to_node(NumaNode(id=1, cpus=frozenset({2, 3, 8})), membind=False)
    assert fake_affinity == [frozenset({2, 3})]
    assert result == PinResult(node=1, cpus="2-3", membind=MemPolicy.OFF)
    assert str(result) == "NUMA node 1: cpus 2-3, memory off"


def test_pin_to_cpus_outside_the_allowed_set_names_both(
    fake_affinity: list[frozenset[int]],
) -> None:
    with pytest.raises(ValueError, match=r"CPUs 24-47,72-95 are not among .* allowed CPUs 0-3$"):
        pin_to_node(TWO_NODE[1])
    assert fake_affinity == []


def test_pin_to_a_memory_only_node_is_refused(fake_affinity: list[frozenset[int]]) -> None:
    with pytest.raises(ValueError, match="node 2: its CPUs none"):
        pin_to_node(MEMORY_ONLY[2])


class FakeLibnuma:
    """The four libnuma calls pin_to_node makes, on a machine with ``nodes`` nodes."""

    def __init__(self, available: int = 0, nodes: int = 2, sticks: bool = True) -> None:
        self.available, self.nodes, self.sticks, self.preferred = available, nodes, sticks, 0

    def numa_available(self) -> int:
        return self.available

    def numa_max_node(self) -> int:
        return self.nodes - 1

    def numa_set_preferred(self, node: int) -> None:
        self.preferred = node if self.sticks else self.preferred

    def numa_preferred(self) -> int:
        return self.preferred


@pytest.mark.parametrize(
    ("lib", "expected"),
    [
        (FakeLibnuma(), MemPolicy.PREFERRED),
        (None, MemPolicy.UNAVAILABLE),
        (FakeLibnuma(available=-1), MemPolicy.UNAVAILABLE),
        (FakeLibnuma(nodes=1), MemPolicy.FAILED),
        (FakeLibnuma(sticks=False), MemPolicy.FAILED),
    ],
)
def test_memory_policy(
    lib: FakeLibnuma | None,
    expected: MemPolicy,
    fake_affinity: list[frozenset[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(numa, "_load_libnuma", lambda: lib)
    assert pin_to_node(NumaNode(id=1, cpus=frozenset({0}))).membind is expected


# --- real pinning on this machine, each in a fresh interpreter ------------------------------


def run_python(*parts: str) -> Any:
    """Run the code ``parts`` in a new interpreter at the repo root; it prints one JSON value."""
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(textwrap.dedent(part) for part in parts)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


PROCESS_POLICY = """
    def process_policy():
        # The kernel's view of the memory policy (absent on kernels built without NUMA).
        try:
            with open("/proc/self/numa_maps") as maps:
                return maps.readline().split()[1]
        except FileNotFoundError:
            return None
"""

PIN_REAL_NODE_0 = """
    import json, os
    from worker.numa import find_node, format_cpulist, pin_to_node, read_topology
    node = find_node(read_topology(), 0)
    expected = node.cpus & os.sched_getaffinity(0)
    if not expected:
        print(json.dumps({"skip": f"node 0 CPUs {format_cpulist(node.cpus)} not allowed here"}))
        raise SystemExit
    result = pin_to_node(node)
    policy = process_policy()
    print(json.dumps({
        "expected": sorted(expected), "after": sorted(os.sched_getaffinity(0)),
        "result": {"cpus": result.cpus, "membind": str(result.membind)},
        "cpus": format_cpulist(expected), "policy": policy,
    }))
"""


@linux_only
def test_real_pin_to_node_0() -> None:
    out = run_python(PROCESS_POLICY, PIN_REAL_NODE_0)
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["after"] == out["expected"] != []
    assert out["result"]["cpus"] == out["cpus"]
    if find_library("numa") is None:
        assert out["result"]["membind"] == "unavailable"
        assert out["policy"] in ("default", None)
    elif out["result"]["membind"] == "preferred":
        # Checked against the kernel, not only against libnuma's own read-back.
        assert out["policy"] in ("prefer:0", None)
    else:  # libnuma present but NUMA calls refused (seccomp, old kernel)
        assert out["result"]["membind"] == "unavailable"


@linux_only
def test_real_pin_narrows_the_affinity() -> None:
    out = run_python("""
        import json, os
        from worker.numa import NumaNode, pin_to_node
        cpu = max(os.sched_getaffinity(0))
        result = pin_to_node(NumaNode(id=0, cpus=frozenset({cpu})), membind=False)
        print(json.dumps([cpu, sorted(os.sched_getaffinity(0)), result.cpus]))
    """)
    cpu, after, applied = out
    assert after == [cpu] and applied == str(cpu)


@linux_only
def test_real_pin_without_libnuma_reports_unavailable() -> None:
    out = run_python(
        PROCESS_POLICY,
        """
        import json
        from worker import numa
        numa.find_library = lambda name: None  # as on a machine without libnuma1
        node = numa.find_node(numa.read_topology(), 0)
        print(json.dumps([str(numa.pin_to_node(node).membind), process_policy()]))
    """,
    )
    membind, policy = out
    assert membind == "unavailable"
    assert policy in ("default", None)


@linux_only
def test_real_pin_to_absent_cpus_raises_the_clear_error() -> None:
    if TWO_NODE[1].cpus & os.sched_getaffinity(0):
        pytest.skip("this machine has the fixture's node-1 CPUs")
    out = run_python(f"""
        import json, os
        from pathlib import Path
        from worker.numa import pin_to_node, read_topology
        before = sorted(os.sched_getaffinity(0))
        try:
            pin_to_node(read_topology(Path({str(SYSFS / "two-node")!r}))[1])
        except ValueError as error:
            print(json.dumps([str(error), before == sorted(os.sched_getaffinity(0))]))
    """)
    message, unchanged = out
    assert message.startswith("cannot pin to NUMA node 1: its CPUs 24-47,72-95 are not among")
    assert message.endswith(f"allowed CPUs {format_cpulist(os.sched_getaffinity(0))}")
    assert unchanged
