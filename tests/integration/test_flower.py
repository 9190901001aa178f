"""Issue 11: Flower tells the truth, seen in a real browser, from either engine's worker.

A real worker (in-thread: Celery's threads pool, or the loop engine) runs jobs of two
datasets against the simulator while `eaglegen flower` (a subprocess, with a login) watches
the broker; headless Chromium loads Flower's tasks page and must find a task labelled with
its dataset whose result is its token count as stored in Postgres, and a budget-skipped
task shown as SKIPPED, not as a success. Failures and deferrals are checked on Flower's API
and task page.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from core.settings import ServerSpec, Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimConfig, SimServer
from eaglegen.stack import FLOWER_AUTH_ENV, free_port
from models.states import JobState
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from tests.browser import chromium
from tests.helpers import (
    InspectRepository,
    sample_rows,
    wait_settled,
    write_jsonl,
)
from tests.integration.test_worker_processes import wait_for, worker_env, worker_process
from tests.sockets import HangUpServer
from tests.workers import EACH_ENGINE, in_thread_worker
from worker.app import nodename
from worker.celeryconfig import make_celery
from worker.events import FLUSH_S
from worker.runner import WorkerContext

pytestmark = EACH_ENGINE

RUN = "flower-run"
LOGIN = ("eagle", f"pw-{uuid.uuid4().hex[:12]}")
FAST = SimConfig(seed=77, decode_step_ms=0.5, decode_ms_per_request=0.01)
PROBE = "flower-probe@test"
# A server name of this session's own: names are held cluster-wide in Redis, which other
# test sessions on this machine may share.
SERVER = f"sim{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """This module's own simulator: its faults change per test."""
    with SimServer(FAST) as server:
        yield server


@pytest.fixture
def faults(sim: SimServer) -> Iterator[Callable[..., None]]:
    """Set the simulator's faults; all off again after the test."""
    with httpx.Client(base_url=sim.url, timeout=10) as client:

        def set_faults(**knobs: Any) -> None:
            assert client.post("/sim/faults", json=knobs).status_code == 200

        yield set_faults
        set_faults()


@pytest.fixture
def fast(settings: Settings, sim: SimServer) -> Settings:
    """Settings with quick retries and budget deferrals, on this module's simulator."""
    return settings.model_copy(
        update={
            "servers": [ServerSpec(name=SERVER, url=sim.url)],
            "retry_base_s": 0.05,
            "retry_cap_s": 0.2,
            "health_interval_s": 0.5,
            "heartbeat_interval_s": 0.5,
            "budget_defer_s": 0.1,
            "max_attempts": 2,
        }
    )


class Flower:
    """`eaglegen flower` in a subprocess, and an authenticated HTTP client for it."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log
        token = base64.b64encode(f"{LOGIN[0]}:{LOGIN[1]}".encode()).decode()
        self.authorization = f"Basic {token}"
        self.http = httpx.Client(
            base_url=url, timeout=10, headers={"Authorization": self.authorization}
        )

    def cmdline_free_of(self, secret: str) -> bool:
        """Whether Flower's command line (what `ps` shows every user) lacks ``secret``:
        `eaglegen flower` became Flower, so its pid is Flower's."""
        cmdline = Path(f"/proc/{self.process.pid}/cmdline").read_bytes().decode()
        assert "flower" in cmdline and "--tasks_columns" in cmdline, cmdline
        return secret not in cmdline

    def tasks(self) -> dict[str, dict[str, Any]]:
        """Flower's /api/tasks: every task it knows, by id."""
        body: dict[str, dict[str, Any]] = self.http.get("/api/tasks").json()
        return body


