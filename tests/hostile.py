"""A real HTTP server that answers /generate as a test tells it to: well-formed, wrong,
huge or slow. Each answer is a function of the request (the parsed JSON body); a GET's, of
its path (`Behaviour.get`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from eaglegen.sim import SimConfig


@dataclass
class Answer:
    """What the server sends: a JSON body (bytes: sent as they are), or ``stream`` (chunks
    written until the client goes away, with no Content-Length), each chunk after
    ``pause_s``. ``raw``: the stream is the whole response, status line and headers too."""

    body: Any = None
    stream: Iterator[bytes] | None = None
    pause_s: float = 0.0
    raw: bool = False


def good(request: dict[str, Any], output: list[Any] | None = None, **meta: Any) -> Answer:
    """The answer SGLang would give, with ``output`` and any meta_info field replaced."""
    ids: list[Any] = [5, 6, 4] if output is None else output
    info = {
        "id": request["rid"],
        "finish_reason": {"type": "stop", "matched": ids[-1]},
        "prompt_tokens": len(request["input_ids"]),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": 0.01,
        **meta,
    }
    return Answer({"text": "", "output_ids": ids, "meta_info": info})


@dataclass
class Behaviour:
    """The current answer function and what was sent (read by tests)."""

    answer: Callable[[dict[str, Any]], Answer] = good
    # A GET's answer by path; without one (None, or None from it), a plain server's.
    get: Callable[[str], Answer | None] | None = None
    bytes_sent: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    client_gone: threading.Event = field(default_factory=threading.Event)  # a write failed


class _Handler(BaseHTTPRequestHandler):
    behaviour: Behaviour

    def do_GET(self) -> None:
        answer = None if self.behaviour.get is None else self.behaviour.get(self.path)
        if answer is not None:
            self._send(answer, "text/plain")
        elif self.path == "/get_model_info":
            self._json({"model_path": SimConfig().model_path, "tokenizer_path": "tokenizer"})
        else:
            self._json({})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.behaviour.lock:
            self.behaviour.requests += 1
        self._send(self.behaviour.answer(request), "application/json")

    def _send(self, answer: Answer, content_type: str) -> None:
        if answer.stream is None:
            self._json(answer.body, pause_s=answer.pause_s)
            return
        if answer.raw:
            self.close_connection = True
        else:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Connection", "close")
            self.end_headers()
        self._write_all(answer.stream, answer.pause_s)

    def _json(self, body: Any, pause_s: float = 0.0) -> None:
        text = isinstance(body, bytes)  # a /metrics body, say
        data = body if text else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        # Dripped a byte at a time when asked to pause between writes.
        pieces = [data[i : i + 1] for i in range(len(data))] if pause_s else [data]
        self._write_all(iter(pieces), pause_s)

    def _write_all(self, chunks: Iterator[bytes], pause_s: float) -> None:
        try:
            for chunk in chunks:
                if pause_s:
                    time.sleep(pause_s)
                self.wfile.write(chunk)
                self.wfile.flush()
                with self.behaviour.lock:
                    self.behaviour.bytes_sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client stopped reading: what it should do
            self.behaviour.client_gone.set()

    def log_message(self, *_: Any) -> None:
        """Quiet: http.server would print a line per request to stderr."""


@contextmanager
def hostile_server(behaviour: Behaviour) -> Iterator[str]:
    """Serve ``behaviour`` on a free loopback port; yields the base URL."""
    handler = type("Handler", (_Handler,), {"behaviour": behaviour})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
