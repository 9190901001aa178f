"""Issue 32: a worker's in-flight capacity follows the in-flight limit (worker.intake), as
`eaglegen worker` processes against real Postgres, Redis and the simulator. With the default
threads, a worker fills a limit that grows on a server with room; with more threads than
the limit, it holds only the messages its server has room for, and the server never sees
more than the limit."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from bench.common import write_short_prompts
from core import heartbeat
from core.limits import read_limit
from core.settings import Settings
from eaglegen.sim import SimConfig, SimServer
from models import pg
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_worker_processes import (
    InFlightSampler,
    in_flight,
    live_pids,
    summed,
    wait_for,
    worker_env,
    worker_process,
)
from tests.outage import lock_waiters
from tests.workers import CELERY_ONLY, EACH_ENGINE
from worker.intake import spare

# Room for thousands of short requests (no KV limit near), each held ~10 s by its decode
# steps: a worker's requests in flight are what its limit and threads allow.
ROOMY = SimConfig(
    seed=5, kv_tokens=4_000_000, max_running_requests=4096, decode_step_ms=300.0,
    decode_ms_per_request=0.0,
)  # fmt: skip
# ~20 ms decode steps: a 24-token answer holds its request (and its slot) for ~0.5 s.
SLOW = SimConfig(seed=99, decode_step_ms=20.0, decode_ms_per_request=0.0)
# EAGLEGEN_SERVER_MAX_INFLIGHT's default: where the controller starts.
START_LIMIT = Settings.model_fields["server_max_inflight"].default


def server_in_flight(sim: SimServer) -> int:
    """Requests running and waiting at the simulator now."""
    return in_flight(httpx.get(f"{sim.url}/metrics", timeout=5).text)


@EACH_ENGINE
def test_a_default_worker_fills_a_limit_that_grows_past_its_start(
    settings: Settings, tmp_path: Path
) -> None:
    assert settings.broker_url is not None
    with SimServer(ROOMY) as sim:
        env = worker_env(settings, [{"name": "sim", "url": sim.url}])
        # The threads and the intake as shipped; the controller samples every second
        # instead of five, only to keep the test short.
        env["EAGLEGEN_CONCURRENCY_INTERVAL_S"] = "1"
        log = tmp_path / "worker.log"
        with worker_process(env, log) as process:  # no --concurrency
            wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
            path = write_short_prompts(tmp_path / "rows.jsonl", 2000)
            enqueue_file(settings, path, max_new_tokens=32)
            # More requests at the server than the limit it started from (and than the 64
            # threads a worker had by default): the limit grew, and the worker filled it.
            # The limit is read on every poll: the controller may trim it again right after
            # the worker filled it, so the highest limit stored is what shows it grew. It is
            # read after the server's count: a limit that grows between the two readings
            # lets requests through before the poll sees it, never after.
            limits: list[int] = []
            with redis.Redis.from_url(settings.broker_url) as client:

                def filled() -> int | bool:
                    n = server_in_flight(sim)
                    record = read_limit(client, "sim")
                    if record is not None:
                        limits.append(record.limit)
                    return n > START_LIMIT and n

                seen = wait_for(
                    filled,
                    timeout_s=180,
                    what=f"more than {START_LIMIT} requests in flight",
                    log=log,
                )
            [beat] = heartbeat.alive(settings.broker_url, None, max_age_s=5)
    assert max(limits) > START_LIMIT, (limits[-5:], seen)
    assert beat.threads == 1024  # the controller's ceiling, one server


@CELERY_ONLY  # Celery's threads, each holding a message of Redis' unacked index
def test_threads_beyond_the_limit_hold_no_message_the_server_has_no_room_for(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    assert settings.broker_url is not None
    limit = 8
    with SimServer(SLOW) as sim:
        env = worker_env(settings, [{"name": "sim", "url": sim.url, "max_inflight": limit}])
        log = tmp_path / "worker.log"
        with worker_process(env, log, "--concurrency", "256") as process:
            wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
            with InFlightSampler(sim.url, settings.broker_url, "sim") as peaks:
                path = write_jsonl(tmp_path / "rows.jsonl", sample_rows(120))
                enqueue_file(settings, path, max_new_tokens=24)
                states = wait_settled(repo, timeout_s=120)
    assert states["done"] == 120, states
    assert peaks.server_counts
    # The server never sees more than the limit, and reaches it.
    assert max(peaks.server_counts) == limit
    # The worker takes only what its server has room for and the spare: not a message per
    # thread, each waiting for a slot out of other workers' reach. (Redis may count one or
    # two more for a moment: a task's message is acked by the event loop after it ends.)
    held = max(peaks.held_counts)
    assert limit <= held < 2 * limit, (held, limit + spare(limit))


@EACH_ENGINE
def test_an_answer_frees_its_slot_before_its_record_is_written(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # One slot, and the generations table locked: each answer's record waits on the lock.
    # Had the slot stayed held until the record was written, one request at most would be
    # answered; freed with the answer, the next job is sent meanwhile, and every job is
    # answered before any is recorded.
    assert settings.database_url is not None
    with SimServer(SLOW) as sim, pg.connect(settings.database_url) as lock:
        env = worker_env(settings, [{"name": "sim", "url": sim.url, "max_inflight": 1}])
        log = tmp_path / "worker.log"
        with worker_process(env, log, "--concurrency", "4") as process:
            wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
            with lock.transaction():
                lock.execute("LOCK TABLE generations IN SHARE MODE")
                enqueue_file(settings, write_short_prompts(tmp_path / "rows.jsonl", 3))
                url = settings.database_url

                def answered_unrecorded() -> bool:
                    metrics = httpx.get(f"{sim.url}/metrics", timeout=5).text
                    answered = summed(metrics, "sglang:num_requests_total")
                    return answered == 3 and len(lock_waiters(url, "generations")) >= 1

                wait_for(answered_unrecorded, 120, what="3 answered, none recorded", log=log)
                assert all(c.states.get("done", 0) == 0 for c in repo.counts())
            states = wait_settled(repo, timeout_s=120)
    assert states["done"] == 3, states
