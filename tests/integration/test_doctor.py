"""`eaglegen doctor` against real simulators: it passes a good server and names what is
wrong with one that leaks prompt tokens, strips the think-end token or serves another model;
against a hostile server, each answer too large or too slow fails its check instead of
filling the doctor's memory or hanging it."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from eaglegen.assets import TOKENIZER_DIR
from eaglegen.doctor import Probe, examine
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from tests.e2e.test_cli import eaglegen
from tests.hostile import Answer, Behaviour, hostile_server

# The bundled template opens a reasoning block, so the probe must come back with </think>.
GOOD = SimConfig(seed=3, decode_step_ms=0.2, decode_ms_per_request=0.01)


def run_file(folder: Path, model: str = GOOD.model_path) -> Path:
    path = folder / "run.toml"
    path.write_text(
        f'run = "r"\ntokenizer = "{TOKENIZER_DIR}"\nmodel = "{model}"\n'
        '[[datasets]]\nname = "d"\npath = "d.jsonl"\n'
    )
    return path


def doctor(sim: SimServer, *args: str) -> tuple[int, dict[str, Any]]:
    done = eaglegen("doctor", "--server", sim.url, *args, "--json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def verdicts(document: dict[str, Any]) -> dict[str, bool | None]:
    return {c["check"]: c["ok"] for c in document["checks"]}


def test_a_good_server_passes_and_its_limits_are_reported(tmp_path: Path) -> None:
    with SimServer(GOOD) as sim:
        code, document = doctor(sim, str(run_file(tmp_path)))
    assert code == 0 and document["healthy"], document
    assert verdicts(document) == {
        "reachable": True, "model": True, "generate": True, "completion count": True,
        "response contract": True, "special tokens": True, "metrics": True,
    }  # fmt: skip
    server = document["server"]
    assert server["max_total_num_tokens"] == GOOD.kv_tokens
    assert server["max_running_requests"] == GOOD.max_running_requests
    assert server["context_length"] == GOOD.context_length


@pytest.mark.parametrize(
    ("faults", "failing", "says"),
    [
        (FaultConfig(leak_prompt_tokens=8), "no prompt in output", "prompt's last 8 tokens"),
        (FaultConfig(strip_special_tokens=True), "special tokens", "strips special tokens"),
    ],
)
def test_a_server_that_changes_the_tokens_fails_with_the_reason(
    tmp_path: Path, faults: FaultConfig, failing: str, says: str
) -> None:
    with SimServer(replace(GOOD, faults=faults)) as sim:
        code, document = doctor(sim, str(run_file(tmp_path)))
    assert code == 1 and not document["healthy"]
    [check] = [c for c in document["checks"] if c["check"] == failing]
    assert check["ok"] is False and says in check["detail"], check


def test_a_server_of_another_model_fails_the_model_check(tmp_path: Path) -> None:
    with SimServer(replace(GOOD, model_path="other/model")) as sim:
        code, document = doctor(sim, str(run_file(tmp_path)))
    assert code == 1 and verdicts(document)["model"] is False


def test_without_a_run_file_the_generic_checks_run(tmp_path: Path) -> None:
    with SimServer(GOOD) as sim:
        code, document = doctor(sim)
        text = eaglegen("doctor", "--server", sim.url)
    assert code == 0 and verdicts(document)["model"] is None  # nothing to compare with
    assert "special tokens" not in verdicts(document)
    [contract] = [c for c in document["checks"] if c["check"] == "response contract"]
    assert contract["ok"] is None and "vocabulary was not checked" in contract["detail"]
    assert text.returncode == 0 and "ok   completion count" in text.stdout


def test_a_model_that_thinks_for_thousands_of_tokens_gets_its_think_end_checked(
    tmp_path: Path,
) -> None:
    # A reasoning model thinks long even about 17 + 25: the probe's default answer length
    # must reach the think-end token, or the check can only say "?" (1,024 did not).
    thinker = replace(GOOD, mean_output_tokens=3000, output_length_sigma=0.05)
    with SimServer(thinker) as sim:
        code, document = doctor(sim, str(run_file(tmp_path)))
    assert code == 0, document
    [special] = [c for c in document["checks"] if c["check"] == "special tokens"]
    assert special["ok"] is True, special
    [generate] = [c for c in document["checks"] if c["check"] == "generate"]
    assert int(generate["detail"].split(" returned ")[1].split()[0]) > 1024


def test_the_probe_fits_a_short_context(tmp_path: Path) -> None:
    # SGLang refuses a prompt plus max_new_tokens that reaches its context length: the
    # probe asks for no more than the context leaves.
    with SimServer(replace(GOOD, context_length=2048)) as sim:
        code, document = doctor(sim, str(run_file(tmp_path)))
    assert code == 0 and verdicts(document)["generate"] is True, document


def test_an_unreachable_server_is_one_failed_line(tmp_path: Path) -> None:
    done = eaglegen("doctor", "--server", "http://127.0.0.1:9")
    assert done.returncode == 1
    assert "FAIL reachable" in done.stdout and "Traceback" not in done.stderr


# --- a hostile server: every answer bounded ------------------------------------------------

MIB = 1 << 20
DRIP = Answer(stream=itertools.repeat(b" "), pause_s=0.2)  # a byte every 0.2 s, forever


def hostile_get(path: str) -> Answer | None:
    """Too much on the model info and metrics, a drip on the server info."""
    if path == "/get_model_info":
        return Answer(stream=itertools.repeat(b"[" * MIB, 64))
    if path == "/metrics":
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 400000000\r\n\r\n"
        return Answer(stream=itertools.chain([head], itertools.repeat(b"#" * MIB, 16)), raw=True)
    if path == "/get_server_info":
        return DRIP
    return None


@pytest.mark.timeout(60)  # a hang detector: the reads below end within 1 s each
def test_each_answer_is_capped_and_has_a_deadline() -> None:
    behaviour = Behaviour(answer=lambda request: DRIP, get=hostile_get)
    with hostile_server(behaviour) as url:
        report = examine(url, Probe([1, 2, 3], max_new_tokens=16), 1.0, probe_timeout_s=1.0)
    details = {c.name: (c.ok, c.detail) for c in report.checks}
    assert details == {
        "reachable": (True, f"{url} answers /health"),
        "model": (False, "/get_model_info: answer over 1 MiB: the model is unknown"),
        "server info": (None, "unavailable: /get_server_info: no full answer within 1 s"),
        "generate": (
            False, "/generate with input_ids failed: /generate: no full answer within 1 s"
        ),
        "metrics": (
            False,
            "/metrics: answer of 400000000 bytes declared, over 4 MiB: a worker could not "
            "read it to set its limit",
        ),
    }  # fmt: skip


def test_a_server_dripping_its_health_answer_fails_the_doctor_in_one_line() -> None:
    # Without a total deadline, a byte every 0.2 s kept `doctor` waiting forever.
    with hostile_server(Behaviour(get=lambda path: DRIP if path == "/health" else None)) as url:
        done = eaglegen("doctor", "--server", url, "--timeout", "1", timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        f"FAIL reachable: {url}: /health: no full answer within 1 s: is it up?"
    ]
    assert "Traceback" not in done.stderr
