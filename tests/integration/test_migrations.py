"""The Alembic migrations build exactly the schema the models declare."""

from __future__ import annotations

import json

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, create_engine, text

from models.db import alembic_config, make_engine
from models.order import sort_key
from models.records import NewJob
from models.schema import Base
from tests.helpers import InspectRepository


@pytest.mark.embedded
def test_migrated_database_matches_models(database_url: str) -> None:
    engine = create_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def old_dataset(conn: Connection, run: str, think_end: int | None = None) -> int:
    """A run and its dataset written as a schema of 0003 or 0004 holds them; the dataset id."""
    run_id = conn.execute(
        text(
            "INSERT INTO runs (name, tokenizer_path, tokenizer_sha256, chat_template_sha256,"
            " model_name, think_end_id) VALUES (:n, 't', 'a', 'b', 'm', :e) RETURNING id"
        ),
        {"n": run, "e": think_end},
    ).scalar_one()
    return int(
        conn.execute(
            text(
                "INSERT INTO datasets (run_id, name, source, sampling_params)"
                " VALUES (:run, 'd', 's', '{}') RETURNING id"
            ),
            {"run": run_id},
        ).scalar_one()
    )


def test_jobs_stored_before_0004_keep_their_identity(database_url: str) -> None:
    # 0004 turned the hex prompt_sha256 into its 32 bytes and jsonb messages into json.
    command.downgrade(alembic_config(database_url), "0003")
    job = NewJob(0, [5, 6, 7], {"messages": [{"role": "user", "content": "hi"}], "tools": None})
    engine = make_engine(database_url)
    with engine.begin() as conn:
        dataset = old_dataset(conn, "r")
        conn.execute(
            text(
                "INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids,"
                " prompt_tokens, messages) VALUES (:d, 0, :sha, :ids, 3, :m)"
            ),
            {
                "d": dataset,
                "sha": job.prompt_sha256.hex(),
                "ids": job.packed,
                "m": json.dumps(job.messages),
            },
        )
    command.upgrade(alembic_config(database_url), "head")
    repo = InspectRepository(engine)
    [job_id] = repo.job_ids()
    stored = repo.job(job_id)
    assert stored is not None and stored["messages"] == job.messages
    assert stored["prompt_sha256"] == job.prompt_sha256
    # The same prompt enqueued again is the same job, by either insert path.
    assert repo.insert_jobs(dataset, [job]) == []
    assert repo.insert_jobs(dataset, [job], expect_new=True) == []
    engine.dispose()


def test_0005_marks_the_jobs_of_runs_that_expected_reasoning(database_url: str) -> None:
    # Until 0004 a run decided once (runs.think_end_id set or not); 0005 decides per job.
    command.downgrade(alembic_config(database_url), "0004")
    engine = make_engine(database_url)
    with engine.begin() as conn:
        for name, think_end in (("reasoning", 10), ("plain", None)):
            dataset = old_dataset(conn, name, think_end)
            job = NewJob(0, [1, 2, 9], {"messages": [], "tools": None})
            conn.execute(
                text(
                    "INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids,"
                    " prompt_tokens, messages) VALUES (:d, 0, :sha, :ids, 3, '{}')"
                ),
                {"d": dataset, "sha": job.prompt_sha256, "ids": job.packed},
            )
    command.upgrade(alembic_config(database_url), "head")
    with engine.connect() as conn:
        marked = dict(
            conn.execute(
                text(
                    "SELECT runs.name, jobs.opens_reasoning FROM jobs"
                    " JOIN datasets ON datasets.id = jobs.dataset_id"
                    " JOIN runs ON runs.id = datasets.run_id"
                )
            ).all()
        )
    engine.dispose()
    assert marked == {"reasoning": True, "plain": False}


def old_job(conn: Connection, dataset: int, row: int, state: str) -> tuple[int, bytes]:
    """A job as the schema of 0006 or 0007 holds it, in ``state``; its id and prompt digest."""
    job = NewJob(row, [1, 2, row + 3], {"messages": [], "tools": None})
    job_id = conn.execute(
        text(
            "INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids,"
            " prompt_tokens, messages, state) VALUES (:d, :r, :sha, :ids, 3, '{}', :s)"
            " RETURNING id"
        ),
        {"d": dataset, "r": row, "sha": job.prompt_sha256, "ids": job.packed, "s": state},
    ).scalar_one()
    return int(job_id), job.prompt_sha256


def test_0007_counts_the_jobs_a_dataset_already_has(database_url: str) -> None:
    # 0007 keeps jobs by state and done tokens on the dataset row; it fills them from the
    # jobs and generations stored before it.
    command.downgrade(alembic_config(database_url), "0006")
    states = ["queued", "queued", "running", "done", "done", "failed", "skipped_budget"]
    engine = make_engine(database_url)
    with engine.begin() as conn:
        dataset = old_dataset(conn, "r")
        for row, state in enumerate(states):
            job_id, _digest = old_job(conn, dataset, row, state)
            if state == "done":
                conn.execute(
                    text(
                        "INSERT INTO generations (job_id, output_ids, finish_type, prompt_tokens,"
                        " completion_tokens, cached_tokens, e2e_latency, server, meta_info)"
                        " VALUES (:j, '\\x', 'stop', 3, :c, 0, 0.1, 's', '{}')"
                    ),
                    {"j": job_id, "c": 5 + row},
                )
        conn.execute(text("UPDATE datasets SET used_tokens = 17 WHERE id = :d"), {"d": dataset})
    command.upgrade(alembic_config(database_url), "head")
    with engine.connect() as conn:
        counters = conn.execute(
            text(
                "SELECT jobs_queued, jobs_running, jobs_done, jobs_failed, jobs_skipped,"
                " done_prompt_tokens, done_completion_tokens, first_done_at IS NOT NULL"
                " FROM datasets WHERE id = :d"
            ),
            {"d": dataset},
        ).one()
        copied = conn.scalar(
            text("SELECT count(*) FROM generations WHERE dataset_id = :d"), {"d": dataset}
        )
    assert tuple(counters) == (2, 1, 2, 1, 1, 6, (5 + 3) + (5 + 4), True)
    assert copied == 2
    assert InspectRepository(engine).audit(lease_grace_s=1e9) == []
    engine.dispose()


def test_0008_gives_existing_jobs_their_order_and_counts_queued_ones_as_published(
    database_url: str,
) -> None:
    # 0008 adds the feeder's order: existing runs get seed 0, their jobs the keys seed 0
    # gives (computed in SQL, the same as models.order.sort_key), and their queued jobs
    # count as published (the code before it published every job at enqueue).
    command.downgrade(alembic_config(database_url), "0007")
    engine = make_engine(database_url)
    digests = {}
    with engine.begin() as conn:
        dataset = old_dataset(conn, "r")
        for row, state in enumerate(["queued", "queued", "done", "skipped_budget"]):
            job_id, digest = old_job(conn, dataset, row, state)
            digests[job_id] = (digest, state)
    command.upgrade(alembic_config(database_url), "head")
    with engine.connect() as conn:
        seed = conn.scalar(text("SELECT order_seed FROM runs WHERE name = 'r'"))
        rows = conn.execute(text("SELECT id, sort_key, published_at IS NOT NULL FROM jobs")).all()
    engine.dispose()
    assert seed == 0
    for job_id, key, published in rows:
        digest, state = digests[job_id]
        assert key == sort_key(0, digest)
        assert published == (state == "queued")