@contextmanager
def flower(settings: Settings, tmp_path: Path) -> Iterator[Flower]:
    """`eaglegen flower` with a login from the environment, ready to see events."""
    port = free_port()
    log = tmp_path / "flower.log"
    assert settings.broker_url is not None
    env = {
        **os.environ,
        "EAGLEGEN_BROKER_URL": settings.broker_url,
        "EAGLEGEN_DATA_DIR": str(tmp_path / "data"),
        FLOWER_AUTH_ENV: f"{LOGIN[0]}:{LOGIN[1]}",
    }
    argv = [sys.executable, "-m", "eaglegen", "flower", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = Flower(process, f"http://127.0.0.1:{port}", log)
    try:
        _wait_listening(client, settings)
        yield client
    finally:
        process.terminate()
        process.wait(timeout=20)
        client.http.close()


def _wait_listening(client: Flower, settings: Settings) -> None:
    """Until Flower receives events: it keeps none from before it subscribed, so a probe
    event (a worker going offline, which Flower counts in /metrics) is sent until seen."""
    assert settings.broker_url is not None
    app = make_celery(settings, settings.broker_url)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            assert client.process.poll() is None, client.log.read_text()
            try:
                metrics = client.http.get("/metrics").text
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if f'flower_worker_online{{worker="{PROBE}"}}' in metrics:
                return
            with app.events.default_dispatcher(hostname=PROBE) as dispatcher:
                dispatcher.send("worker-offline")
            time.sleep(0.3)
    finally:
        app.close()
    raise TimeoutError(f"Flower saw no event within 60 s:\n{client.log.read_text()}")


@contextmanager
def product_worker(settings: Settings) -> Iterator[tuple[WorkerContext, str]]:
    """The worker in this thread as `eaglegen worker` runs it, under its own node name."""
    servers = [s.name for s in settings.servers]
    with in_thread_worker(settings, nodename(servers)) as (ctx, name):
        yield ctx, name


def enqueue(settings: Settings, tmp_path: Path, datasets: dict[str, int | None]) -> None:
    """Six sample prompts per dataset (name → budget in tokens, None: unlimited)."""
    path = write_jsonl(tmp_path / "rows.jsonl", sample_rows(6))
    plan = RunPlan(
        run=RUN,
        tokenizer=TOKENIZER_DIR,
        datasets=[
            DatasetPlan(name, path, sampling={"max_new_tokens": 24}, budget_tokens=budget)
            for name, budget in datasets.items()
        ],
    )
    report = run_enqueue(settings, settings.services(), plan, quiet=True)
    assert [d.accepted for d in report.datasets] == [6] * len(datasets)


def job_of(args: str) -> int:
    """The job id in a label as Flower shows it (``job 12 · dataset chat · run r``)."""
    match = re.fullmatch(r"job (\d+) · dataset \S+ · run " + RUN, args)
    assert match, args
    return int(match.group(1))


@pytest.mark.needs("browser")
def test_the_tasks_page_shows_dataset_and_outcome_in_chromium(
    fast: Settings, repo: InspectRepository, tmp_path: Path, faults: Callable[..., None]
) -> None:
    # A budget of 30 tokens at 24 new tokens a job: the feeder publishes two of the capped
    # dataset's jobs; a slow answer keeps the first reserved while the second is claimed,
    # so the second is deferred (RETRY in Flower), and once the budget is spent the rest
    # are skipped without ever being published.
    faults(added_latency_ms=400)
    with flower(fast, tmp_path) as fl:
        assert fl.cmdline_free_of(LOGIN[1])
        enqueue(fast, tmp_path, {"chat": None, "capped": 30})
        with product_worker(fast) as (_ctx, node):
            states = wait_settled(repo, timeout_s=120)
            done, skipped = states["done"], states["skipped_budget"]
            assert done >= 7 and skipped >= 1 and done + skipped == 12, states
            # Events are asynchronous: wait until Flower holds every done job as a success.
            _wait_for(lambda: _succeeded(fl.tasks(), done), "every task final in Flower")
        with chromium() as driver:
            # Flower wants its login on every request, the page's XHRs included.
            driver.execute_cdp_cmd("Network.enable", {})
            driver.execute_cdp_cmd(
                "Network.setExtraHTTPHeaders", {"headers": {"Authorization": fl.authorization}}
            )
            driver.get(f"{fl.url}/tasks")
            rows = WebDriverWait(driver, 30).until(
                lambda d: (t := _table(d)) and len(t) >= done and t
            )
            capped_pages = []
            for row in rows:
                if "· dataset capped ·" in row["args"]:
                    driver.get(row["link"])
                    WebDriverWait(driver, 30).until(lambda d: "Arguments" in d.page_source)
                    body = driver.find_element(By.TAG_NAME, "body")
                    capped_pages.append(body.get_attribute("textContent"))
        log = fl.log.read_text()
    chat = [r for r in rows if "· dataset chat ·" in r["args"]]
    assert len(chat) == 6
    for row in [r for r in rows if r["state"] == "SUCCESS"]:
        generation = repo.generation(job_of(row["args"]))
        assert generation is not None
        assert row["result"] == f"'done · {generation['completion_tokens']:,} tokens'"
        assert row["worker"] == node
    assert all(r["state"] == "SUCCESS" for r in chat)
    capped = [r for r in rows if "· dataset capped ·" in r["args"]]
    for row in capped:  # each shows how its job ended: none is left as RETRY
        job = repo.job(job_of(row["args"]))
        assert job is not None
        wanted = {"SUCCESS": JobState.DONE, "SKIPPED": JobState.SKIPPED_BUDGET}[row["state"]]
        assert job["state"] == wanted.value
        if row["state"] == "SKIPPED":
            assert row["result"] == "skipped_budget"
    assert sum(r["state"] == "SUCCESS" for r in capped) == done - 6
    # The jobs skipped before anything was published for them never reach Flower.
    assert len(capped) < 6
    # A deferral is RETRY in Flower with its reason, never a stack trace.
    assert any("budget deferral" in page for page in capped_pages), capped_pages
    assert not any("most recent call last" in page for page in capped_pages)
    assert node == f"{SERVER}.pid{os.getpid()}@{socket.gethostname()}"
    assert LOGIN[1] not in log  # Flower's own output names no password


def _final(tasks: dict[str, dict[str, Any]], count: int) -> bool:
    states = [t.get("state") for t in tasks.values()]
    return len(states) == count and set(states) <= {"SUCCESS", "SKIPPED", "FAILURE"}


def _succeeded(tasks: dict[str, dict[str, Any]], successes: int) -> bool:
    """Flower holds ``successes`` successes and nothing but successes and skips."""
    states = [t.get("state") for t in tasks.values()]
    return states.count("SUCCESS") == successes and set(states) <= {"SUCCESS", "SKIPPED"}


def _wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)
    return value


