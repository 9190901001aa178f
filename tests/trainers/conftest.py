"""The trainers' virtualenv: found, checked once, or the tier skipped (failed when every
tier is required) with a reason that says how to build it."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import requirements

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
VENV_ENV = "EAGLEGEN_TEST_TRAINERS_VENV"
BUILD = "ops/trainers-venv.sh"
# The trainers whose versions the venv must have, as requirements.txt pins them.
TRAINERS = ("specforge", "speculators", "nvidia-modelopt")


def venv_dir() -> Path:
    """Where the trainers' venv is: $EAGLEGEN_TEST_TRAINERS_VENV, or .trainers-venv."""
    return Path(os.environ.get(VENV_ENV) or ROOT / ".trainers-venv")


def pinned() -> dict[str, str]:
    """The trainers' versions requirements.txt pins."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", REQUIREMENTS.read_text(), re.M))
    return {name: pins[name] for name in TRAINERS}


@functools.cache
def why_not() -> str | None:
    """Why the trainers' venv cannot be used, or None (checked once per process)."""
    python = venv_dir() / "bin" / "python"
    build = f"build it with `{BUILD} {venv_dir()}`"
    if not python.exists():
        return f"needs the trainers' virtualenv at {venv_dir()} ({VENV_ENV}): {build}"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, torch; "
            f"print(torch.__version__, *(m.version(n) for n in {TRAINERS!r}))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        return f"needs a working trainers' virtualenv ({probe.stderr.strip()}): {build}"
    torch, *versions = probe.stdout.split()
    found = dict(zip(TRAINERS, versions, strict=True))
    if found != pinned() or not torch.endswith("+cpu"):
        return (
            f"needs the CPU torch and {pinned()} of {REQUIREMENTS.name} in the trainers' "
            f"virtualenv (it has torch {torch}, {found}): {build}"
        )
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "trainers: needs the trainers' virtualenv (ops/trainers-venv.sh); skipped without "
        f"it, failed instead when {requirements.REQUIRE_ALL_ENV} is set",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.trainers)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("trainers") is None:
        return
    why = why_not()
    if why is None:
        return
    if requirements.required():
        pytest.fail(f"{requirements.REQUIRE_ALL_ENV} is set and this test {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    """The trainers' venv's python (the tests that take it are skipped without it)."""
    return venv_dir() / "bin" / "python"
