"""Fixtures of the fault tests: fast settings, worker fleets, private services, simulators.

Every fault test gets a Redis of its own (a redis-server on a free port under tmp_path), not a
db of the shared one: a test here kills and restarts things, and Redis-wide keys (the
reconciler lock, FLUSHDB of a db number another pytest session picked too) would let two
sessions on one machine disturb each other. Postgres is the test's own database, on the
shared server (EAGLEGEN_TEST_DATABASE_URL) or the embedded one, except where it is restarted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import pytest

from core.settings import Settings
from eaglegen.sim import SimConfig, SimServer
from models.db import upgrade
from models.repository import Repository
from tests.faults.harness import Fleet, PrivatePostgres, PrivateRedis, fault_settings, make_repo

FleetFactory = Callable[[Settings, list[str]], Fleet]


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (unknown marks are warnings, and warnings are errors)."""
    config.addinivalue_line("markers", "faults: kills workers, restarts services, injects faults")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A Redis of this test's own, started; the shared one is never touched."""
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_postgres(tmp_path: Path) -> Iterator[PrivatePostgres]:
    """A Postgres cluster of this test's own (pgserver under tmp_path), started."""
    server = PrivatePostgres(tmp_path / "pg")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fast_settings(
    database_url: str, private_redis: PrivateRedis, tmp_path: Path, worker_engine: str
) -> Settings:
    """This test's database, its own Redis, its workers' engine and short intervals."""
    return fault_settings(database_url, private_redis.url, tmp_path, worker_engine)


@pytest.fixture
def repo(fast_settings: Settings) -> Iterator[Repository]:
    """A repository on this test's database."""
    repository = make_repo(fast_settings)
    yield repository
    repository.engine.dispose()


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[FleetFactory]:
    """Builds worker fleets; every worker they started is killed at teardown."""
    fleets: list[Fleet] = []

    def build(settings: Settings, servers: list[str]) -> Fleet:
        fleets.append(Fleet(settings, servers, tmp_path / "logs"))
        return fleets[-1]

    yield build
    for fleet in fleets:
        fleet.close()


@pytest.fixture
def fleet(fleet_factory: FleetFactory, fast_settings: Settings, sim: SimServer) -> Fleet:
    """A fleet of workers on this test's services and the session's simulator."""
    return fleet_factory(fast_settings, [f"sim={sim.url}"])


class OwnServicesRun(NamedTuple):
    """A test's settings, repository and fleet on a Postgres and a Redis of its own."""

    settings: Settings
    repo: Repository
    fleet: Fleet


@pytest.fixture
def own_services_run(
    private_postgres: PrivatePostgres,
    private_redis: PrivateRedis,
    sim: SimServer,
    fleet_factory: FleetFactory,
    tmp_path: Path,
    worker_engine: str,
) -> Iterator[OwnServicesRun]:
    """Workers of the test's engine on the session's simulator, with a Postgres of the test's
    own, migrated, beside its own Redis: for a test that restarts either."""
    upgrade(private_postgres.url)
    settings = fault_settings(private_postgres.url, private_redis.url, tmp_path, worker_engine)
    repo = make_repo(settings)
    try:
        yield OwnServicesRun(settings, repo, fleet_factory(settings, [f"sim={sim.url}"]))
    finally:
        repo.engine.dispose()


@pytest.fixture
def make_sim() -> Iterator[Callable[[SimConfig], SimServer]]:
    """Starts private simulators (for faults set at runtime); all stopped at teardown."""
    with ExitStack() as stack:
        yield lambda config: stack.enter_context(SimServer(config))