def _table(driver: Any) -> list[dict[str, str]]:
    """Flower's task table as it shows it: per row, each column's text (by the column's
    slug) and the link of its task page; empty while it still says it is loading."""
    script = """
        const table = document.querySelector('#tasks-table');
        if (!table) { return []; }
        const slugs = [...table.querySelectorAll('thead th')].map(th => th.dataset.column);
        return [...table.querySelectorAll('tbody tr')]
            .filter(tr => tr.cells.length === slugs.length)
            .map(tr => {
                const row = {link: tr.querySelector('a[href*="/task/"]')?.href || ''};
                slugs.forEach((slug, i) => {
                    row[slug] = slug === 'uuid'
                        ? tr.cells[i].querySelector('a')?.title || ''
                        : tr.cells[i].textContent.trim();
                });
                return row;
            });
    """
    rows: list[dict[str, str]] = driver.execute_script(script)
    return rows


def test_a_failed_job_is_a_failure_with_its_reason_and_flower_metrics_count_it(
    fast: Settings, repo: InspectRepository, tmp_path: Path, faults: Callable[..., None]
) -> None:
    faults(error_rates={"400": 1.0})
    with flower(fast, tmp_path) as fl:
        enqueue(fast, tmp_path, {"chat": None})
        with product_worker(fast) as (_ctx, node):
            states = wait_settled(repo, timeout_s=60)
            assert {k: v for k, v in states.items() if v} == {"failed": 6}
            tasks = _wait_for(lambda: _final(t := fl.tasks(), 6) and t, "every task final")
        # Prometheus scrapes Flower's /metrics (Flower serves it without its login).
        metrics = httpx.get(f"{fl.url}/metrics", timeout=10)
    assert metrics.status_code == 200
    failed_events = [
        line
        for line in metrics.text.splitlines()
        if line.startswith("flower_events_total{")
        and 'type="task-failed"' in line
        and f'worker="{node}"' in line
    ]
    assert [float(line.rsplit(" ", 1)[1]) for line in failed_events] == [6.0], metrics.text
    for task in tasks.values():
        job_id = job_of(task["args"])
        job = repo.job(job_id)
        assert job is not None and job["state"] == JobState.FAILED.value
        assert task["state"] == "FAILURE"
        # The reason in one line, the error class with it, and no stack trace.
        reason = f"after 1 attempt(s) (http_4xx): {job['last_error']}"
        assert task["exception"] == f"JobFailed({reason!r})"
        assert task["traceback"] is None
        assert task["result"] is None


