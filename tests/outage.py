"""A test's Postgres database going away and coming back, on the shared server: no new
session may connect to it and every open one is ended (``pg_terminate_backend``), as a
restart or a lost network does to a client; then it lets sessions in again. Also the
waiting and the lock inspection the outage tests sequence their steps by."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

import psycopg

from core.urls import libpq_url

T = TypeVar("T")
# How long a condition may take before the test fails (a bound on failure, never a timing
# the test relies on).
PATIENCE_S = 120.0
# How long ending one session may take (pg_terminate_backend waits for it, then warns).
TERMINATE_WAIT_MS = 10_000


def _split(database_url: str) -> tuple[str, str]:
    """(the server's maintenance database URL, the database's name)."""
    url = libpq_url(database_url)
    head, sep, query = url.partition("?")
    base, name = head.rsplit("/", 1)
    return f"{base}/postgres{sep}{query}", name


def shut_out(database_url: str) -> None:
    """No session may connect to the database any more, and every open one is ended."""
    admin, name = _split(database_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        # Sessions waiting for a lock go first, each waited for until it has ended: ended
        # together, a lock's holder could end first and its waiter run a query before its own
        # end arrived, which no outage test means to allow.
        pids = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
            " ORDER BY wait_event_type IS NOT DISTINCT FROM 'Lock' DESC, pid",
            (name,),
        ).fetchall()
        for (pid,) in pids:
            conn.execute("SELECT pg_terminate_backend(%s, %s)", (pid, TERMINATE_WAIT_MS))


def let_in(database_url: str) -> None:
    """Sessions may connect to the database again."""
    admin, name = _split(database_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


@contextmanager
def outage(database_url: str) -> Iterator[None]:
    """The database shut out for the block (let in again however it ends)."""
    shut_out(database_url)
    try:
        yield
    finally:
        let_in(database_url)


def wait_for(condition: Callable[[], T | None], what: str) -> T:
    """Poll ``condition`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        found = condition()
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {PATIENCE_S:g} s for {what}")
        time.sleep(0.05)


def lock_waiters(database_url: str, table: str, *, granted: bool = False) -> list[int]:
    """The pids of the sessions of the database waiting for a lock on ``table``
    (``granted``: holding one instead), in pid order. A database cloned from the template has
    the same table OIDs as its siblings, hence the filter on the database."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE d.datname = current_database() AND l.relation = %s::regclass"
            " AND l.granted = %s AND l.pid <> pg_backend_pid() ORDER BY l.pid",
            (table, granted),
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def lock_waiter(database_url: str, table: str, *, granted: bool = False) -> int | None:
    """The first of ``lock_waiters``, or None."""
    return next(iter(lock_waiters(database_url, table, granted=granted)), None)


def holds_lock(database_url: str, pid: int, table: str) -> bool:
    """Whether session ``pid`` holds a lock on ``table``."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND relation = %s::regclass AND granted",
            (pid, table),
        ).fetchone()
    return row is not None and int(row[0]) > 0


class Lines:
    """The lines a child process writes to a pipe, read as they come (by a thread)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def close(self) -> None:
        """Once the process has ended: the rest read, the pipe closed."""
        self._thread.join(timeout=PATIENCE_S)
        self._stream.close()

    def next_matching(self, wanted: Callable[[str], bool], what: str) -> str:
        """The next line (after those already taken) for which ``wanted`` holds."""
        deadline = time.monotonic() + PATIENCE_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"waited {PATIENCE_S:g} s for {what}") from None
            if line is None:
                raise EOFError(f"the output ended before {what}: {self.seen[-20:]}")
            self.seen.append(line)
            if wanted(line):
                return line
