"""`eaglegen sim`'s flags reach the server it starts: its settings as `GET /get_server_info`
reports them (under ``simulator``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

from eaglegen.stack import free_port
from tests.outage import wait_for

pytestmark = pytest.mark.e2e

# Each step cost flag, with a value no preset has.
STEP_COSTS = {
    "decode_step_ms": 3.5,
    "decode_ms_per_request": 0.25,
    "prefill_tokens_per_ms": 12.0,
    "prefill_step_ms": 7.5,
}


def server_info(process: subprocess.Popen[str], port: int) -> dict[str, Any] | None:
    """The running simulator's /get_server_info; None until it answers."""
    if process.poll() is not None:
        raise AssertionError(f"eaglegen sim exited: {process.communicate()[1]}")
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=5)
    except httpx.TransportError:
        return None
    body: dict[str, Any] = answer.raise_for_status().json()
    return body


def test_the_step_cost_flags_override_the_preset() -> None:
    port = free_port()
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in STEP_COSTS.items()]
    process = subprocess.Popen(
        [sys.executable, "-m", "eaglegen", "sim", "--preset", "kimi-k2", f"--port={port}", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info = wait_for(lambda: server_info(process, port), "the simulator to answer")
    finally:
        process.terminate()
        process.communicate(timeout=30)
    knobs = info["simulator"]
    assert knobs["preset"] == "kimi-k2"
    assert {name: knobs[name] for name in STEP_COSTS} == STEP_COSTS