def _workers(fl: Flower) -> dict[str, dict[str, Any]]:
    """Flower's workers table (its /workers page as JSON), by worker name: each with its
    ``active`` count and its event counts (``task-received`` is the "Processed" column)."""
    body = fl.http.get("/workers", params={"json": 1}).json()
    return {w["hostname"]: w for w in body["data"]}


def _tasks_of(fl: Flower, node: str) -> list[dict[str, Any]]:
    """The tasks Flower last saw on worker ``node``."""
    return [t for t in fl.tasks().values() if t.get("worker") == node]


def _states_of(fl: Flower, node: str) -> list[str]:
    return [str(t.get("state")) for t in _tasks_of(fl, node)]


def _count(fl: Flower, node: str, state: str) -> int:
    return _states_of(fl, node).count(state)


def _stopped_cleanly(fl: Flower, node: str) -> bool:
    """Flower shows the stopped worker offline with nothing active, and none of its tasks
    received or running."""
    worker = _workers(fl).get(node)
    if not worker or worker["status"] or worker["active"] != 0:
        return False
    return not {"RECEIVED", "STARTED"} & set(_states_of(fl, node))


def _worker_env(settings: Settings, url: str, grace_s: float) -> dict[str, str]:
    return {
        **worker_env(settings, [{"name": SERVER, "url": url}]),
        "EAGLEGEN_SHUTDOWN_GRACE_S": f"{grace_s:g}",
    }


def test_a_worker_stopped_with_requests_in_flight_leaves_no_task_active_in_flower(
    fast: Settings,
    repo: InspectRepository,
    tmp_path: Path,
    sim: SimServer,
    faults: Callable[..., None],
) -> None:
    # Requests far longer than the grace period: the worker gives the four jobs it runs
    # back to the queue and exits; Flower must not keep them STARTED, nor the worker active.
    faults(added_latency_ms=15_000)
    log = tmp_path / "worker.log"
    with flower(fast, tmp_path) as fl:
        enqueue(fast, tmp_path, {"chat": None})
        with worker_process(_worker_env(fast, sim.url, 1), log, "--concurrency", "4") as process:
            node = f"{SERVER}.pid{process.pid}@{socket.gethostname()}"
            wait_for(lambda: _count(fl, node, "STARTED") == 4, 60, "four STARTED in Flower", log)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        _wait_for(lambda: _stopped_cleanly(fl, node), "the worker offline, nothing active", 120)
        tasks = _tasks_of(fl, node)
    assert "4 went back to the queue" in log.read_text(), log.read_text()[-3000:]
    given_back = [t for t in tasks if t.get("state") == "RETRY"]
    assert len(given_back) == 4, tasks
    assert all("worker stopped" in (t.get("exception") or "") for t in given_back), given_back
    states = {repo.job(job_of(t["args"]))["state"] for t in given_back}  # type: ignore[index]
    assert states == {JobState.QUEUED.value}  # back in the queue, unspent


def test_a_worker_stopped_while_its_requests_finish_shows_none_active_in_flower(
    fast: Settings,
    repo: InspectRepository,
    tmp_path: Path,
    sim: SimServer,
    faults: Callable[..., None],
) -> None:
    # SIGTERM while four requests run, which end within the grace period: Flower shows
    # them SUCCESS and the worker with nothing active (Celery's own worker-offline event,
    # sent while they still ran, said four).
    faults(added_latency_ms=1500)
    log = tmp_path / "worker.log"
    with flower(fast, tmp_path) as fl:
        enqueue(fast, tmp_path, {"chat": None})
        with worker_process(_worker_env(fast, sim.url, 60), log, "--concurrency", "4") as process:
            node = f"{SERVER}.pid{process.pid}@{socket.gethostname()}"
            wait_for(lambda: _count(fl, node, "STARTED") == 4, 60, "four STARTED in Flower", log)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        _wait_for(lambda: _stopped_cleanly(fl, node), "the worker offline, nothing active", 120)
        states = _states_of(fl, node)
    assert states.count("SUCCESS") == 4, states


