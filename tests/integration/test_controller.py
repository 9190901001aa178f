"""The adaptive limit over HTTP and Redis: a real simulator, real Redis, threads that take their
slots through the Router. Two controllers, one writes; the limit moves to the server's knee; the
Router holds the in-flight count under it; a second controller takes over from the stored
limit when the first stops; a stalled /metrics keeps the limit and is said once; a fixed limit
stays fixed."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from core import keys
from core.limits import LimitRecord, read_limit
from core.settings import ServerSpec, Settings
from eaglegen import assets
from eaglegen.sim import SimConfig, SimServer
from models.repository import Repository
from tests.e2e.test_cli import eaglegen
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.hostile import Answer, Behaviour, hostile_server
from tests.workers import in_thread_worker
from worker.concurrency import Decision, Tuning
from worker.controller import (
    ControllerSettings,
    LimitController,
    LimitControllers,
    SharedLimits,
)
from worker.servers import Router, Server
from worker.sglang import SGLangClient
from worker.slots import SlotPool

IDS = assets.special_ids(assets.TOKENIZER_DIR)
# A batch of at most 8 requests (max_running_requests), answers of ~0.2 s: the knee is 8.
CAPPED = SimConfig(
    seed=7,
    max_running_requests=8,
    context_length=4096,
    decode_step_ms=1.0,
    decode_ms_per_request=0.05,
    mean_output_tokens=150,
)
START = 32
INTERVAL_S = 0.1
CONFIG = ControllerSettings(interval_s=INTERVAL_S, start=START)
# The same, stepped every INTERVAL_S but with a lock that outlives a loaded machine's pauses
# (three intervals of 2 s): the lapse has its own test.
STEADY = ControllerSettings(interval_s=2.0, start=START)


@pytest.fixture(scope="module")
def capped_sim() -> Iterator[SimServer]:
    """The capped simulator, shared by this module's tests."""
    with SimServer(CAPPED) as server:
        yield server


@pytest.fixture
def client(broker_url: str) -> Iterator[redis.Redis]:
    """This test's own Redis db."""
    connection = redis.Redis.from_url(broker_url)
    yield connection
    connection.close()


Attach = Callable[..., Server]


@pytest.fixture
def attach(capped_sim: SimServer) -> Iterator[Attach]:
    """Attach the simulator as a worker does, its configured limit the fallback; closed after."""
    made: list[Server] = []

    def make(max_inflight: int | None = None) -> Server:
        # A name of its own: another test session may share this Redis.
        name = f"sim-{uuid.uuid4().hex[:8]}"
        spec = ServerSpec(name=name, url=capped_sim.url, max_inflight=max_inflight)
        client = SGLangClient(spec, timeout_s=30)
        made.append(Server(spec=spec, client=client, limit=max_inflight or START))
        return made[-1]

    yield make
    for server in made:
        server.client.close()


class Load:
    """Threads that each take a slot through the Router, generate, and give it back."""

    def __init__(self, router: Router, url: str, threads: int) -> None:
        """Not started."""
        self.router, self.url, self.stop = router, url, threading.Event()
        self._ids = itertools.count()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                lease = self.router.acquire(timeout_s=0.2)
                if lease is None:
                    continue
                try:
                    i = next(self._ids)
                    own = [100 + (i * 7919 + k * 31) % 3900 for k in range(40)]
                    body = {
                        "input_ids": [IDS.bos, *own, IDS.think_start],
                        "sampling_params": {"max_new_tokens": 256},
                    }
                    http.post("/generate", json=body).raise_for_status()
                finally:
                    self.router.release(lease)


