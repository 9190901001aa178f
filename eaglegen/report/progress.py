"""Rates and ETAs from a status snapshot. Pure: numbers in, numbers out.

A window's rate divides by the time the work in it spans (``window_span``): from the start
of its earliest generation to now, the whole window once work has filled it. Dividing a
run's first minute by the whole 10 minutes would make its rate ten times too low, and its
ETA ten times too long.

A dataset is finished when none of its jobs is queued or running, or when its budget is
spent (the rest are then skipped). Its ETA is the earlier of the two at its rate over the
longest window. The run's ETA divides the completion tokens every dataset still needs by
the run's whole rate: datasets share the servers, so one finishing speeds up the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from models.snapshot import DatasetStatus, ServerStatus, Window

if TYPE_CHECKING:
    from core.heartbeat import Heartbeat  # it imports Redis's client; only the type is used


@dataclass(frozen=True)
class Rate:
    """Throughput over one span: completion tokens a second, completions a minute."""

    label: str
    completion_tok_s: float
    completions_per_min: float
    prompt_tok_s: float
    span_s: float  # the seconds it is over

    def as_dict(self) -> dict[str, float]:
        """The JSON form."""
        return {
            "completion_tok_s": round(self.completion_tok_s, 3),
            "completions_per_min": round(self.completions_per_min, 3),
            "span_s": round(self.span_s, 1),
        }


@dataclass(frozen=True)
class Progress:
    """What is left of one dataset (or of a run) and when it should be done."""

    rates: tuple[Rate, ...]  # each window, shortest first, then the whole run when known
    remaining_jobs: int
    budget_left: int | None  # None: unlimited
    # Completion tokens still to generate, estimated; None when nothing says how long a
    # completion is.
    remaining_tokens: float | None
    eta_s: float | None  # None: unknown (no recent completion), 0: finished
    finished: str | None  # why it is finished, or None


# The least a windowed rate divides by: a run's first generations may end within an instant
# of their start as recorded (a server that leaves e2e_latency out reports 0).
MIN_SPAN_S = 1.0


def window_span(window: Window) -> float:
    """The seconds a window's rate divides by: the part of the window its work spans (from
    the start of its earliest generation to now), so less than the window in a run's first
    minutes or after a pause; the whole window when it holds no generation."""
    if window.covered_s is None:
        return float(window.seconds)
    return min(float(window.seconds), max(window.covered_s, MIN_SPAN_S))


def window_rate(window: Window) -> Rate:
    """The rate over one window, over the time its work spans."""
    span = window_span(window)
    return Rate(
        label=_label(window.seconds),
        completion_tok_s=window.completion_tokens / span,
        completions_per_min=window.completions * 60.0 / span,
        prompt_tok_s=window.prompt_tokens / span,
        span_s=span,
    )


def whole_run_rate(dataset: DatasetStatus) -> Rate | None:
    """The rate from its first recorded generation to its last; None before two."""
    first, last = dataset.first_done_at, dataset.last_done_at
    if first is None or last is None or last <= first:
        return None
    span = (last - first).total_seconds()
    return Rate(
        label="run",
        completion_tok_s=dataset.done_completion_tokens / span,
        completions_per_min=dataset.states["done"] * 60.0 / span,
        prompt_tok_s=dataset.done_prompt_tokens / span,
        span_s=span,
    )


def dataset_progress(dataset: DatasetStatus, fallback_mean: float | None = None) -> Progress:
    """Rates, what is left and the ETA of one dataset. ``fallback_mean``: the completion
    length to assume when the dataset has no done job yet (the run's mean)."""
    rates = tuple(window_rate(w) for w in dataset.windows)
    whole = whole_run_rate(dataset)
    # Turns of conversations under way count though their jobs do not exist yet.
    remaining = dataset.states["queued"] + dataset.states["running"] + dataset.turns_to_come
    left = None if dataset.budget_tokens is None else dataset.budget_tokens - dataset.used_tokens
    finished = _finished(remaining, left)
    steady = rates[-1] if rates else None
    return Progress(
        rates=(*rates, whole) if whole else rates,
        remaining_jobs=remaining,
        budget_left=left,
        remaining_tokens=0.0 if finished else _remaining_tokens(dataset, left, fallback_mean),
        eta_s=0.0 if finished else _eta(dataset, remaining, left, steady),
        finished=finished,
    )


def run_progress(datasets: Sequence[DatasetStatus]) -> Progress:
    """The same figures for a set of datasets run side by side (a run, or every run)."""
    mean = mean_completion(datasets)
    parts = [dataset_progress(d, mean) for d in datasets]
    windows = [_sum_windows([d.windows[i] for d in datasets]) for i in range(_n_windows(datasets))]
    rates = tuple(window_rate(w) for w in windows)
    remaining = sum(p.remaining_jobs for p in parts)
    tokens = [p.remaining_tokens for p in parts]
    needed = None if None in tokens else sum(t for t in tokens if t is not None)
    finished = "every dataset finished" if all(p.finished for p in parts) else None
    eta: float | None = 0.0 if finished else None
    if not finished and needed is not None and rates and rates[-1].completion_tok_s > 0:
        eta = needed / rates[-1].completion_tok_s
    lefts = [p.budget_left for p in parts]
    return Progress(
        rates=rates,
        remaining_jobs=remaining,
        budget_left=None if None in lefts else sum(x for x in lefts if x is not None),
        remaining_tokens=needed,
        eta_s=eta,
        finished=finished,
    )


def mean_completion(datasets: Iterable[DatasetStatus]) -> float | None:
    """Completion tokens per done job over ``datasets``; None before the first."""
    done = tokens = 0
    for d in datasets:
        done += d.states["done"]
        tokens += d.done_completion_tokens
    return tokens / done if done else None


def server_rows(
    servers: Sequence[ServerStatus], beats: Sequence[Heartbeat]
) -> list[dict[str, Any]]:
    """Per server: in flight, up/down and the model served from the live workers'
    heartbeats, rates and errors from Postgres. A server no live worker reports is
    ``up: None``; ``models`` are the models its workers say it serves, ``changed_from``
    those they saw it serve before (another model was started behind its URL)."""
    seen: dict[str, dict[str, Any]] = {}
    for beat in beats:
        for name, info in beat.servers.items():
            row = seen.setdefault(name, _live_row())
            row["in_flight"] += info.held
            row["limit"] = max(row["limit"], info.limit)
            row["adaptive"] = row["adaptive"] or info.adaptive
            row["up"] = row["up"] or info.healthy
            row["workers"] += 1
            _add(row["models"], info.model)
            _add(row["changed_from"], info.previous_model)
    recent = {s.name: s for s in servers}
    rows = []
    for name in sorted(seen.keys() | recent.keys()):
        live = seen.get(name, _no_live_row())
        status = recent.get(name)
        shortest = window_rate(status.windows[0]) if status and status.windows else None
        rows.append(
            {
                "name": name,
                **live,
                "completion_tok_s_1m": shortest.completion_tok_s if shortest else 0.0,
                "completions_per_min_1m": shortest.completions_per_min if shortest else 0.0,
                "errors": dict(status.errors) if status else {},
            }
        )
    return rows


def _live_row() -> dict[str, Any]:
    return {
        "in_flight": 0,
        "limit": 0,
        "adaptive": False,
        "up": False,
        "workers": 0,
        "models": [],
        "changed_from": [],
    }


def _no_live_row() -> dict[str, Any]:
    return {
        "in_flight": None,
        "limit": None,
        "adaptive": None,
        "up": None,
        "workers": 0,
        "models": [],
        "changed_from": [],
    }


def _add(values: list[str], value: str | None) -> None:
    """Add ``value`` to a short list of distinct values, in the order first seen."""
    if value is not None and value not in values:
        values.append(value)


def format_eta(seconds: float | None, finished: str | None = None) -> str:
    """``3h 12m``, ``45s``, ``done``; ``?`` when unknown."""
    if finished:
        return "done"
    if seconds is None:
        return "?"
    whole = round(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def eta_at(now: datetime, seconds: float | None) -> str | None:
    """The wall-clock time an ETA points at, ISO 8601, or None."""
    if seconds is None:
        return None
    return (now + timedelta(seconds=seconds)).isoformat(timespec="seconds")


def _label(seconds: int) -> str:
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def _finished(remaining: int, budget_left: int | None) -> str | None:
    if budget_left is not None and budget_left <= 0:
        return "budget reached"
    if remaining == 0:
        return "all jobs done"
    return None


def _remaining_tokens(
    dataset: DatasetStatus, budget_left: int | None, fallback_mean: float | None
) -> float | None:
    """Completion tokens the dataset still needs: its jobs at its mean length, at most what
    its budget allows (a `total` budget also pays for prompts, in the share seen so far)."""
    done = dataset.states["done"]
    mean = dataset.done_completion_tokens / done if done else fallback_mean
    if mean is None:
        return None
    needed = (dataset.states["queued"] + dataset.states["running"]) * mean
    if budget_left is None:
        return needed
    if dataset.budget_basis == "total":
        spent = dataset.done_prompt_tokens + dataset.done_completion_tokens
        share = dataset.done_completion_tokens / spent if spent else 1.0
        return min(needed, budget_left * share)
    return min(needed, float(budget_left))


def _eta(
    dataset: DatasetStatus, remaining: int, budget_left: int | None, rate: Rate | None
) -> float | None:
    """Seconds to the earlier of "all jobs done" and "budget reached" at ``rate``."""
    if rate is None or rate.completions_per_min <= 0:
        return None  # nothing recorded lately: stalled, or not started
    etas = [remaining / (rate.completions_per_min / 60.0)]
    if budget_left is not None:
        spend = rate.completion_tok_s + (
            rate.prompt_tok_s if dataset.budget_basis == "total" else 0.0
        )
        etas.append(budget_left / spend)
    return min(etas)


def _n_windows(datasets: Sequence[DatasetStatus]) -> int:
    return min((len(d.windows) for d in datasets), default=0)


def _sum_windows(windows: Sequence[Window]) -> Window:
    """The windows of datasets run side by side: their work spans from the earliest start."""
    covered = [w.covered_s for w in windows if w.covered_s is not None]
    return Window(
        seconds=windows[0].seconds,
        completions=sum(w.completions for w in windows),
        completion_tokens=sum(w.completion_tokens for w in windows),
        prompt_tokens=sum(w.prompt_tokens for w in windows),
        covered_s=max(covered, default=None),
    )