def test_task_events_reach_the_broker_in_batches_each_task_whole(
    fast: Settings, repo: InspectRepository, tmp_path: Path, sim: SimServer
) -> None:
    # The worker publishes its buffered task events on a timer (worker.events.EventBatches),
    # not one publish per event, and every task's received, started and succeeded arrive,
    # in that order, as Flower's receiver reads them. The timer's ticks are FLUSH_S apart at
    # least (kombu's call_repeatedly), so events sent over a span S reach the broker in at
    # most S / FLUSH_S + 2 publishes (the first tick after the last event included), however
    # slow the machine. Celery's own flushing, at each turn of its loop, made 31 and 39 of
    # these 72 in two runs (0.18 s for the 39).
    assert fast.broker_url is not None
    broker = redis.Redis.from_url(fast.broker_url)
    db = broker.connection_pool.connection_kwargs.get("db", 0)
    pubsub = broker.pubsub()
    pubsub.subscribe(f"/{db}.celeryev/task.multi")  # kombu's fanout topic for Celery's batches
    batches: list[list[dict[str, Any]]] = []

    def drain() -> None:
        while message := pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05):
            batches.append(_events_in(message["data"]))

    def succeeded() -> int:
        drain()
        return sum(e["type"] == "task-succeeded" for batch in batches for e in batch)

    log = tmp_path / "worker.log"
    try:
        enqueue(fast, tmp_path, {"a": None, "b": None, "c": None, "d": None})
        with worker_process(_worker_env(fast, sim.url, 2), log, "--concurrency", "8"):
            wait_for(lambda: succeeded() >= 24, 120, "24 task-succeeded events", log)
    finally:
        pubsub.close()
        broker.close()
    assert sum(c.states["done"] for c in repo.counts()) == 24
    kinds: dict[str, list[str]] = {}
    for event in (e for batch in batches for e in batch):
        kinds.setdefault(event["uuid"], []).append(event["type"])
    assert len(kinds) == 24, kinds
    assert all(k == ["task-received", "task-started", "task-succeeded"] for k in kinds.values())
    stamps = [e["timestamp"] for batch in batches for e in batch]
    span = max(stamps) - min(stamps)
    assert len(batches) <= span / FLUSH_S + 2, (span, [len(batch) for batch in batches])


def _events_in(data: bytes) -> list[dict[str, Any]]:
    """The events of one message on the events exchange, as kombu's Redis transport wraps
    them (a JSON envelope, its body base64-encoded JSON: a list for a batch)."""
    envelope = json.loads(data)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    events = json.loads(body)
    return events if isinstance(events, list) else [events]


def test_a_worker_whose_server_is_dead_stops_taking_jobs_and_leaves_none_open_in_flower(
    fast: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    # Its only server hangs up on every call from the start: the worker pauses its queue
    # consumer, so it stops taking its messages (not taking and sending them back again
    # every health interval, which Flower counted as ever more tasks "Processed"), and at
    # exit it leaves no task RECEIVED or STARTED in Flower, nor itself active.
    log = tmp_path / "worker.log"
    with flower(fast, tmp_path) as fl, HangUpServer() as dead:
        enqueue(fast, tmp_path, {"chat": None})
        with worker_process(_worker_env(fast, dead.url, 2), log, "--concurrency", "4") as process:
            node = f"{SERVER}.pid{process.pid}@{socket.gethostname()}"
            _wait_for(lambda: " ready." in log.read_text(), "the worker ready", 60)
            _wait_for(lambda: node in _workers(fl) and not _count(fl, node, "STARTED"), "idle")
            processed = _workers(fl).get(node, {}).get("task-received", 0)
            calls = dead.connections
            _wait_for(lambda: dead.connections >= calls + 20, "ten more health checks", 60)
            assert _workers(fl).get(node, {}).get("task-received", 0) == processed
            assert processed <= 6  # the messages it took before its consumer paused, once
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        _wait_for(lambda: _stopped_cleanly(fl, node), "the worker offline, nothing open")
    assert repo.counts()[0].states["queued"] == 6  # every job still queued, none spent
