"""Workers on two "hosts" (Linux network namespaces, each with its own address on a veth
pair) against one Redis and one Postgres, the simulator on a third. Mid-run one worker
host's link is cut, later restored: every job still ends done exactly once, and the jobs
that host held are re-queued by the reconciler of the other.

Needs root and iproute2 (`ip netns`): tests/requirements.py.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from core import heartbeat
from eaglegen.stack import EmbeddedRedis, free_port
from models.repository import Repository
from tests.faults.harness import (
    assert_exactly_once,
    fault_settings,
    make_repo,
    report,
    seed_jobs,
    state_counts,
    wait_for,
    worker_env,
)

SUBNET = "10.231.0"
HOST_IP = f"{SUBNET}.1"  # the root namespace, on the bridge: Redis and Postgres
BRIDGE = "egbr0"
JOBS = 300


pytestmark = [pytest.mark.faults, pytest.mark.needs("netns")]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """A network namespace with one address, linked to the bridge by a veth pair."""

    name: str
    address: str

    @property
    def link(self) -> str:
        """The veth end on the bridge side: setting it down cuts the host off."""
        return f"ve-{self.name}"[:15]

    def create(self) -> None:
        ip("netns", "add", self.name)
        ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        ip("link", "set", self.link, "master", BRIDGE, "up")
        run = ["netns", "exec", self.name, "ip"]
        ip(*run, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip(*run, "link", "set", "eth0", "up")
        ip(*run, "link", "set", "lo", "up")

    def cut(self, connected: bool) -> None:
        ip("link", "set", self.link, "up" if connected else "down")

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)
        subprocess.run(["ip", "link", "del", self.link], check=False, capture_output=True)

    def popen(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )


class Forward:
    """A TCP forwarder from HOST_IP:port to the test's Postgres (a TCP or Unix socket),
    so that the other namespaces reach the database the fixtures made."""

    def __init__(self, target: tuple[int, object]) -> None:
        self.family, self.address = target
        self.listener = socket.create_server((HOST_IP, 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            upstream = socket.socket(self.family, socket.SOCK_STREAM)
            upstream.connect(self.address)  # type: ignore[arg-type]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            with contextlib.suppress(OSError):  # either side closed: the pipe is done
                while data := source.recv(65536):
                    sink.sendall(data)
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            source.close()  # each socket is the source of one pipe: closed once

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


def postgres_target(url: str) -> tuple[int, object]:
    """Where the test's Postgres listens: (family, address) of its TCP port or socket."""
    parts = urlsplit(url)
    query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
    if "host" in query and query["host"].startswith("/"):
        port = parts.port or 5432
        return socket.AF_UNIX, f"{query['host']}/.s.PGSQL.{port}"
    return socket.AF_INET, (parts.hostname or "127.0.0.1", parts.port or 5432)


def through(url: str, port: int) -> str:
    """``url`` pointed at HOST_IP:port (its user, database and other options kept)."""
    parts = urlsplit(url)
    user = parts.username or "postgres"
    auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("host="))
    return urlunsplit((parts.scheme, f"{auth}{HOST_IP}:{port}", parts.path, query, ""))


@pytest.fixture
def network() -> Iterator[dict[str, Host]]:
    """The bridge and three hosts: the simulator's and two workers'."""
    hosts = {
        "sim": Host("eg-sim", f"{SUBNET}.20"),
        "w1": Host("eg-w1", f"{SUBNET}.31"),
        "w2": Host("eg-w2", f"{SUBNET}.32"),
    }
    subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)
    for host in hosts.values():
        host.delete()
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    try:
        for host in hosts.values():
            host.create()
        yield hosts
    finally:
        for host in hosts.values():
            host.delete()
        subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)


class BridgeRedis(EmbeddedRedis):
    """A private Redis listening on the bridge's address."""

    def command(self) -> list[str]:
        argv = super().command()
        at = argv.index("--bind")
        return [*argv[: at + 1], HOST_IP, *argv[at + 2 :]]

    @property
    def url(self) -> str:
        return f"redis://{HOST_IP}:{self.port}/0"


