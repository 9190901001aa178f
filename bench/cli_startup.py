"""CLI start-up benchmark (issue 32): `eaglegen status` and `status --help` against a bare
Python process that imports SQLAlchemy and psycopg.

A scratch database gets bench.status's run of N done jobs with N generations (built once;
``--reuse`` keeps a database already built with as many jobs). Then, alternating round by
round, each a fresh process with the output captured:

- ``bare``: ``python -c "import sqlalchemy, psycopg"``, the floor of any command that reads
  Postgres;
- ``help``: ``python -m eaglegen status --help``;
- ``status``: ``python -m eaglegen status`` on the scratch database, no broker configured;
- ``status+redis`` (with ``--broker-url``): the same with a broker, heartbeats and the queue
  read from it;
- ``typer`` (with ``--typer``): what any command of this stack pays, eaglegen aside: a
  one-command Typer app with status's options that connects through SQLAlchemy, runs
  ``SELECT 1`` and prints a rich table.

Wall time and CPU time (user + system, the child's own) per run; the ratios to ``bare`` are
taken round by round, each against that round's bare process: medians and the range. Every
process runs from bytecode, as an installed eaglegen does: the cache is a directory of the
benchmark's own (PYTHONPYCACHEPREFIX, filled by a warm-up round), whether or not the
environment lets Python write bytecode beside the sources.

Usage: python -m bench.cli_startup [--jobs 1000000] [--rounds 20] [--reuse] [--typer]
       [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
       [--broker-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psycopg

from bench.common import scratch_database
from bench.status import PG, RUN, populate
from core.urls import libpq_url

DATABASE = "eaglegen_bench_cli_startup"
TYPER_APP = """
import os
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer()


@app.command()
def status(
    run: Annotated[str | None, typer.Option()] = None,
    watch: bool = False,
    interval: Annotated[float, typer.Option(min=0.5)] = 5.0,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    database_url: Annotated[str | None, typer.Option(envvar="EAGLEGEN_DATABASE_URL")] = None,
) -> None:
    import sqlalchemy
    from rich.table import Table

    assert database_url is not None
    url = database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    with sqlalchemy.create_engine(url).connect() as conn:
        value = conn.exec_driver_sql("SELECT 1").scalar()
    table = Table("value")
    table.add_row(str(value))
    Console().print(table)


@app.command()
def other() -> None:
    pass


app()
"""


def built(admin_url: str, jobs: int) -> str | None:
    """The scratch database's URL when it already holds bench.status's run with ``jobs``
    jobs (a previous run of this benchmark), else None."""
    plain = libpq_url(admin_url)
    head, sep, query = plain.partition("?")
    url = f"{head.rsplit('/', 1)[0]}/{DATABASE}{sep}{query}"
    try:
        with psycopg.connect(url, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT sum(d.jobs_done) FROM datasets d JOIN runs r ON r.id = d.run_id"
                " WHERE r.name = %s",
                (RUN,),
            ).fetchone()
    except psycopg.Error:
        return None
    return url if row is not None and row[0] == jobs else None


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh process (it must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def spread(values: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    """Median and range of ``values`` (times ``scale``)."""
    lo, mid, hi = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--hours", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reuse", action="store_true", help="keep a database already built")
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=None, help="also time status with this Redis")
    parser.add_argument("--typer", action="store_true", help="also time a bare Typer app")
    args = parser.parse_args()

    url = built(args.database_url, args.jobs) if args.reuse else None
    if url is None:
        url = scratch_database(args.database_url, DATABASE)
        start = time.perf_counter()
        populate(url, args.jobs, args.hours)
        print(f"built {args.jobs:,} jobs + {args.jobs:,} generations"
              f" in {time.perf_counter() - start:.0f} s")  # fmt: skip
    else:
        print(f"reusing {DATABASE}: {args.jobs:,} jobs")

    bytecode = tempfile.mkdtemp(prefix="eaglegen-bench-pycache-")
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")},
        "PYTHONPYCACHEPREFIX": bytecode,
    }
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    status_env = {**base, "EAGLEGEN_DATABASE_URL": url}
    cli = [sys.executable, "-m", "eaglegen", "status"]
    cases: dict[str, tuple[list[str], dict[str, str]]] = {
        "bare": ([sys.executable, "-c", "import sqlalchemy, psycopg"], base),
        "help": ([*cli, "--help"], base),
        "status": (cli, status_env),
    }
    if args.broker_url is not None:
        cases["status+redis"] = (cli, {**status_env, "EAGLEGEN_BROKER_URL": args.broker_url})
    if args.typer:
        cases["typer"] = ([sys.executable, "-c", TYPER_APP, "status"], status_env)

    for argv, env in cases.values():  # warm-up: bytecode, the page cache, Postgres's buffers
        run_once(argv, env)
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(args.rounds):
        # Each round in another order: no case always runs right after the same one.
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, cpu_seconds = run_once(*cases[name])
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)

    print(f"{args.rounds} rounds; ms as median (min-max); ratios to bare taken round by round")
    print(f"{'':>13} {'wall ms':>17} {'cpu ms':>17} {'wall / bare':>19} {'cpu / bare':>19}")
    for name in names:
        wall_ratio = [w / b for w, b in zip(wall[name], wall["bare"], strict=True)]
        cpu_ratio = [c / b for c, b in zip(cpu[name], cpu["bare"], strict=True)]
        print(
            f"{name:>13} {spread(wall[name], 1000):>17} {spread(cpu[name], 1000):>17}"
            f" {spread(wall_ratio, fmt='.2f'):>19} {spread(cpu_ratio, fmt='.2f'):>19}"
        )
    shutil.rmtree(bytecode)


if __name__ == "__main__":
    main()
