"""Test services: real Postgres and Redis, from EAGLEGEN_TEST_* URLs or embedded ones.

Each test gets its own database (cloned from a migrated template) and its own Redis db.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import redis

from core.settings import ServerSpec, Settings
from core.urls import libpq_url, normalize_database_url
from eaglegen.stack import EmbeddedPostgres, EmbeddedRedis
from models.db import make_engine
from models.repository import Repository
from tests import requirements
from tests.helpers import InspectRepository

if TYPE_CHECKING:
    from eaglegen.sim import SimServer

# The suite must not pick up a developer's own configuration.
for _name in [n for n in os.environ if n.startswith("EAGLEGEN_") and "_TEST_" not in n]:
    del os.environ[_name]
# Nor find a developer's running stack: `eaglegen up` leaves a pointer to it under
# $XDG_CONFIG_HOME (eaglegen.stack), which commands run by the tests would follow.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="eaglegen-test-config-")
# Nor the width of the terminal it was started from (pytest-xdist's workers see COLUMNS=80):
# commands the tests run write to pipes, whole lines, unless a test sets COLUMNS itself.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (unknown marks are warnings, and warnings are errors)."""
    config.addinivalue_line(
        "markers",
        f"needs(*what): machine requirements ({', '.join(requirements.CHECKS)}); skipped "
        f"without them, failed instead when {requirements.REQUIRE_ALL_ENV} is set",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, when every tier is required, fail) a test whose machine lacks what it needs."""
    for mark in item.iter_markers("needs"):
        for requirement in mark.args:
            why = requirements.why_not(requirement)
            if why is None:
                continue
            if requirements.required():
                pytest.fail(f"{requirements.REQUIRE_ALL_ENV} is set and this test {why}")
            pytest.skip(why)


def _with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` (keeping host, socket and query)."""
    head, sep, query = url.partition("?")
    base = head.rsplit("/", 1)[0]
    return f"{base}/{name}{sep}{query}"


@pytest.fixture(scope="session")
def service_urls() -> Iterator[tuple[str, str]]:
    """(postgres admin URL, redis base URL) for the whole session."""
    db_url = os.environ.get("EAGLEGEN_TEST_DATABASE_URL")
    redis_url = os.environ.get("EAGLEGEN_TEST_REDIS_URL")
    tmp = Path(tempfile.mkdtemp(prefix="eaglegen-test-"))
    postgres = None if db_url else EmbeddedPostgres(tmp)
    redis_server = None if redis_url else EmbeddedRedis(tmp)
    if postgres is not None:
        db_url = postgres.start()
    if redis_server is not None:
        redis_url = redis_server.start()
    assert db_url and redis_url
    try:
        yield normalize_database_url(db_url), redis_url
    finally:
        if redis_server is not None:
            redis_server.stop()
        if postgres is not None:
            postgres.stop()


@pytest.fixture(scope="session")
def template_database(service_urls: tuple[str, str]) -> Iterator[str]:
    """A database migrated with Alembic once, cloned by every test."""
    from models.db import upgrade

    admin, _ = service_urls
    name = f"eaglegen_tpl_{os.getpid()}"
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(_with_database(admin, name))
    yield name
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(service_urls: tuple[str, str], template_database: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    admin, _ = service_urls
    name = f"eaglegen_t_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield _with_database(admin, name)
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def broker_url(service_urls: tuple[str, str]) -> str:
    """A Redis database of its own, emptied, for this test. Under pytest-xdist each worker
    process takes its own share of databases 1-15: one flushing another's mid-test would
    free its slots and drop its queue."""
    _, base = service_urls
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    db = 1 + worker + workers * (next(_counter) % (15 // workers))
    url = f"{base.rsplit('/', 1)[0]}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(scope="session")
def sim() -> Iterator[SimServer]:
    """The SGLang simulator on a free loopback port."""
    from eaglegen.sim import SimConfig, SimServer

    # Faster decode steps than the defaults: tests check behaviour, not timing.
    config = SimConfig(seed=1234, decode_step_ms=0.5, decode_ms_per_request=0.02)
    with SimServer(config) as server:
        yield server


@pytest.fixture
def worker_engine() -> str:
    """The engine of the test's worker: the default `eaglegen worker` runs. A module runs its
    tests against each by ``pytestmark = tests.workers.EACH_ENGINE``, or pins one by
    ``tests.workers.CELERY_ONLY`` (a parametrization overrides this fixture)."""
    return str(Settings.model_fields["worker_engine"].default)


@pytest.fixture
def settings(
    database_url: str, broker_url: str, sim: SimServer, tmp_path: Path, worker_engine: str
) -> Settings:
    """Settings pointing at this test's database, Redis db and the simulator."""
    return Settings(
        worker_engine=worker_engine,
        database_url=database_url,
        broker_url=broker_url,
        data_dir=tmp_path / "data",
        servers=[ServerSpec(name="sim", url=sim.url)],
        worker_concurrency=16,
        # The pid too: two pytest sessions on one machine may pick the same Redis db.
        queue=f"eaglegen-test-{os.getpid()}-{next(_counter)}",
    )


@pytest.fixture
def repo(settings: Settings) -> Iterator[Repository]:
    """A repository on this test's database."""
    assert settings.database_url is not None
    engine = make_engine(settings.database_url)
    yield InspectRepository(engine)
    engine.dispose()