def test_a_cut_host_loses_and_duplicates_nothing(
    database_url: str, network: dict[str, Host], tmp_path: Path, worker_engine: str
) -> None:
    started = time.monotonic()
    broker = BridgeRedis(tmp_path / "redis")
    broker.start()
    forward = Forward(postgres_target(database_url))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        url = through(database_url, forward.port)
        settings = fault_settings(url, broker.url, tmp_path, worker_engine)
        repo = make_repo(settings)
        total = len(seed_jobs(settings, JOBS, max_new_tokens=32))
        sim_port = free_port()
        env = worker_env(settings)
        logs = tmp_path / "logs"
        logs.mkdir()
        processes.append(
            network["sim"].popen(
                [sys.executable, "-m", "eaglegen", "sim", "--host", network["sim"].address,
                 "--port", str(sim_port), "--added-latency-ms", "150"],
                env, logs / "sim.log",
            )
        )  # fmt: skip
        server = f"--server=sim=http://{network['sim'].address}:{sim_port}"
        for name in ("w1", "w2"):
            argv = [sys.executable, "-m", "eaglegen", "worker", server, "--concurrency=8"]
            processes.append(network[name].popen(argv, env, logs / f"{name}.log"))
        wait_for(lambda: len(heartbeat.alive(broker.url, None, 5.0)) == 2, 90, "two workers",
                 lambda: _tails(logs))  # fmt: skip
        cut = _cut_when_busy(repo, network["w1"], logs)
        wait_for(lambda: _requeued(repo, cut), 60, "the cut host's jobs re-queued",
                 lambda: _tails(logs))  # fmt: skip
        network["w1"].cut(connected=True)
        wait_for(lambda: _settled(repo), 180, "every job done", lambda: _tails(logs))
        assert_exactly_once(repo, total, _NoFleet(logs))  # type: ignore[arg-type]
        redone = [repo.job(j) for j in cut]
        assert all(j is not None and j["attempts"] >= 2 for j in redone), redone
        report("cut host", jobs=total, held_at_cut=len(cut),
               seconds=round(time.monotonic() - started, 1))  # fmt: skip
        repo.engine.dispose()
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        forward.close()
        broker.stop()


def _cut_when_busy(repo: Repository, host: Host, logs: Path) -> list[int]:
    """Once a quarter of the jobs are done, cut ``host`` off; the jobs it held running."""
    wait_for(lambda: state_counts(repo)["done"] >= JOBS // 4, 120, "a quarter done",
             lambda: _tails(logs))  # fmt: skip
    host.cut(connected=False)
    # A worker is named host:pid, and the namespaces share the host name: find the cut
    # host's jobs by the pids of its processes.
    pids = _pids_in(host.name)
    running = [repo.job(j) for j in repo.job_ids()]
    held = [
        int(j["id"])
        for j in running
        if j and j["state"] == "running" and int(str(j["worker"]).rsplit(":", 1)[-1]) in pids
    ]
    assert held, "the cut host held no running job: the test exercised nothing"
    return held


def _pids_in(namespace: str) -> set[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return {int(p) for p in done.stdout.split()}


def _requeued(repo: Repository, jobs: list[int]) -> bool:
    """Every one of ``jobs`` left the cut host: re-queued, or already done by another."""
    for job_id in jobs:
        job = repo.job(job_id)
        if job is None or (job["state"] == "running" and job["attempts"] < 2):
            return False
    return True


def _settled(repo: Repository) -> bool:
    states = state_counts(repo)
    return bool(states) and states["queued"] + states["running"] == 0


def _tails(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
        for p in sorted(logs.glob("*.log"))
    )


class _NoFleet:
    """What assert_exactly_once needs of a fleet: its logs on failure."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def tails(self) -> str:
        return _tails(self.logs)


def test_urls_through_the_bridge() -> None:
    assert through("postgresql+psycopg://postgres@127.0.0.1:5432/db?x=1", 9) == (
        f"postgresql+psycopg://postgres@{HOST_IP}:9/db?x=1"
    )
    socket_url = "postgresql+psycopg://postgres:@/postgres?host=/tmp/pg"
    assert postgres_target(socket_url) == (socket.AF_UNIX, "/tmp/pg/.s.PGSQL.5432")
