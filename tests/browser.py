"""Headless Chromium for the browser-facing parts (Flower, the HTML report).

Chromium and its driver are Debian packages (`chromium`, `chromium-driver`), installed by
`.ci/run` when missing; selenium drives them. A test that opens one is marked
``@pytest.mark.needs("browser")`` (tests/requirements.py): skipped on a machine without the
packages, failed there when every tier is required, as in CI.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM_BINARIES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_BINARIES = ("chromedriver", "chromium-driver")


def _which(names: tuple[str, ...]) -> str:
    for name in names:
        if (path := shutil.which(name)) is not None:
            return path
    raise RuntimeError(
        f"none of {', '.join(names)} is installed: apt-get install chromium chromium-driver"
    )


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[webdriver.Chrome]:
    """A headless Chromium session, closed on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = _which(CHROMIUM_BINARIES)
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",  # containers give /dev/shm 64 MB
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(_which(DRIVER_BINARIES)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
