"""The SGLang client: per server, one ``httpx.Client`` of one connection per worker thread.

Not one pool shared by all threads: httpcore's pool can close a connection it has just
handed to another thread's request (encode/httpcore#1110); the request then waits for an
answer on a closed socket until its read timeout, which for a generation is an hour. Seen
here as a job `running` for good at 600 requests in flight (BENCHMARKS.md, "Hung
requests"). A pool used by one thread only has no such race.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from typing import Any

import httpx

from core import sampling
from core.settings import ServerSpec
from worker.retry import AttemptError, classify_status

KEEPALIVE_EXPIRY_S = 2.0


class SGLangClient:
    """Calls one server's raw ``/generate`` with token ids."""

    def __init__(self, server: ServerSpec, *, timeout_s: float) -> None:
        self.server = server
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        # One context for every thread's client (each would load the CA bundle otherwise).
        self._ssl = ssl.create_default_context()
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()
        # Probes must not queue behind generations for a connection: a worker busy on
        # every thread would time its probe out and call a healthy server down.
        self._probe = httpx.Client(
            base_url=server.url, timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=2)
        )

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], rid: str) -> Any:
        """POST /generate; raise AttemptError (retryable or not) on any failure."""
        refused = sampling.unsendable(sampling_params)
        if refused:
            raise AttemptError(f"sampling params SGLang must not get: {refused}", retryable=False)
        payload = {"input_ids": list(input_ids), "sampling_params": sampling_params, "rid": rid}
        try:
            response = self._thread_client().post("/generate", json=payload)
        except httpx.TransportError as exc:
            raise AttemptError(
                f"{self.server.name}: {type(exc).__name__}: {exc}",
                retryable=True,
                transport=True,
            ) from exc
        if response.status_code != 200:
            raise AttemptError(
                f"{self.server.name}: HTTP {response.status_code}: {_error_message(response)}",
                retryable=classify_status(response.status_code),
            )
        try:
            return response.json()
        except ValueError as exc:
            raise AttemptError(f"{self.server.name}: malformed JSON body", retryable=True) from exc

    def get(self, path: str, timeout_s: float) -> httpx.Response:
        """A GET on the server (health probes, metrics), on its own small pool."""
        return self._probe.get(path, timeout=timeout_s)

    def _thread_client(self) -> httpx.Client:
        """This thread's client (built on its first request): one connection, kept alive."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(
                base_url=self.server.url,
                timeout=self._timeout,
                verify=self._ssl,
                limits=httpx.Limits(
                    max_connections=1,
                    max_keepalive_connections=1,
                    # Below the server's keep-alive (uvicorn, so SGLang: 5 s), so that a
                    # kept connection is never reused just as the server closes it.
                    keepalive_expiry=KEEPALIVE_EXPIRY_S,
                ),
            )
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        """Close every thread's connection and the probes'."""
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self._probe.close()


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]