def test_one_controller_moves_the_shared_limit_to_the_knee_and_the_router_holds_it(
    capped_sim: SimServer, client: redis.Redis, attach: Attach
) -> None:
    server = attach()
    slots = SlotPool(client, lease_seconds=30)
    limits = SharedLimits(client, ttl_s=0.1)
    router = Router([server], slots, limits=limits.get)
    a = LimitController(server, client, "worker-a", slots, STEADY)
    b = LimitController(server, client, "worker-b", slots, STEADY)
    writers, held = set(), []
    with Load(router, capped_sim.url, threads=48):
        for _ in range(40):
            for controller in (a, b):
                if controller.step() is not None:
                    writers.add(controller.owner)
            record = read_limit(client, server.name)
            assert record is not None
            held.append((slots.in_flight(server.name), record.limit))
            time.sleep(INTERVAL_S)
    assert writers == {"worker-a"} and a.leading and not b.leading
    record = read_limit(client, server.name)
    assert record is not None and record.by == "worker-a" and record.limit < START
    # The knee: 8 running, plus the headroom the server admits from when one finishes. The
    # limit reaches it; it may leave it later only by growing on an empty queue, which a
    # loaded machine shows when the load's threads hold slots they are too slow to use.
    headroom = Tuning().headroom(8)
    knee = range(8 + headroom, 8 + 2 * headroom + 2)
    assert any(limit in knee for _, limit in held), held
    assert record.limit in knee or ": grow" in record.reason, record
    # The Router honours it. Requests sent before a cut drain at the server's pace (slower on a
    # loaded machine), so the count may stay over a new limit for a while, but it never grows
    # there: once a limit has stood for three samples (every cache older than its tenth of a
    # second, with time to spare for a thread paused between reading the limit and taking a
    # slot), the count is at most the limit or the previous count. And it drains to the limit.
    for i in range(3, len(held)):
        if len({limit for _, limit in held[i - 3 : i + 1]}) == 1:
            assert held[i][0] <= max(held[i - 1][0], held[i][1]), held
    assert any(n <= limit for n, limit in held[5:] if limit < START), held
    assert max(n for n, _ in held[:5]) > record.limit  # and the start let more through


def test_a_second_controller_takes_over_from_the_stored_limit(
    client: redis.Redis, attach: Attach
) -> None:
    server = attach()
    stored = LimitRecord(12, "set by a controller that stopped", 0.0, "worker-gone")
    client.set(keys.limit(server.name), stored.to_json())
    a = LimitController(server, client, "worker-a", None, CONFIG)
    b = LimitController(server, client, "worker-b", None, CONFIG)
    # No load: nothing to grow or trim, so the limit stays where the last leader left it.
    assert a.step() is not None and b.step() is None
    first = read_limit(client, server.name)
    assert first is not None and first.by == "worker-a" and first.limit == 12
    # worker-a stops stepping; its lock lapses after three intervals and worker-b leads.
    deadline = time.monotonic() + 10 * INTERVAL_S
    while b.step() is None:
        assert time.monotonic() < deadline, "the lock never lapsed"
        time.sleep(INTERVAL_S / 4)
    assert b.leading and b.core is not None
    took = read_limit(client, server.name)
    assert took is not None and took.by == "worker-b" and took.limit == 12  # not its start
    assert a.step() is None and not a.leading


def test_a_fixed_limit_has_no_controller_and_ignores_the_stored_one(
    client: redis.Redis, attach: Attach
) -> None:
    fixed = attach(max_inflight=5)
    client.set(keys.limit(fixed.name), LimitRecord(99, "stale", 0.0, "x").to_json())
    assert SharedLimits(client).get(fixed) == 5
    controller = LimitController(fixed, client, "worker-a", None, CONFIG)
    assert not controller.enabled and controller.step() is None
    assert (
        LimitControllers.for_worker([fixed], client, "worker-a", None, Settings()).controllers == []
    )


def test_shared_limits_fall_back_and_cache(client: redis.Redis, attach: Attach) -> None:
    server = attach()
    now = [0.0]
    limits = SharedLimits(client, ttl_s=1.5, clock=lambda: now[0])
    assert limits.get(server) == START  # nothing stored: the configured limit
    client.set(keys.limit(server.name), LimitRecord(20, "grow", 0.0, "a").to_json())
    assert limits.get(server) == START  # cached
    now[0] = 2.0
    assert limits.get(server) == 20
    # A record that lapsed or is not one does not open the server to its configured limit
    # (issue 27: workers went from 23 in flight to 113 when a stalled controller's lapsed).
    client.set(keys.limit(server.name), "not json")
    now[0] = 4.0
    assert limits.get(server) == 20
    client.delete(keys.limit(server.name))
    now[0] = 6.0
    assert limits.get(server) == 20
    assert SharedLimits(client).get(server) == START  # a process that never saw one


METRICS = b"sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:token_usage 0.1\n"


