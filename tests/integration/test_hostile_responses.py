"""Nothing a server sends is stored unchecked: a body that breaks a check fails the attempt
with the reason, and no generation is stored (issue: trust nothing a server sends)."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from core.settings import ServerSpec, Settings
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimConfig
from models.repository import Repository
from models.states import JobState
from producer.template import Templater
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.hostile import Answer, Behaviour, good, hostile_server
from tests.integration.test_pipeline import worker
from tests.workers import EACH_ENGINE

pytestmark = EACH_ENGINE

VOCAB = Templater(TOKENIZER_DIR).vocab_size()
LIMIT = 1 << 20  # max_response_bytes in these tests
MAX_NEW = 16


def endless(request: dict[str, Any]) -> Answer:
    """A body that never ends (500 MB and more), with no Content-Length to refuse it by."""
    return Answer(stream=itertools.repeat(b"[" * 65536))


def drip(request: dict[str, Any]) -> Answer:
    """A correct answer sent a byte every 50 ms: minutes for the body, each byte well
    within any read timeout."""
    return Answer(good(request).body, pause_s=0.05)


CASES: dict[str, tuple[Callable[[dict[str, Any]], Answer], str]] = {
    "negative id": (lambda r: good(r, [5, -7, 4]), "output id -7 is negative"),
    "id beyond the vocabulary": (
        lambda r: good(r, [5, VOCAB, 4]),
        f"output id {VOCAB} is beyond the tokenizer's {VOCAB} ids",
    ),
    "JSON booleans": (lambda r: good(r, [5, True, 4]), "not a list of integers"),
    "more ids than max_new_tokens": (
        lambda r: good(r, [5] * MAX_NEW + [4]),
        f"completion_tokens={MAX_NEW + 1} > max_new_tokens={MAX_NEW}",
    ),
    "another request's answer": (
        lambda r: good(r, id=str(int(r["rid"]) + 1)),
        "response for request",
    ),
    "a body without end": (endless, f"over max_response_bytes={LIMIT}"),
    "a dripping server": (drip, "a stalled or dripping server"),
}


@pytest.fixture
def hostile(settings: Settings) -> Iterator[tuple[Settings, Behaviour]]:
    behaviour = Behaviour()
    with hostile_server(behaviour) as url:
        yield (
            settings.model_copy(
                update={
                    "servers": [ServerSpec(name="hostile", url=url)],
                    "max_attempts": 2,
                    "retry_base_s": 0.1,
                    "max_response_bytes": LIMIT,
                    "stall_timeout_s": 2.0,
                    "request_timeout_s": 600.0,
                }
            ),
            behaviour,
        )


@pytest.mark.parametrize("case", list(CASES))
def test_a_response_that_breaks_a_check_is_never_stored(
    case: str, hostile: tuple[Settings, Behaviour], repo: Repository, tmp_path: Path
) -> None:
    settings, behaviour = hostile
    answer, reason = CASES[case]
    behaviour.answer = answer
    started = time.monotonic()
    with worker(settings):
        enqueue_file(
            settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)), max_new_tokens=MAX_NEW
        )
        states = wait_settled(repo, timeout_s=60)
    elapsed = time.monotonic() - started
    [job_id] = repo.job_ids()
    job = repo.job(job_id)
    assert job is not None
    assert states[JobState.FAILED.value] == 1, job
    assert reason in job["last_error"]
    assert repo.generation(job_id) is None
    # Refused when it was seen, not after a request timeout (600 s here).
    assert elapsed < 30
    if case == "a body without end":
        # Read no further than the limit (plus what socket buffers took in meanwhile).
        assert behaviour.bytes_sent < behaviour.requests * 16 * LIMIT


def test_a_good_answer_from_the_same_server_is_stored(
    hostile: tuple[Settings, Behaviour], repo: Repository, tmp_path: Path
) -> None:
    # The control: the hostile server's own good answer passes every check.
    settings, _ = hostile
    with worker(settings):
        enqueue_file(
            settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)), max_new_tokens=MAX_NEW
        )
        states = wait_settled(repo, timeout_s=60)
    assert states[JobState.DONE.value] == 1
    [job_id] = repo.job_ids()
    generation = repo.generation(job_id)
    assert generation is not None and generation["output_ids"] == [5, 6, 4]


@pytest.mark.parametrize(("output", "done"), [([5, 6, 7], False), ([5, 6, 4], True)])
def test_a_stop_on_a_token_the_run_does_not_stop_at_is_retried_then_failed(
    output: list[int],
    done: bool,
    hostile: tuple[Settings, Behaviour],
    repo: Repository,
    tmp_path: Path,
) -> None:
    """A server that reports a stop on 7, the last id but not the run's stop id (4, the
    bundled tokenizer's eos, sent as stop_token_ids): retried, then failed with the reason."""
    settings, behaviour = hostile
    finish = {"type": "stop", "matched": output[-1]}
    behaviour.answer = lambda r: good(r, output, finish_reason=finish)
    with worker(settings):
        enqueue_file(
            settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)), max_new_tokens=MAX_NEW
        )
        states = wait_settled(repo, timeout_s=60)
    [job_id] = repo.job_ids()
    job = repo.job(job_id)
    assert job is not None
    if done:
        assert states[JobState.DONE.value] == 1, job
        return
    assert states[JobState.FAILED.value] == 1, job
    assert job["attempts"] == settings.max_attempts == behaviour.requests
    assert "finish matched token 7, which is not one of the run's stop ids [4]" in job["last_error"]
    assert repo.generation(job_id) is None


