"""Issue 13: Postgres owns the order. The feeder keeps a bounded window in Redis, in each
dataset's seeded order, datasets side by side, and never publishes a spent budget's jobs."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from core import wire
from core.broker import Publisher
from core.settings import ServerSpec, Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimServer
from eaglegen.stack import EmbeddedRedis
from models.order import SORT_KEY_SQL, sort_key
from models.records import GenerationRecord
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from tests.e2e.test_cli import eaglegen
from tests.helpers import InspectRepository, wait_settled, write_jsonl
from tests.workers import in_thread_worker
from worker.feeder import MIN_WINDOW, Feeder, paced_window

SEED = 20261201


def rows(n: int, topic: str = "topic") -> list[dict[str, object]]:
    """``n`` prompts sorted by a row feature (their topic number), as Hub files often are."""
    return [
        {"messages": [{"role": "user", "content": f"{topic} {i // 25}: question {i}"}]}
        for i in range(n)
    ]


def enqueue(
    settings: Settings,
    tmp_path: Path,
    datasets: dict[str, tuple[int, int | None]],
    max_new_tokens: int = 16,
) -> None:
    """Enqueue datasets (name -> (rows, budget)) into run ``r`` with the fixed order seed."""
    plans = []
    for name, (n, budget) in datasets.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows(n, name))
        sampling = {"max_new_tokens": max_new_tokens}
        plans.append(DatasetPlan(name, path, sampling=sampling, budget_tokens=budget))
    plan = RunPlan(run="r", tokenizer=TOKENIZER_DIR, datasets=plans, order_seed=SEED)
    run_enqueue(settings, settings.services(), plan, quiet=True)


@pytest.fixture
def client(settings: Settings) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(settings.services().broker_url) as conn:
        yield conn


def feeder(settings: Settings, repo: Repository, window: int) -> Feeder:
    url = settings.services().broker_url
    return Feeder(repo, redis.Redis.from_url(url), Publisher(url, settings.queue), window=window)


def queued_ids(client: redis.Redis, queue: str) -> list[int]:
    """Job ids in the queue list, oldest (next to be taken) first."""
    return [j for raw in reversed(client.lrange(queue, 0, -1)) if (j := wire.job_id_of(raw))]


def test_the_sql_and_python_sort_keys_agree(repo: Repository) -> None:
    digests = [bytes([i]) * 32 for i in range(5)]
    with repo.engine.connect() as conn:
        for seed in (0, 1, SEED, (1 << 62) - 1):
            for digest in digests:
                sql = SORT_KEY_SQL.format(seed="CAST(:seed AS bigint)", digest=":digest")
                got = conn.scalar(text(f"SELECT {sql}"), {"seed": seed, "digest": digest})
                assert got == sort_key(seed, digest)


def test_the_window_is_published_in_the_seeded_order_and_topped_up(
    settings: Settings, repo: InspectRepository, client: redis.Redis, tmp_path: Path
) -> None:
    enqueue(settings, tmp_path, {"d": (100, None)})
    assert client.llen(settings.queue) == 0  # enqueue stores; the feeder publishes
    keys = {j: repo.job(j)["sort_key"] for j in repo.job_ids()}  # type: ignore[index]
    in_order = sorted(keys, key=lambda j: (keys[j], j))
    feed = feeder(settings, repo, window=30)
    first = feed.feed()
    assert (first.published, first.in_redis, first.window) == (30, 0, 30)
    assert queued_ids(client, settings.queue) == in_order[:30]
    assert feed.feed().published == 0  # the window is full
    for _ in range(10):  # workers take ten: more than half is left, nothing to do yet
        client.rpop(settings.queue)
    assert feed.feed().published == 0
    for _ in range(6):  # six more: down to half, topped up to the window
        client.rpop(settings.queue)
    assert feed.feed().published == 16
    assert queued_ids(client, settings.queue) == in_order[16:46]
    # The enqueue recorded the seed: the same prompts get the same order again.
    assert repo.order_seed("r") == SEED


def test_a_job_sent_back_returns_through_the_order_after_its_backoff(
    settings: Settings, repo: InspectRepository, client: redis.Redis, tmp_path: Path
) -> None:
    enqueue(settings, tmp_path, {"d": (5, None)})
    feed = feeder(settings, repo, window=1)
    feed.feed()
    [job] = queued_ids(client, settings.queue)
    client.delete(settings.queue)
    assert repo.claim(job, "w", 60).job is not None
    assert repo.release(job, "w", "503", retry_in_s=1.0, kind="http_5xx")
    feed.feed()
    [other] = queued_ids(client, settings.queue)
    assert other != job  # backing off: the next job in the order goes first
    client.delete(settings.queue)
    time.sleep(1.1)
    feed.feed()
    assert queued_ids(client, settings.queue) == [job]  # then it is first again


@pytest.mark.embedded
def test_a_spent_budget_is_never_published_and_a_raise_publishes_it(
    settings: Settings, repo: InspectRepository, client: redis.Redis, tmp_path: Path
) -> None:
    enqueue(settings, tmp_path, {"capped": (20, 100)}, max_new_tokens=200)
    feed = feeder(settings, repo, window=50)
    assert feed.feed().published == 1  # 100 tokens of room, 200 a job at worst: one
    [job] = queued_ids(client, settings.queue)
    assert repo.claim(job, "w", 60).job is not None
    assert feed.feed().published == 0  # the room is held by the running job
    record = GenerationRecord([5] * 150, "length", 150, 10, 150, 0, 0.1, "sim")
    assert repo.record(job, "w", record)  # 150 used of 100: spent
    client.delete(settings.queue)
    report = feed.feed()
    assert (report.published, report.skipped) == (0, 19)
    assert client.llen(settings.queue) == 0
    [counts] = repo.counts()
    assert (counts.states["done"], counts.states["skipped_budget"]) == (1, 19)
    requeued = repo.set_budget("r", "capped", 10_000)
    assert len(requeued) == 19
    assert feed.feed().published == 19  # 9,850 tokens of room at 150 a job
    assert sorted(queued_ids(client, settings.queue)) == requeued


def test_a_budget_keeps_a_uniform_sample_of_a_sorted_file(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    # A budget for about a tenth of a file sorted by topic: the done rows must be spread
    # over the whole file (a Kolmogorov-Smirnov test against uniform row indexes), where
    # the first rows in file order would hold the first topics only.
    n = 400
    enqueue(settings, tmp_path, {"sorted": (n, 16 * n // 10)})
    with in_thread_worker(settings):
        wait_settled(repo, timeout_s=120)
    done = sorted(
        repo.job(j)["row_index"]  # type: ignore[index]
        for j in repo.job_ids()
        if repo.job(j)["state"] == "done"  # type: ignore[index]
    )
    assert 20 <= len(done) <= n // 2, len(done)
    critical = 1.63 / math.sqrt(len(done))  # alpha = 0.01
    assert ks_uniform(done, n) < critical, (ks_uniform(done, n), critical, done)
    assert ks_uniform(list(range(len(done))), n) > critical  # the file-order prefix fails


def test_a_steady_run_logs_changes_of_state_not_a_line_per_pass(
    settings: Settings, repo: InspectRepository, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A window of 8 for 200 jobs: at least 25 passes publish (one tops the window up to 8
    # at most). The feeder says when it takes the queue, starts and stops publishing, and
    # when a budget is spent; what it did in between, at most every ten minutes.
    small = settings.model_copy(update={"window": 8})
    enqueue(small, tmp_path, {"open": (200, None), "capped": (40, 160)})
    caplog.set_level(logging.INFO, logger="worker")  # the Celery test worker sets ERROR on root
    with in_thread_worker(small):
        states = wait_settled(repo, timeout_s=120)
    assert states["done"] >= 200 and states["skipped_budget"] > 0, states
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("worker.")]
    feeder_lines = [line for line in lines if line.startswith("feeder: ")]
    print(*lines, sep="\n")
    assert 0 < len(feeder_lines) <= 8, feeder_lines
    spent = [line for line in feeder_lines if "spent its budget" in line]
    assert len(spent) == 1 and "dataset 'capped' of run 'r'" in spent[0], feeder_lines
    assert len(lines) <= 12, lines  # the worker's other lines: changes of state too


def ks_uniform(indexes: list[int], n: int) -> float:
    """The Kolmogorov-Smirnov distance between row indexes and a uniform spread on [0, n)."""
    points = sorted((i + 0.5) / n for i in indexes)
    m = len(points)
    return max(max((k + 1) / m - u, u - k / m) for k, u in enumerate(points))


def test_datasets_enqueued_one_after_the_other_progress_side_by_side(
    settings: Settings, repo: InspectRepository, sim: SimServer, tmp_path: Path
) -> None:
    # The window set: left to the feeder, it would hold a second of the workers' pace
    # (worker.feeder.PACE_HORIZON_S), and a dataset enqueued mid-run starts only after the
    # messages already waiting, up to a second later; in a run of a few seconds that lag,
    # not the allocation this test is about, would be what it measures.
    few = settings.model_copy(
        update={
            "worker_concurrency": 4,
            "servers": [ServerSpec(name="sim", url=sim.url, max_inflight=4)],
            "window": MIN_WINDOW,
        }
    )
    with in_thread_worker(few):
        enqueue(few, tmp_path, {"first": (300, None)})
        wait_for_done(repo, 20)  # the first dataset is under way when the second arrives
        enqueue(few, tmp_path, {"second": (100, None)})
        done = wait_for_done(repo, 200)  # the midpoint of the run
    fraction = {name: n / total for name, (n, total) in done.items()}
    assert abs(fraction["first"] - fraction["second"]) < 0.15, done


def wait_for_done(repo: Repository, total: int) -> dict[str, tuple[int, int]]:
    """Poll until ``total`` jobs are done; then each dataset's (done, jobs)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        counts = {c.dataset: c for c in repo.counts()}
        if sum(c.states["done"] for c in counts.values()) >= total:
            return {name: (c.states["done"], sum(c.states.values())) for name, c in counts.items()}
        time.sleep(0.02)
    raise TimeoutError(f"{total} jobs not done within 120 s")


