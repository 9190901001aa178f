"""The arithmetic of `eaglegen plan`: how many requests of a run fit a server, and when the
run is done. Pure: numbers in, numbers out (the command does the I/O).

How many fit. A request with a prompt of P tokens that will generate C holds P + g KV slots
after g decode steps. SGLang's admission (schedule_policy.PrefillAdder) also charges each
running request ``min(M - g, clip) * new_token_ratio`` slots, M its max_new_tokens, and admits
a waiting one only if its prompt plus ``min(M, clip)`` fits in what is left. The requests of
a busy batch are at every stage of their lives, each stage as often as the time spent in it
(Little's law), so the mean a running request takes is its slot-steps over its steps:

    footprint(ratio) = E[P*C + C**2/2 + ratio * integral_0^C min(M - g, clip) dg] / E[C]

Long answers weigh more than their number (they stay longest): at the same mean, a wider
spread of C fits fewer requests. The pool runs ``(kv - newcomer) / footprint`` requests,
``newcomer = E[P + min(M, clip)]``, at most ``max_running_requests``. The ratio starts at
``init`` (0.7), is back there after the server idles, and decays step by step to its
``floor`` (0.098) while nothing is retracted: the floor is the steady state, so the
recommendation is the fit at the floor. With no reserve at all (``kv_only``) the pool is
full; past it decode runs out of KV and SGLang retracts (wasted work). Prefix sharing in the
radix cache is left out: a shared system prompt only makes room.

Which request. A run's datasets run side by side, and the feeder publishes each in
proportion to its work (worker.shares), so the mix in the batch is that of the jobs left
(each dataset's remaining jobs, within its budget). A dataset's lengths come from its done
generations, or before the first from a prior: its pending jobs' prompts, each answer
running to max_new_tokens (the worst case, so the prior errs towards fewer).

When. Remaining completion tokens per dataset: its jobs left at its mean completion, at most
what its budget allows (a `total` budget pays for prompts too, in the dataset's share).
Over the throughput: ``--tok-s``, else the run's measured rate over the longest status
window (eaglegen.report.progress), else recommended concurrency times a per-request decode
rate when one is given, else unknown. Datasets share the servers and the feeder keeps them
level, so every unfinished dataset finishes with the run; ``alone_s`` is its own share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from eaglegen.report.progress import eta_at, run_progress
from models.plan import DatasetLengths
from models.snapshot import DatasetStatus

# SGLang's defaults (srt/environ.py: SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION); the scheduler
# scales init by --schedule-conservativeness. eaglegen.sim.scheduler holds the same.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class ServerFacts:
    """What bounds one server's batch, and where each figure came from."""

    name: str
    kv_tokens: int
    max_running_requests: int | None  # None: not reported, no cap applied
    init_ratio: float = INIT_NEW_TOKEN_RATIO
    floor_ratio: float = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
    clip: int = CLIP_MAX_NEW_TOKENS
    running_now: int | None = None
    queued_now: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


def server_facts(
    name: str,
    info: Mapping[str, Any] | None,
    metrics: Mapping[str, float] | None,
    *,
    kv_tokens: int | None = None,
    max_running_requests: int | None = None,
) -> ServerFacts:
    """A server's facts from its /get_server_info and /metrics (either may be None), the
    flags winning; ValueError when nothing says how large its KV pool is."""
    info, metrics = info or {}, metrics or {}
    kv, kv_from = _first(
        ("flag", kv_tokens),
        ("/get_server_info", info.get("max_total_num_tokens")),
        ("/metrics", metrics.get("sglang:max_total_num_tokens")),
    )
    if kv is None:
        raise ValueError(
            f"server {name} reports no max_total_num_tokens (KV pool): pass --kv-tokens N"
        )
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    cap, cap_from = _first(
        ("flag", max_running_requests),
        ("/get_server_info", info.get("max_running_requests")),
        ("/get_server_info", state.get("max_running_requests")),
    )
    init, floor, clip, ratio_from = _admission(info)
    return ServerFacts(
        name=name,
        kv_tokens=kv,
        max_running_requests=cap,
        init_ratio=init,
        floor_ratio=floor,
        clip=clip,
        running_now=_count(metrics.get("sglang:num_running_reqs")),
        queued_now=_count(metrics.get("sglang:num_queue_reqs")),
        sources={"kv_tokens": kv_from, "max_running_requests": cap_from, "ratio": ratio_from},
    )


