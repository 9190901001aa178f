"""A worker's log through a database outage: one line when it starts, a short reminder per
EAGLEGEN_LOG_REMINDER_S, one line when it ends; no stack trace and no line per pass or job.

An `eaglegen worker` process reaches the test's real Postgres through a gate (tests/sockets.py)
that the test shuts (every connection cut, the port closed) and opens again."""

from __future__ import annotations

import re
from pathlib import Path

from core.settings import Settings
from eaglegen.sim import SimServer
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_worker_processes import live_pids, wait_for, worker_env, worker_process
from tests.sockets import database_gate

JOBS = 40
REMINDER_S = 2.0
STARTS = "database unreachable: "
REMINDS = "database unreachable (for "
ENDS = re.compile(r"database back after \d+ s")


def test_a_database_outage_is_one_line_reminders_and_one_line_when_it_ends(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    # The worker's database goes away while jobs wait in Postgres: its feeder, which must
    # read them to publish them, fails at every pass until the database is back.
    assert settings.database_url is not None
    rows = sample_rows(2 * JOBS)
    log = tmp_path / "worker.log"
    with database_gate(settings.database_url) as gate:
        env = {
            **worker_env(settings, [{"name": "sim", "url": sim.url}]),
            "EAGLEGEN_DATABASE_URL": gate.database_url(settings.database_url),
            "EAGLEGEN_LOG_REMINDER_S": str(REMINDER_S),
        }
        with worker_process(env, log, "--concurrency", "8") as process:
            wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
            first = write_jsonl(tmp_path / "first.jsonl", rows[:JOBS])
            enqueue_file(settings, first, max_new_tokens=8)
            wait_for(lambda: _done(repo) == JOBS, 60, "the first jobs done", log)
            gate.shut()
            second = write_jsonl(tmp_path / "second.jsonl", rows[JOBS:])
            enqueue_file(settings, second, max_new_tokens=8)  # the test's own connection
            wait_for(lambda: STARTS in log.read_text(), 30, "the outage said", log)
            # Three reminders: the worker went on trying for three reminder intervals.
            wait_for(lambda: log.read_text().count(REMINDS) >= 3, 60, "three reminders", log)
            gate.open()
            wait_for(lambda: ENDS.search(log.read_text()), 60, "the end said", log)
            states = wait_settled(repo, timeout_s=120)
    assert states.get("done") == 2 * JOBS, states
    text = log.read_text()
    start, end = text.index(STARTS), ENDS.search(text)
    assert end is not None
    during = text[text.rindex("\n", 0, start) + 1 : end.end()].splitlines()
    reminders = [line for line in during if REMINDS in line]
    print(f"{len(during)} line(s) from the outage's start to its end:", *during, sep="\n")
    assert "Traceback" not in text, text[-5000:]
    assert text.count(STARTS) == 1 and len(ENDS.findall(text)) == 1, during
    # The outage's first line, its reminders, its end, and at most a few other changes of
    # state (a server or loop is not expected to change then): not a line per pass or job.
    assert len(during) <= 2 + len(reminders) + 3, during
    assert all(line.rstrip().endswith("; retrying") for line in reminders), reminders
    # A reminder per EAGLEGEN_LOG_REMINDER_S at most, by the log's own clock.
    lasted = _stamp(during[-1]) - _stamp(during[0])
    assert len(reminders) <= lasted / REMINDER_S + 1, (lasted, reminders)


def _stamp(line: str) -> float:
    """Seconds since midnight of a Celery log line (``[2026-12-03 12:32:18,998: ...``)."""
    match = re.match(r"\[\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3})", line)
    assert match, line
    hours, minutes, seconds, millis = map(int, match.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def _done(repo: Repository) -> int:
    return sum(c.states.get("done", 0) for c in repo.counts())
