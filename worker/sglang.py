"""The SGLang client: one ``httpx.Client`` per server per process, built after any fork."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from core import sampling
from core.settings import ServerSpec
from worker.retry import AttemptError, classify_status

KEEPALIVE_EXPIRY_S = 2.0


class SGLangClient:
    """Calls one server's raw ``/generate`` with token ids."""

    def __init__(self, server: ServerSpec, *, timeout_s: float, max_connections: int) -> None:
        self.server = server
        self._http = httpx.Client(
            base_url=server.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                # Below the server's keep-alive (uvicorn, so SGLang: 5 s), so that a pooled
                # connection is never reused just as the server closes it.
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )
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
            response = self._http.post("/generate", json=payload)
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

    def close(self) -> None:
        """Close pooled connections."""
        self._http.close()
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