def _first(*candidates: tuple[str, Any]) -> tuple[int | None, str]:
    """The first candidate that is a positive whole number, with its source."""
    for source, value in candidates:
        number = _count(value)
        if number is not None and number > 0:
            return number, source
    return None, "unknown"


def _count(value: Any) -> int | None:
    """A JSON or Prometheus number as an int (None if it is none)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def _admission(info: Mapping[str, Any]) -> tuple[float, float, int, str]:
    """init ratio, floor, clip and their source. The simulator says its own (they are
    knobs there); SGLang's are its defaults, init scaled by schedule_conservativeness."""
    sim = info.get("simulator")
    sim = sim if isinstance(sim, dict) else {}
    init = _ratio(sim.get("init_new_token_ratio"))
    if init is not None:
        floor = _ratio(sim.get("min_new_token_ratio")) or init
        clip = _count(sim.get("clip_max_new_tokens")) or CLIP_MAX_NEW_TOKENS
        return init, floor, clip, "simulator"
    scale = _ratio(info.get("schedule_conservativeness"), upper=math.inf) or 1.0
    init = min(INIT_NEW_TOKEN_RATIO * scale, 1.0)
    return init, min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0), CLIP_MAX_NEW_TOKENS, "sglang"


def _ratio(value: Any, upper: float = 1.0) -> float | None:
    """A number in (0, upper], else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0.0 < value <= upper else None


# --- the shape of a request ------------------------------------------------------------


@dataclass(frozen=True)
class RequestShape:
    """The mean request of a dataset (or a mix) as a KV pool sees it."""

    prompt: float  # mean prompt tokens
    completion: float  # mean completion tokens
    steps: float  # mean steps in the batch (its decode steps, at least one)
    held: float  # slots held, per step in the batch: E[P*C + C**2/2] / E[C]
    promised: float  # admission's charge per step before the ratio: E[integral] / E[C]
    newcomer: float  # slots a waiting request needs to be admitted: E[P + min(M, clip)]
    source: str  # "generations", "prior" or "generations and prior"

    def footprint(self, ratio: float) -> float:
        """Mean slots a running request takes, its admission reserve at ``ratio`` included."""
        return self.held + ratio * self.promised


def charge(completion: int, max_new: int, clip: int) -> float:
    """integral_0^C min(M - g, clip) dg: what admission charges a request over its life,
    per unit of new_token_ratio (C is at most M: the server stops there)."""
    c = min(completion, max_new)
    flat = max(max_new - clip, 0)  # before this, the charge is clipped
    if c <= flat:
        return float(clip * c)
    return clip * flat + max_new * (c - flat) - (c * c - flat * flat) / 2


def measured_shape(
    lengths: DatasetLengths, status: DatasetStatus, clip: int
) -> RequestShape | None:
    """The shape of a dataset's done generations: the means from its counters (exact), the
    slot-steps from the sample; None before any is done."""
    done = status.states.get("done", 0)
    if not lengths.done or done <= 0:
        return None
    steps = held = promised = 0.0
    for prompt, completion in lengths.done:
        s = max(completion, 1)  # a request with no output still holds its prompt for a step
        steps += s
        held += prompt * s + completion * completion / 2
        promised += charge(completion, lengths.max_new_tokens, clip) if completion else 0.0
    prompt_mean = status.done_prompt_tokens / done
    return RequestShape(
        prompt=prompt_mean,
        completion=status.done_completion_tokens / done,
        steps=steps / len(lengths.done),
        held=held / steps,
        promised=promised / steps,
        newcomer=prompt_mean + min(lengths.max_new_tokens, clip),
        source="generations",
    )


def prior_shape(prompt: float, max_new: int, clip: int) -> RequestShape:
    """A dataset before its first generation: its prompts, every answer max_new long."""
    steps = max(max_new, 1)
    return RequestShape(
        prompt=prompt,
        completion=float(max_new),
        steps=float(steps),
        held=(prompt * steps + max_new * max_new / 2) / steps,
        promised=charge(max_new, max_new, clip) / steps,
        newcomer=prompt + min(max_new, clip),
        source="prior",
    )


def dataset_shape(lengths: DatasetLengths, status: DatasetStatus, clip: int) -> RequestShape | None:
    """Measured when there are generations, else the prior; None with neither (no done job
    and none left to run)."""
    measured = measured_shape(lengths, status, clip)
    if measured is not None:
        return measured
    if lengths.pending_prompt is None:
        return None
    return prior_shape(lengths.pending_prompt, lengths.max_new_tokens, clip)


def mix(parts: Sequence[tuple[RequestShape, float]]) -> RequestShape | None:
    """The mean request of datasets run side by side, each weighted by its jobs; the
    per-step figures weigh each by its steps too (a long request is in more steps)."""
    parts = [(shape, w) for shape, w in parts if w > 0]
    jobs = sum(w for _, w in parts)
    if jobs <= 0:
        return None
    steps = sum(w * shape.steps for shape, w in parts)
    sources = {shape.source for shape, _ in parts}
    return RequestShape(
        prompt=sum(w * s.prompt for s, w in parts) / jobs,
        completion=sum(w * s.completion for s, w in parts) / jobs,
        steps=steps / jobs,
        held=sum(w * s.steps * s.held for s, w in parts) / steps,
        promised=sum(w * s.steps * s.promised for s, w in parts) / steps,
        newcomer=sum(w * s.newcomer for s, w in parts) / jobs,
        source=" and ".join(sorted(sources)),
    )


# --- concurrency -------------------------------------------------------------------------


@dataclass(frozen=True)
class Concurrency:
    """How many requests of a shape one server runs side by side."""

    kv_only: int  # the pool full with nothing reserved: past it, retraction
    at_floor: int  # admission at the ratio's floor: the steady state
    at_init: int  # admission at the ratio's start: after an idle spell or a retraction
    recommended: int
    limited_by: str  # "kv" or "max_running_requests"


def fits(kv_tokens: int, shape: RequestShape, ratio: float) -> int:
    """Requests of ``shape`` the pool runs with room left to admit the next one."""
    return max(0, math.floor((kv_tokens - shape.newcomer) / shape.footprint(ratio)))


def concurrency(server: ServerFacts, shape: RequestShape) -> Concurrency:
    """The fits at no reserve, at the floor and at init; the recommendation (the floor's,
    at most max_running_requests, at least one)."""
    floor = fits(server.kv_tokens, shape, server.floor_ratio)
    cap = server.max_running_requests
    return Concurrency(
        kv_only=max(0, math.floor(server.kv_tokens / shape.held)),
        at_floor=floor,
        at_init=fits(server.kv_tokens, shape, server.init_ratio),
        recommended=max(1, floor if cap is None else min(floor, cap)),
        limited_by="max_running_requests" if cap is not None and cap < floor else "kv",
    )


# --- throughput and ETA ------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """Completion tokens a second the ETA is computed at, and where that came from."""

    tok_s: float | None  # None: unknown
    source: str


def throughput(
    datasets: Sequence[DatasetStatus],
    concurrency_total: int,
    *,
    tok_s: float | None = None,
    decode_tok_s_per_request: float | None = None,
) -> Throughput:
    """``tok_s`` when given, else the run's rate over status's longest window, else
    concurrency times the per-request decode rate, else unknown."""
    if tok_s is not None:
        return Throughput(tok_s, "--tok-s")
    rates = run_progress(datasets).rates if datasets else ()
    if rates and rates[-1].completion_tok_s > 0:
        return Throughput(rates[-1].completion_tok_s, f"measured over the last {rates[-1].label}")
    if decode_tok_s_per_request is not None:
        estimate = concurrency_total * decode_tok_s_per_request
        return Throughput(
            estimate,
            f"estimated: {concurrency_total} in flight x {decode_tok_s_per_request:g} tok/s each",
        )
    return Throughput(None, "unknown")


@dataclass(frozen=True)
class Forecast:
    """What one dataset still needs and when it is done."""

    dataset: str
    max_new_tokens: int
    shape: RequestShape | None
    remaining_jobs: float  # jobs left that its budget lets run (an estimate with a budget)
    remaining_tokens: float  # completion tokens left
    budget_left: int | None  # None: unlimited
    finished: str | None
    alone_s: float | None = None  # its remaining tokens over the whole throughput
    eta_s: float | None = None  # when it is done, run side by side with the others


def forecast(lengths: DatasetLengths, status: DatasetStatus, clip: int) -> Forecast:
    """A dataset's jobs and tokens left, within its budget (no time yet)."""
    shape = dataset_shape(lengths, status, clip)
    jobs = status.states.get("queued", 0) + status.states.get("running", 0)
    left = None if status.budget_tokens is None else status.budget_tokens - status.used_tokens
    finished = "budget reached" if left is not None and left <= 0 else None
    if finished is None and jobs == 0:
        finished = "all jobs done"
    tokens = (
        0.0 if finished or shape is None else _capped(jobs * shape.completion, left, status, shape)
    )
    per_job = shape.completion if shape is not None and shape.completion > 0 else None
    return Forecast(
        dataset=lengths.dataset,
        max_new_tokens=lengths.max_new_tokens,
        shape=shape,
        remaining_jobs=0.0 if finished else (min(jobs, tokens / per_job) if per_job else jobs),
        remaining_tokens=tokens,
        budget_left=left,
        finished=finished,
    )


