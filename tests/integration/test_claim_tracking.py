"""A claim is the worker's from the moment it is made: one whose answer a database error
hid is still given back at shutdown, and giving back one that never committed touches
nothing (issue 27: after a SIGTERM, jobs stayed `running` while their worker "released 0").

The worker reaches the test's real Postgres through a proxy that, once, lets the claim of a
job reach the server and then ends that session with ``pg_terminate_backend`` from another
connection: after the claim committed (its answer dropped on the way back), or before the
claim's statement reached the server (nothing of it done)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from core.settings import Settings
from core.urls import libpq_url
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, write_jsonl
from tests.outage import wait_for
from tests.workers import in_thread_worker
from worker.runner import WorkerContext, release_held

# The claim's statement (models/attempt.py `_TAKE`), as it crosses the wire. It runs in
# autocommit: its answer comes once it has committed.
CLAIM = b"UPDATE jobs SET state = 'running'"
# A server message: its type byte and length (which counts itself, not the type).
_HEADER = struct.Struct("!cI")


class ClaimKiller:
    """A loopback proxy to Postgres that ends, once, the session that claims a job:
    ``after_commit`` once the claim's statement has been answered (the answer dropped: the
    claim holds, its worker never hears so), else before the statement reaches the server.
    ``on_kill`` runs first (the test stops the worker there, as a SIGTERM would)."""

    def __init__(self, database_url: str, *, after_commit: bool) -> None:
        self.database_url = database_url
        self.after_commit = after_commit
        self.killed = threading.Event()
        self.on_kill: Callable[[], object] = lambda: None
        self._armed = threading.Lock()  # held once the trap has been taken
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []

    def url(self) -> str:
        """The database URL through the proxy (plain text: it reads the protocol)."""
        url = make_url(self.database_url).set(host="127.0.0.1", port=self.port)
        # A socket folder in the query (the embedded Postgres) would bypass the proxy.
        url = url.difference_update_query(["host"])
        plain = url.update_query_dict({"sslmode": "disable", "gssencmode": "disable"})
        return plain.render_as_string(hide_password=False)

    def __enter__(self) -> ClaimKiller:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        for each in [self._listener, *self._sockets]:
            with suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on them
            each.close()

    def _accept(self) -> None:
        with suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                upstream = self._connect_upstream()
                self._sockets += [client, upstream]
                _Session(self, client, upstream).start()

    def _connect_upstream(self) -> socket.socket:
        """A connection to the Postgres of the URL: its Unix socket when the URL names a
        socket folder (the embedded Postgres of `make test`), else loopback TCP."""
        url = make_url(self.database_url)
        port = url.port or 5432
        folder = url.query.get("host")
        if isinstance(folder, str) and folder.startswith("/"):
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(f"{folder}/.s.PGSQL.{port}")
            return upstream
        return socket.create_connection(("127.0.0.1", port))

    def take(self) -> bool:
        """Whether this is the one time the trap springs."""
        return self._armed.acquire(blocking=False)

    def kill(self, pid: int) -> None:
        """End backend ``pid`` as an administrator would (its client gets a FATAL error)."""
        self.on_kill()
        with psycopg.connect(libpq_url(self.database_url), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        self.killed.set()


class _Session:
    """One client connection through the proxy: two pumps, and where its claim stands."""

    def __init__(self, proxy: ClaimKiller, client: socket.socket, upstream: socket.socket):
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.pid: int | None = None  # the backend's, from its BackendKeyData message
        self.phase = "idle"  # then "committing", "killed"
        self._start = b""  # the server's first bytes, until the pid is read from them

    def start(self) -> None:
        for source, forward in ((self.client, self._to_server), (self.upstream, self._to_client)):
            threading.Thread(target=self._pump, args=(source, forward), daemon=True).start()

    def _pump(self, source: socket.socket, forward: Callable[[bytes], None]) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                forward(data)
        for each in (self.client, self.upstream):
            with suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)

    def _to_server(self, data: bytes) -> None:
        if self.phase == "idle" and CLAIM in data and self.proxy.take():
            if not self.proxy.after_commit:
                self.phase = "killed"
                assert self.pid is not None
                self.proxy.kill(self.pid)  # the statement never reaches the server
                return
            self.phase = "committing"  # before the claim goes: its answer may come at once
        self.upstream.sendall(data)

    def _to_client(self, data: bytes) -> None:
        if self.pid is None:
            self._read_pid(data)
        if self.phase == "committing":  # the claim's answer: committed, never told
            self.phase = "killed"
            assert self.pid is not None
            self.proxy.kill(self.pid)
            return
        self.client.sendall(data)

    def _read_pid(self, data: bytes) -> None:
        self._start += data
        at = 0
        while at + _HEADER.size <= len(self._start):
            kind, length = _HEADER.unpack_from(self._start, at)
            if kind == b"K" and at + 1 + length <= len(self._start):
                (self.pid,) = struct.unpack_from("!i", self._start, at + _HEADER.size)
                return
            at += 1 + length


@contextmanager
def worker_through(
    settings: Settings, *, after_commit: bool
) -> Iterator[tuple[WorkerContext, ClaimKiller]]:
    """A worker whose Postgres sessions go through a ClaimKiller that stops the worker (as a
    SIGTERM does, `WorkerContext.begin_stop`) as it springs: no claim follows."""
    assert settings.database_url is not None
    with ClaimKiller(settings.database_url, after_commit=after_commit) as proxy:
        proxied = settings.model_copy(update={"database_url": proxy.url()})
        with in_thread_worker(proxied) as (ctx, _):
            proxy.on_kill = ctx.begin_stop
            yield ctx, proxy


def attempts_ended(ctx: WorkerContext) -> float:
    """Attempts the worker counted as ended (whatever their outcome)."""
    return sum(
        sample.value
        for metric in ctx.metrics.registry.collect()
        if metric.name == "eaglegen_worker_job_attempts"
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def test_a_claim_whose_answer_was_lost_is_given_back_at_shutdown(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
    [job_id] = repo.job_ids()
    with worker_through(settings, after_commit=True) as (ctx, proxy):
        wait_for(proxy.killed.is_set, "the claiming session ended")
        wait_for(lambda: attempts_ended(ctx) >= 1, "the attempt ended (the claim's error)")
        job = repo.job(job_id)
        assert job is not None and (job["state"], job["worker"]) == ("running", ctx.name)
        released = release_held(ctx)  # what the worker does at shutdown
    assert released == [job_id]
    job = repo.job(job_id)
    assert job is not None and (job["state"], job["attempts"]) == ("queued", 0), job
    assert job["last_error"] == "worker stopped before the request finished"


@pytest.mark.parametrize("elsewhere", [False, True], ids=["still queued", "claimed elsewhere"])
def test_giving_back_a_claim_that_never_committed_touches_nothing(
    elsewhere: bool, settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
    [job_id] = repo.job_ids()
    with worker_through(settings, after_commit=False) as (ctx, proxy):
        wait_for(proxy.killed.is_set, "the claiming session ended")
        wait_for(lambda: attempts_ended(ctx) >= 1, "the attempt ended (the claim's error)")
        if elsewhere:
            assert repo.claim(job_id, "another-worker:1", 600).job is not None
        before = repo.job(job_id)
        released = release_held(ctx)
    assert released == []
    assert before is not None and before["state"] == ("running" if elsewhere else "queued")
    assert repo.job(job_id) == before