# A 400 body with terminal controls: an OSC that retitles the terminal (ESC ] ... BEL) and a
# CSI that clears it. Sent raw (not JSON), so the worker keeps the body's text as it came.
CONTROLS = b"\x1b]0;pwned\x07 denied\x1b[2J"
ESCAPED = "\\x1b]0;pwned\\x07 denied\\x1b[2J"


class _Refusing(BaseHTTPRequestHandler):
    """A server of the simulator's model that answers every /generate with 400 and
    CONTROLS."""

    def do_GET(self) -> None:
        info = {"model_path": SimConfig().model_path, "tokenizer_path": "tokenizer"}
        self._send(200, json.dumps(info if self.path == "/get_model_info" else {}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(400, CONTROLS)

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        """Quiet."""


@contextmanager
def refusing_server() -> Iterator[str]:
    """Serve `_Refusing` on a free loopback port; its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_control_characters_of_an_error_body_are_stored_and_logged_escaped(
    settings: Settings, repo: Repository, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # On the worker's loggers: the in-thread Celery worker sets the root logger to ERROR.
    caplog.set_level(logging.WARNING, logger="worker")
    with refusing_server() as url:
        refused = settings.model_copy(update={"servers": [ServerSpec(name="hostile", url=url)]})
        with worker(refused):
            enqueue_file(refused, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
            states = wait_settled(repo, timeout_s=60)
    assert states[JobState.FAILED.value] == 1  # a 400 is not retried
    [job_id] = repo.job_ids()
    job = repo.job(job_id)
    assert job is not None
    assert job["last_error"] == f"hostile: HTTP 400: {ESCAPED}"
    said = [r.getMessage() for r in caplog.records if f"job {job_id} failed" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(f"hostile: HTTP 400: {ESCAPED}"), said
    assert not [r.getMessage() for r in caplog.records if "\x1b" in r.getMessage()]


def test_a_reason_is_stored_escaped_whoever_gives_it(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # The database layer escapes what it stores, not only the worker what it passes.
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(2)))
    first, second = repo.job_ids()
    for job_id in (first, second):
        assert repo.claim(job_id, "w", 600).job is not None
    assert repo.fail(first, "w", CONTROLS.decode())
    assert repo.release(second, "w", CONTROLS.decode(), refund=True)
    for job_id in (first, second):
        job = repo.job(job_id)
        assert job is not None and job["last_error"] == ESCAPED