def _capped(needed: float, left: int | None, status: DatasetStatus, shape: RequestShape) -> float:
    """``needed`` at most what the budget allows: a `total` budget pays for the prompts too,
    so only the completions' share of it is left for them."""
    if left is None:
        return needed
    if status.budget_basis == "total":
        per_job = shape.prompt + shape.completion
        return min(needed, left * (shape.completion / per_job if per_job else 1.0))
    return min(needed, float(left))


@dataclass(frozen=True)
class ServerPlan:
    """One server's facts and how many of the run's requests it should have in flight."""

    facts: ServerFacts
    shape: RequestShape
    concurrency: Concurrency


@dataclass(frozen=True)
class RunPlan:
    """Everything `eaglegen plan` reports."""

    run: str
    servers: list[ServerPlan]
    datasets: list[Forecast]
    throughput: Throughput
    remaining_tokens: float
    eta_s: float | None  # None: unknown; 0: finished
    finished: str | None

    @property
    def recommended(self) -> int:
        """Requests in flight over every server."""
        return sum(s.concurrency.recommended for s in self.servers)


def plan_run(
    run: str,
    servers: Sequence[ServerFacts],
    lengths: Sequence[DatasetLengths],
    statuses: Sequence[DatasetStatus],
    *,
    tok_s: float | None = None,
    decode_tok_s_per_request: float | None = None,
) -> RunPlan:
    """The plan of ``run``: each dataset's work, each server's concurrency, the ETA.
    ValueError when no dataset has a length to plan with."""
    by_name = {s.dataset: s for s in statuses}
    paired = [(ln, by_name[ln.dataset]) for ln in lengths if ln.dataset in by_name]
    clip = servers[0].clip if servers else CLIP_MAX_NEW_TOKENS
    forecasts = [forecast(ln, st, clip) for ln, st in paired]
    per_server = [_server_plan(facts, paired, forecasts) for facts in servers]
    speed = throughput(
        [st for _, st in paired],
        sum(s.concurrency.recommended for s in per_server),
        tok_s=tok_s,
        decode_tok_s_per_request=decode_tok_s_per_request,
    )
    return _timed(run, per_server, forecasts, speed)


