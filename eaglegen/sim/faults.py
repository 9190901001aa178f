"""Fault injection for /generate: which fault a call gets, the bodies sent, and the tally kept."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from eaglegen.sim.config import FaultConfig
from eaglegen.sim.protocol import validation_error_body

# A 200 body cut mid-stream, as a proxy or a crashing server leaves it: never valid JSON.
MALFORMED_BODY = b'{"text": "Let me think about this", "output_ids": [3, 1042, 77, 1744'
_MESSAGES = {
    429: "Too many requests.",
    500: "Internal server error.",
    502: "Bad gateway.",
    503: "The request queue is full.",
    504: "Gateway timeout.",
}


@dataclass(frozen=True)
class Fault:
    """One injected fault: a dropped connection, a malformed 200, an error status, a stalled
    stream or a dripping body."""

    kind: Literal["drop", "malformed", "error", "stall", "drip"]
    status: int = 200


@dataclass(frozen=True)
class Decision:
    """What the active faults do to one /generate call, fixed when the call arrives."""

    fault: Fault | None
    delay_s: float
    leak_prompt_tokens: int
    strip_special_tokens: bool = False


def choose(faults: FaultConfig, u: float, *, stream: bool = False) -> Fault | None:
    """The fault for a call whose uniform draw is u in [0, 1); None means a normal answer."""
    # The rates tile [0, total): drop, malformed, each status in ascending order, then one
    # slice that stalls a streamed call or drips a non-streamed one.
    edge = faults.drop_rate
    if u < edge:
        return Fault("drop")
    edge += faults.malformed_rate
    if u < edge:
        return Fault("malformed")
    for status, rate in faults.error_rates:
        edge += rate
        if u < edge:
            return Fault("error", status)
    if stream and u < edge + faults.stall_rate:
        return Fault("stall")
    if not stream and u < edge + faults.drip_rate:
        return Fault("drip")
    return None


def error_body(status: int) -> dict[str, Any]:
    """The body SGLang (or the proxy in front of it) sends with this status."""
    if status == 400:
        return {"error": {"message": "The simulator injected a 400 fault (error_rates)."}}
    message = _MESSAGES.get(status) or _phrase(status)
    return validation_error_body(message, code=status, kind=str(status))


def _phrase(status: int) -> str:
    """The reason phrase of a status, or a generic one for unregistered codes."""
    try:
        return f"{HTTPStatus(status).phrase}."
    except ValueError:
        return f"HTTP error {status}."


@dataclass
class FaultStats:
    """How many faults of each kind were injected since the server started."""

    generate_requests: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    dropped: int = 0
    malformed: int = 0
    leaked: int = 0
    stripped: int = 0
    delayed: int = 0
    stalled: int = 0
    dripped: int = 0
    broken_tool_args: int = 0
    unhealthy_health_checks: int = 0

    def count(self, decision: Decision) -> None:
        """Tally the faults of one /generate call (leaks, stripped answers and broken tool calls
        are counted when sent)."""
        self.generate_requests += 1
        if decision.delay_s > 0:
            self.delayed += 1
        fault = decision.fault
        if fault is None:
            return
        if fault.kind == "error":
            self.errors[fault.status] += 1
        elif fault.kind == "drop":
            self.dropped += 1
        elif fault.kind == "malformed":
            self.malformed += 1
        elif fault.kind == "stall":
            self.stalled += 1
        else:
            self.dripped += 1

    def to_json(self) -> dict[str, Any]:
        """The body of GET /sim/stats."""
        return {
            "generate_requests": self.generate_requests,
            "injected": {
                "errors": {str(status): n for status, n in sorted(self.errors.items())},
                "dropped": self.dropped,
                "malformed": self.malformed,
                "leaked": self.leaked,
                "stripped": self.stripped,
                "delayed": self.delayed,
                "stalled": self.stalled,
                "dripped": self.dripped,
                "broken_tool_args": self.broken_tool_args,
                "unhealthy_health_checks": self.unhealthy_health_checks,
            },
        }


class FaultInjector:
    """The active faults, their seeded per-call draws and the tally of what was injected."""

    def __init__(self, faults: FaultConfig) -> None:
        """Start with these faults and an empty tally."""
        self.stats = FaultStats()
        self.config = faults
        self._rng = random.Random(faults.seed)

    def replace(self, faults: FaultConfig) -> None:
        """Switch to new faults; the draws restart from their seed, the tally carries on."""
        self.config = faults
        self._rng = random.Random(faults.seed)

    def decide(self, *, stream: bool = False) -> Decision:
        """Draw exactly once per /generate call, so fault counts depend only on the call count."""
        faults = self.config
        decision = Decision(
            fault=choose(faults, self._rng.random(), stream=stream),
            delay_s=faults.added_latency_ms / 1000.0,
            leak_prompt_tokens=faults.leak_prompt_tokens,
            strip_special_tokens=faults.strip_special_tokens,
        )
        self.stats.count(decision)
        return decision

    def health_ok(self) -> bool:
        """False while the faults mark the server unhealthy (counted per refused check)."""
        if self.config.unhealthy:
            self.stats.unhealthy_health_checks += 1
            return False
        return True
