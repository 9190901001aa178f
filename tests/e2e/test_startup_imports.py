"""What `eaglegen status --help` and `eaglegen status` import: none of the heavy libraries
that only other commands use (BENCHMARKS.md, "CLI start-up"). Checked by module name in a
fresh process (its ``sys.modules`` as it exits), whatever the machine's speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

# Imported by some command; neither `status` nor a command's help needs any of them.
HEAVY = frozenset(
    {
        "transformers",
        "tokenizers",
        "huggingface_hub",
        "datasets",
        "pyarrow",
        "numpy",
        "matplotlib",
        "PIL",
        "celery",
        "kombu",
        "httpx",
        "httpcore",
        "jinja2",
        "alembic",
        "prometheus_client",
        "starlette",
        "uvicorn",
        "sqlalchemy.orm",
        "models.schema",
        "models.repository",
    }
)
# A command's help reads no service and no setting.
NOT_FOR_HELP = HEAVY | {"sqlalchemy", "psycopg", "redis", "core.settings"}
# Without a broker, status reads Postgres only, through psycopg alone (models.pg).
NOT_FOR_STATUS = HEAVY | {"redis", "sqlalchemy"}
# With one, Redis too: the reasons of the servers' limits come from core.limits, not from
# worker.controller (which imports httpx and kombu).
NOT_FOR_STATUS_WITH_REDIS = HEAVY | {"worker.controller", "sqlalchemy"}


# `eaglegen ARGS` as the console script runs it, writing the names in sys.modules at exit
# to the file named first.
RUN = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "eaglegen"
from eaglegen.__main__ import main
main()
"""


def imported(*args: str, env: dict[str, str], tmp_path: Path) -> set[str]:
    """The modules `eaglegen ARGS` has imported when it exits (it must succeed)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEGEN_")}
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(out), *args],
        env={**base, "EAGLEGEN_DATA_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(out.read_text()))


def test_status_help_imports_no_service_client_and_no_heavy_library(tmp_path: Path) -> None:
    loaded = imported("status", "--help", env={}, tmp_path=tmp_path)
    assert "eaglegen.cli.status" in loaded
    assert loaded & NOT_FOR_HELP == set()


def test_status_imports_no_heavy_library(database_url: str, tmp_path: Path) -> None:
    loaded = imported("status", env={"EAGLEGEN_DATABASE_URL": database_url}, tmp_path=tmp_path)
    assert {"psycopg", "models.status"} <= loaded
    assert loaded & NOT_FOR_STATUS == set()


def test_status_with_a_broker_imports_no_heavy_library(
    database_url: str, broker_url: str, tmp_path: Path
) -> None:
    env = {"EAGLEGEN_DATABASE_URL": database_url, "EAGLEGEN_BROKER_URL": broker_url}
    loaded = imported("status", env=env, tmp_path=tmp_path)
    assert {"redis", "core.limits"} <= loaded
    assert loaded & NOT_FOR_STATUS_WITH_REDIS == set()