def _server_plan(
    facts: ServerFacts,
    paired: Sequence[tuple[DatasetLengths, DatasetStatus]],
    forecasts: Sequence[Forecast],
) -> ServerPlan:
    """The run's mean request as this server's admission prices it, and its concurrency."""
    shapes = [dataset_shape(ln, st, facts.clip) for ln, st in paired]
    weights = _weights(forecasts, [st for _, st in paired])
    shape = mix([(s, w) for s, w in zip(shapes, weights, strict=True) if s is not None])
    if shape is None:
        raise ValueError("no dataset of the run has a job to plan with: enqueue some first")
    return ServerPlan(facts, shape, concurrency(facts, shape))


def _weights(forecasts: Sequence[Forecast], statuses: Sequence[DatasetStatus]) -> list[float]:
    """Each dataset's share of the batch: the jobs it has left; once none has any (the run
    is finished), the jobs it did, so that the plan still says what fitted."""
    left = [f.remaining_jobs for f in forecasts]
    if sum(left) > 0:
        return left
    return [float(st.states.get("done", 0)) for st in statuses]


def _timed(
    run: str, servers: list[ServerPlan], forecasts: list[Forecast], speed: Throughput
) -> RunPlan:
    """The forecasts with their times at ``speed``, and the run's."""
    total = sum(f.remaining_tokens for f in forecasts)
    finished = "every dataset finished" if all(f.finished for f in forecasts) else None
    eta = 0.0 if finished else (None if not speed.tok_s else total / speed.tok_s)
    timed = [_with_time(f, speed.tok_s, eta) for f in forecasts]
    return RunPlan(run, servers, timed, speed, total, eta, finished)