def test_a_stalled_metrics_read_keeps_the_limit_stored_and_is_said_once(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    stalled = threading.Event()

    def metrics(path: str) -> Answer | None:
        if path != "/metrics":
            return None
        # A byte every 0.2 s, forever: each read gets one before its own timeout.
        dripping = Answer(stream=itertools.repeat(b"#"), pause_s=0.2)
        return dripping if stalled.is_set() else Answer(body=METRICS)

    with hostile_server(Behaviour(get=metrics)) as url:
        spec = ServerSpec(name=f"hostile-{uuid.uuid4().hex[:8]}", url=url)
        server = Server(spec=spec, client=SGLangClient(spec, timeout_s=30), limit=256)
        key = keys.limit(server.name)
        client.set(key, LimitRecord(12, "trimmed", 0.0, "worker-gone").to_json(), ex=3)
        # The read's deadline: the interval, 0.5 s.
        controller = LimitController(server, client, "worker-a", None, ControllerSettings(0.5))
        assert controller.step() is not None  # read, and no load: the limit stays at 12
        stalled.set()
        with caplog.at_level(logging.WARNING, logger="worker.controller"):
            steps = [run_within(controller.step, 20.0) for _ in range(3)]
        assert steps == [None] * 3
        # Kept, and stored again at each step: it does not lapse into the default 256.
        record = read_limit(client, server.name)
        assert record is not None and record.limit == 12 and record.by == "worker-a"
        assert record.reason == "kept while /metrics is unreadable"  # as `status` shows it
        assert client.ttl(key) > 3
        said = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
        assert len(said) == 1, said
        assert "/metrics: no full answer within 0.5 s" in said[0] and "kept at 12" in said[0]
        stalled.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="worker.controller"):
            decision = controller.step()
        assert decision is not None and decision.limit == 12
        assert "/metrics read again" in caplog.text
        record = read_limit(client, server.name)
        assert record is not None and record.reason == "trimmed"  # why it is 12, again
        server.client.close()


def run_within(step: Callable[[], Decision | None], timeout_s: float) -> Decision | None:
    """``step()``, failing the test if it has not returned after ``timeout_s`` (a hang)."""
    result: list[Decision | None] = []
    thread = threading.Thread(target=lambda: result.append(step()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert result, f"the step hung for {timeout_s} s"
    return result[0]


def test_the_controller_settings_come_from_the_settings() -> None:
    assert ControllerSettings.from_settings(Settings()) == ControllerSettings()
    custom = Settings(concurrency_interval_s=2.0, concurrency_min=8, concurrency_max=64)
    config = ControllerSettings.from_settings(custom)
    assert (config.interval_s, config.tuning.min_limit, config.tuning.max_limit) == (2.0, 8, 64)


def test_a_worker_runs_the_controller_and_status_says_how_each_limit_is_set(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    adaptive = ServerSpec(name=f"adaptive-{uuid.uuid4().hex[:6]}", url=sim.url)
    with SimServer(SimConfig(seed=9, decode_step_ms=0.5)) as other:
        fixed = ServerSpec(name=f"fixed-{uuid.uuid4().hex[:6]}", url=other.url, max_inflight=3)
        live = settings.model_copy(
            update={"servers": [adaptive, fixed], "concurrency_interval_s": 0.3}
        )
        enqueue_file(live, write_jsonl(tmp_path / "d.jsonl", sample_rows(40)), max_new_tokens=32)
        services = live.services()
        env = {
            "EAGLEGEN_DATABASE_URL": services.database_url,
            "EAGLEGEN_BROKER_URL": services.broker_url,
            "EAGLEGEN_QUEUE": live.queue,
        }
        with (
            in_thread_worker(live) as (ctx, _name),
            redis.Redis.from_url(services.broker_url) as client,
        ):
            record = wait_until(lambda: read_limit(client, adaptive.name), 30.0)
            assert record.by == ctx.name and record.limit >= 1
            assert client.get(keys.limit(fixed.name)) is None  # a fixed limit has no controller
            assert wait_settled(repo, timeout_s=60)["done"] == 40
            done = eaglegen("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["servers"]}
    assert rows[adaptive.name]["adaptive"] is True
    assert rows[adaptive.name]["limit_reason"]  # the controller's last reason
    assert (rows[fixed.name]["adaptive"], rows[fixed.name]["limit"]) == (False, 3)


def wait_until(probe: Callable[[], LimitRecord | None], timeout_s: float) -> LimitRecord:
    """Poll ``probe`` until it returns a record."""
    deadline = time.monotonic() + timeout_s
    while (value := probe()) is None:
        assert time.monotonic() < deadline, "no limit stored in time"
        time.sleep(0.05)
    return value
