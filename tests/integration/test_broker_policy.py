"""A Redis that may evict keys (queued messages among them) is named at worker start and by
`eaglegen status`; Redis's own default, noeviction, is not."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from core import keys
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimConfig, SimServer
from eaglegen.stack import EmbeddedRedis
from models.states import JobState
from tests.faults.harness import make_repo
from tests.helpers import enqueue_file, write_jsonl
from tests.integration.test_worker_processes import eaglegen, wait_for, worker_env, worker_process
from tests.workers import EACH_ENGINE

WARNING = "Redis maxmemory-policy is allkeys-lru"


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[str]:
    """A private Redis with an eviction policy, as production setups often have."""
    server = EmbeddedRedis(tmp_path / "evicting")
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.close()
    try:
        yield server.url
    finally:
        server.stop()


def test_status_names_an_evicting_redis(settings: Settings, evicting_redis: str) -> None:
    env = worker_env(settings, [])
    quiet = eaglegen(env, "status")
    assert quiet.returncode == 0 and "maxmemory-policy" not in quiet.stderr
    loud = eaglegen({**env, "EAGLEGEN_BROKER_URL": evicting_redis}, "status")
    assert loud.returncode == 0
    assert WARNING in " ".join(loud.stderr.split())
    assert "noeviction" in loud.stderr


@pytest.fixture
def info_refusing_redis(evicting_redis: str) -> str:
    """The evicting Redis as a user whose ACL refuses INFO (and allows every other command),
    as managed Redis services may: whether it evicts cannot be known."""
    with redis.Redis.from_url(evicting_redis) as admin:
        admin.acl_setuser(
            "reader",
            enabled=True,
            passwords=["+s3cret"],
            keys=["*"],
            channels=["*"],
            categories=["+@all"],
            commands=["-info"],
        )
    url = evicting_redis.replace("redis://", "redis://reader:s3cret@", 1)
    with redis.Redis.from_url(url) as reader, pytest.raises(redis.ResponseError):
        reader.info("memory")
    return url


def test_status_reads_the_rest_of_redis_where_an_acl_refuses_info(
    settings: Settings, info_refusing_redis: str
) -> None:
    env = {**worker_env(settings, []), "EAGLEGEN_BROKER_URL": info_refusing_redis}
    shown = eaglegen(env, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    assert "maxmemory-policy" not in shown.stderr
    assert json.loads(shown.stdout)["window"]["in_redis"] == 0  # the queue was read all the same
    assert "s3cret" not in shown.stdout + shown.stderr


@EACH_ENGINE
def test_a_worker_runs_where_an_acl_refuses_info(
    settings: Settings, sim: SimServer, info_refusing_redis: str, tmp_path: Path
) -> None:
    acl = settings.model_copy(update={"broker_url": info_refusing_redis})
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(8)]
    enqueue_file(acl, write_jsonl(tmp_path / "d.jsonl", rows), max_new_tokens=16)
    log = tmp_path / "worker.log"
    with worker_process(worker_env(acl, [{"name": "sim", "url": sim.url}]), log):
        wait_for(lambda: _count(acl, JobState.DONE) == 8, 60, "8 jobs done", log)
    text = " ".join(log.read_text().split())
    assert "Traceback" not in text and "maxmemory-policy" not in text, text[-2000:]


def test_status_leaves_out_a_redis_that_connects_and_never_answers(settings: Settings) -> None:
    """The connection is made (the kernel completes it in the backlog); no reply ever
    comes: status shows Postgres's figures without Redis's (each answer has a timeout;
    ``eaglegen`` gives up after 60 s)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        shown = eaglegen(
            {**worker_env(settings, []), "EAGLEGEN_BROKER_URL": url}, "status", "--json"
        )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["window"]["in_redis"] is None