def _with_time(f: Forecast, tok_s: float | None, run_eta: float | None) -> Forecast:
    """A finished dataset takes no time; the others finish with the run (the feeder keeps
    them level), each needing ``alone_s`` of the servers' time."""
    if f.finished:
        return replace(f, alone_s=0.0, eta_s=0.0)
    return replace(f, alone_s=f.remaining_tokens / tok_s if tok_s else None, eta_s=run_eta)


# --- the JSON document -------------------------------------------------------------------


def plan_document(plan: RunPlan, now: datetime) -> dict[str, Any]:
    """The ``eaglegen plan --json`` document."""
    return {
        "run": plan.run,
        "now": now.isoformat(timespec="seconds"),
        "recommended_concurrency": plan.recommended,
        "servers": [_server_doc(s) for s in plan.servers],
        "throughput": {
            "completion_tok_s": _round(plan.throughput.tok_s, 3),
            "source": plan.throughput.source,
        },
        "datasets": [_forecast_doc(f, now) for f in plan.datasets],
        "remaining_completion_tokens": round(plan.remaining_tokens),
        "eta_s": _round(plan.eta_s, 1),
        "eta_at": None if plan.finished else eta_at(now, plan.eta_s),
        "finished": plan.finished,
    }


def shape_doc(shape: RequestShape | None, floor_ratio: float | None = None) -> dict[str, Any]:
    """A request shape's JSON form (with its footprint at ``floor_ratio`` when given)."""
    if shape is None:
        return {"source": None}
    doc: dict[str, Any] = {
        "source": shape.source,
        "prompt_tokens": round(shape.prompt, 1),
        "completion_tokens": round(shape.completion, 1),
        "kv_tokens_held": round(shape.held, 1),
        "reserve_per_unit_ratio": round(shape.promised, 1),
        "to_admit": round(shape.newcomer, 1),
    }
    if floor_ratio is not None:
        doc["kv_tokens_at_floor"] = round(shape.footprint(floor_ratio), 1)
    return doc


def _server_doc(server: ServerPlan) -> dict[str, Any]:
    facts, fit = server.facts, server.concurrency
    return {
        "name": facts.name,
        "max_total_num_tokens": facts.kv_tokens,
        "max_running_requests": facts.max_running_requests,
        "new_token_ratio": {"init": facts.init_ratio, "floor": facts.floor_ratio},
        "clip_max_new_tokens": facts.clip,
        "sources": dict(facts.sources),
        "now": {"running": facts.running_now, "queued": facts.queued_now},
        "request": shape_doc(server.shape, facts.floor_ratio),
        "fits": {"kv_only": fit.kv_only, "ratio_floor": fit.at_floor, "ratio_init": fit.at_init},
        "recommended": fit.recommended,
        "limited_by": fit.limited_by,
    }


def _forecast_doc(f: Forecast, now: datetime) -> dict[str, Any]:
    return {
        "dataset": f.dataset,
        "max_new_tokens": f.max_new_tokens,
        "request": shape_doc(f.shape),
        "remaining_jobs": round(f.remaining_jobs, 1),
        "remaining_completion_tokens": round(f.remaining_tokens),
        "budget_left": f.budget_left,
        "alone_s": _round(f.alone_s, 1),
        "eta_s": _round(f.eta_s, 1),
        "eta_at": None if f.finished else eta_at(now, f.eta_s),
        "finished": f.finished,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
