"""What some tests need from the machine beyond Python: Debian packages and root.

A test marked ``@pytest.mark.needs("browser")`` (or ``"faketime"``, ``"netns"``) is skipped
with a one-line reason where the machine lacks it (``pytest -rs`` lists them), so
``make test`` passes on a fresh machine. With ``EAGLEGEN_TEST_REQUIRE_ALL=1`` (``make test-all``
and CI set it) the same test fails instead: CI never passes with one of them not run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Callable

REQUIRE_ALL_ENV = "EAGLEGEN_TEST_REQUIRE_ALL"


def _missing(commands: tuple[str, ...], package: str) -> str | None:
    absent = [name for name in commands if shutil.which(name) is None]
    if absent:
        return f"needs {', '.join(absent)}: apt-get install {package}"
    return None


def _browser() -> str | None:
    """Headless Chromium and its driver, driven by selenium (tests/browser.py)."""
    return _missing(("chromium", "chromedriver"), "chromium chromium-driver")


def _faketime() -> str | None:
    """libfaketime's command: a process on a skewed clock, as on another host."""
    return _missing(("faketime",), "faketime")


def _netns() -> str | None:
    """Network namespaces: root and iproute2, and a kernel that lets us make one."""
    if (why := _missing(("ip",), "iproute2")) is not None:
        return why
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = subprocess.run(["ip", "netns", "add", "eg-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "eg-probe"], check=False)
    return None


def _root() -> str | None:
    """Root: pgserver then runs the embedded Postgres as a user of its own (``pgserver``)."""
    return (
        None
        if os.geteuid() == 0
        else "needs root (only then does pgserver run Postgres as its own user)"
    )


CHECKS: dict[str, Callable[[], str | None]] = {
    "browser": _browser,
    "faketime": _faketime,
    "netns": _netns,
    "root": _root,
}


@functools.cache
def why_not(requirement: str) -> str | None:
    """Why this machine cannot meet ``requirement``, or None when it can (checked once)."""
    return CHECKS[requirement]()


def required() -> bool:
    """Whether a missing requirement fails the test instead of skipping it."""
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")