@pytest.mark.parametrize("report", [b"not json", b"[1]", b'{"window": "9"}', b"{}"])
def test_status_shows_no_bound_from_a_feeder_report_it_cannot_read(
    settings: Settings, report: bytes
) -> None:
    assert settings.broker_url is not None
    with redis.Redis.from_url(settings.broker_url) as client:
        client.set(keys.feeder_report(settings.queue), report)
    shown = eaglegen(worker_env(settings, []), "status", "--json")
    assert shown.returncode == 0, shown.stderr
    window = json.loads(shown.stdout)["window"]
    assert window["bound"] is None and window["in_redis"] == 0


@EACH_ENGINE
def test_a_worker_on_an_evicting_redis_says_so_at_start(
    settings: Settings, sim: SimServer, evicting_redis: str, tmp_path: Path
) -> None:
    env = {
        **worker_env(settings, [{"name": "sim", "url": sim.url}]),
        "EAGLEGEN_BROKER_URL": evicting_redis,
    }
    log = tmp_path / "worker.log"
    with worker_process(env, log):
        wait_for(lambda: WARNING in " ".join(log.read_text().split()), 60, "the warning", log)


@EACH_ENGINE
def test_a_worker_whose_redis_refuses_writes_exits_non_zero_saying_why(
    settings: Settings, tmp_path: Path
) -> None:
    # Jobs flowing (a slow server keeps the worker fetching), then Redis fills up
    # (noeviction): Celery stops on an unrecoverable OutOfMemoryError, the loop engine on
    # "Redis refuses writes". Before, the Celery engine's process exited 0, and a supervisor
    # restarting on failure left it down.
    server = EmbeddedRedis(tmp_path / "full")
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        with SimServer(SimConfig(decode_step_ms=20.0, decode_ms_per_request=0.0)) as slow:
            full = settings.model_copy(update={"broker_url": server.url})
            rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(300)]
            enqueue_file(full, write_jsonl(tmp_path / "d.jsonl", rows), max_new_tokens=64)
            env = {
                **worker_env(full, [{"name": "slow", "url": slow.url}]),
                "EAGLEGEN_WORKER_CONCURRENCY": "4",
            }
            log = tmp_path / "worker.log"
            with worker_process(env, log) as process:
                wait_for(lambda: _count(full, JobState.DONE) > 0, 60, "a job done", log)
                client.config_set("maxmemory", "1")  # every write refused from now on
                code = process.wait(timeout=120)
            # No job it held waits out a lease (600 s): each is back in the queue or done.
            assert _count(full, JobState.RUNNING) == 0
    finally:
        client.close()
        server.stop()
    text = " ".join(log.read_text().split())
    assert code != 0, text[-2000:]
    assert "worker stopped (exit 1): OutOfMemoryError: " in text
    assert "used memory > 'maxmemory'" in text


def _count(settings: Settings, state: JobState) -> int:
    repo = make_repo(settings)
    try:
        return sum(c.states.get(state.value, 0) for c in repo.counts())
    finally:
        repo.engine.dispose()


def test_a_full_redis_does_not_stop_an_enqueue_and_the_feeder_publishes_later(
    settings: Settings, tmp_path: Path
) -> None:
    server = EmbeddedRedis(tmp_path / "full")
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        client.config_set("maxmemory", "1")  # full: every write refused (noeviction)
        full = settings.model_copy(update={"broker_url": server.url})
        rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(50)]
        data = write_jsonl(tmp_path / "d.jsonl", rows)
        env = worker_env(full, [])
        result = eaglegen(
            env,
            "enqueue",
            str(data),
            "--run",
            "r",
            "--dataset",
            "d",
            "--tokenizer",
            str(TOKENIZER_DIR),
        )
        # Redis carries only the window: the jobs are Postgres's, stored whatever Redis says.
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("warning:") == 1
        message = " ".join(result.stderr.split())
        assert "Redis refused to wake the feeder" in message
        assert "every job above is stored" in message
        assert client.llen(settings.queue) == 0
        # Once Redis takes writes, a feeder pass (here the one of `reconcile`) publishes them.
        client.config_set("maxmemory", "0")
        assert eaglegen(env, "reconcile").returncode == 0
        assert client.llen(settings.queue) == 50
    finally:
        client.close()
        server.stop()
