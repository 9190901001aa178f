"""Shared benchmark plumbing: scratch database and Redis db, synthetic prompts."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import redis

from core.urls import libpq_url
from models.db import upgrade
from models.repository import Repository

WORDS = (
    "a",
    "about",
    "algorithms",
    "and",
    "at",
    "autumn",
    "blue",
    "causes",
    "compare",
    "dusk",
    "explain",
    "haiku",
    "hash",
    "inflation",
    "irrational",
    "is",
    "list",
    "looks",
    "map",
    "noon",
    "of",
    "prove",
    "red",
    "root",
    "sky",
    "sorting",
    "square",
    "summarise",
    "that",
    "the",
    "three",
    "two",
    "uses",
    "why",
    "write",
)


def scratch_database(admin_url: str, name: str) -> str:
    """A freshly migrated database ``name`` next to ``admin_url``; its URL."""
    plain = libpq_url(admin_url)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    head, sep, query = plain.partition("?")
    url = f"{head.rsplit('/', 1)[0]}/{name}{sep}{query}"
    upgrade(url)
    return url


def scratch_redis(base_url: str, db: int) -> str:
    """Redis database ``db`` next to ``base_url``, emptied; its URL."""
    url = f"{base_url.rsplit('/', 1)[0]}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


def write_short_prompts(
    path: Path, n: int, seed: int = 0, words: tuple[int, int] = (6, 24)
) -> Path:
    """``n`` distinct single-turn chat prompts as JSONL, each of ``words`` (min, max) words."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(n):
            words_text = " ".join(rng.choices(WORDS, k=rng.randint(*words)))
            row = {"messages": [{"role": "user", "content": f"Task {i}: {words_text}."}]}
            handle.write(json.dumps(row) + "\n")
    return path


def wait_run_done(
    repo: Repository,
    run: str,
    timeout_s: float,
    every_s: float = 0.2,
    also: Callable[[], bool] | None = None,
) -> bool:
    """Poll until ``run`` has no job queued or running (and ``also()`` holds, when given);
    False if ``timeout_s`` ran out first. It reads the datasets' counters
    (`Repository.open_jobs`): a scan of the run's jobs every poll would load the machine the
    workers being measured share."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if repo.open_jobs(run) == 0 and (also is None or also()):
            return True
        time.sleep(every_s)
    return False