def test_the_window_stays_bounded_with_a_million_jobs_queued(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    # A million stored jobs: Redis holds the window and nothing more, where one message per
    # queued job (the producer's way before this feeder) would take about a gigabyte.
    enqueue(settings, tmp_path, {"big": (1, None)})
    jobs = 1_000_000
    with repo.engine.begin() as conn:
        dataset = conn.scalar(text("SELECT id FROM datasets WHERE name = 'big'"))
        conn.execute(
            text(
                "INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids, prompt_tokens,"
                " messages, sort_key)"
                " SELECT :d, i, sha256(int4send(i)), '\\x01000000', 1, '[]', "
                + SORT_KEY_SQL.format(seed=str(SEED), digest="sha256(int4send(i))")
                + " FROM generate_series(1, :n) AS i"
            ),
            {"d": dataset, "n": jobs - 1},
        )
        conn.execute(
            text("UPDATE datasets SET jobs_queued = jobs_queued + :n WHERE id = :d"),
            {"d": dataset, "n": jobs - 1},
        )
    server = EmbeddedRedis(tmp_path / "private")  # its memory is this test's alone
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        before = int(client.info("memory")["used_memory"])
        window = 2000
        feed = Feeder(repo, client, Publisher(server.url, settings.queue), window=window)
        for _ in range(3):
            feed.feed()
            for _ in range(window // 2):  # workers take half between passes
                client.rpop(settings.queue)
        feed.feed()
        assert client.llen(settings.queue) == window
        grown = int(client.info("memory")["used_memory"]) - before
        message = sum(len(m) for m in client.lrange(settings.queue, 0, 9)) / 10
        assert grown < 2 * window * message, (grown, message)
        assert grown * 100 < jobs * message  # under 1% of a message per queued job
    finally:
        client.close()
        server.stop()


def test_status_shows_the_window_and_the_order_seed(
    settings: Settings, repo: InspectRepository, tmp_path: Path
) -> None:
    enqueue(settings, tmp_path, {"d": (50, None)})
    feeder(settings, repo, window=20).feed()
    services = settings.services()
    env = {
        "EAGLEGEN_DATABASE_URL": services.database_url,
        "EAGLEGEN_BROKER_URL": services.broker_url,
        "EAGLEGEN_QUEUE": settings.queue,
    }
    done = eaglegen("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["window"] == {"in_redis": 20, "bound": 20, "published": 20, "unpublished": 30}
    assert [run["order_seed"] for run in document["runs"]] == [SEED]
    view = eaglegen("status", env={**env, "COLUMNS": "200"})
    assert view.returncode == 0, view.stderr
    shown = " ".join(view.stdout.split())
    assert "window: 20 message(s) waiting in Redis (bound 20)" in shown
    assert "20 queued job(s) with a message out, 30 queued in Postgres for the feeder" in shown
    assert f"order seed {SEED}" in shown


def test_a_window_left_to_the_feeder_holds_a_second_of_a_fast_pace_then_shrinks_back(
    settings: Settings, repo: Repository, client: redis.Redis, tmp_path: Path
) -> None:
    # No worker's heartbeat: the heartbeats' window is its floor, MIN_WINDOW. Workers that
    # take the whole of it between two passes take faster than a window a second.
    jobs = 3000
    enqueue(settings, tmp_path, {"fast": (jobs, None)})
    feed = feeder(settings, repo, window=0)  # 0: left to the feeder, as unset
    first = feed.feed()
    assert first.window == MIN_WINDOW and client.llen(settings.queue) == MIN_WINDOW
    for _ in range(MIN_WINDOW):
        assert client.rpop(settings.queue) is not None
    second = feed.feed()
    assert second.window == paced_window(MIN_WINDOW, second.taken_per_s) > MIN_WINDOW
    # Topped up to the window, or with every job left when a fast machine's pace makes the
    # window larger than that.
    assert client.llen(settings.queue) == min(second.window, jobs - MIN_WINDOW)
    # Nobody takes any more: the pace decays pass by pass, and the window with it.
    windows = [feed.feed().window for _ in range(80)]
    assert windows == sorted(windows, reverse=True) and windows[-1] == MIN_WINDOW
