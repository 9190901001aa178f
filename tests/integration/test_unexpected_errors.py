"""An error no check foresaw ends its attempt at once, the cause kept on the job: never a job
left `running` until its lease lapses with "lease expired" as its only trace."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig
from models.repository import Repository
from models.states import JobState
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker


class Hostile(BaseHTTPRequestHandler):
    """A /generate that answers with a well-formed body holding an id beyond int32."""

    def do_GET(self) -> None:
        if self.path == "/get_model_info":
            self._send({"model_path": SimConfig().model_path, "tokenizer_path": "tokenizer"})
        else:
            self._send({})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        output = [5, 6, 2**40, 4]
        self._send(
            {
                "text": "",
                "output_ids": output,
                "meta_info": {
                    "id": request["rid"],
                    "finish_reason": {"type": "stop", "matched": 4},
                    "prompt_tokens": len(request["input_ids"]),
                    "completion_tokens": len(output),
                    "cached_tokens": 0,
                    "e2e_latency": 0.01,
                },
            }
        )

    def _send(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        """Quiet: http.server would print a line per request to stderr."""


@contextmanager
def hostile_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_id_postgres_cannot_store_fails_the_job_with_its_cause_at_once(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    with hostile_server() as url:
        hostile = settings.model_copy(
            update={
                "servers": [ServerSpec(name="hostile", url=url)],
                "max_attempts": 2,
                "retry_base_s": 0.1,
                "lease_seconds": 600,  # what the job would have waited, per attempt, before
            }
        )
        started = time.monotonic()
        with worker(hostile):
            enqueue_file(hostile, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
            states = wait_settled(repo, timeout_s=60)
        elapsed = time.monotonic() - started
    assert states[JobState.FAILED.value] == 1
    [job_id] = repo.job_ids()
    job = repo.job(job_id)
    assert job is not None and job["attempts"] == 2
    assert "hostile: " in job["last_error"] and "Error" in job["last_error"]
    assert "integer" in job["last_error"]  # the driver's reason: beyond int32
    assert repo.generation(job_id) is None
    assert elapsed < 60
