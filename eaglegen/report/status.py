"""`eaglegen status`: per dataset, per server and per run, as rich tables and as one JSON
document. The figures come from eaglegen.report.progress; this module only lays them out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from eaglegen.report.progress import (
    Progress,
    dataset_progress,
    eta_at,
    format_eta,
    mean_completion,
    run_progress,
    server_rows,
)
from eaglegen.report.text import shown, visible
from models.ledger import format_tokens
from models.snapshot import DatasetCounts, DatasetStatus, StatusSnapshot
from models.states import JobState

if TYPE_CHECKING:
    from core.heartbeat import Heartbeat  # it imports Redis's client; only the type is used


def totals(counts: Sequence[DatasetCounts | DatasetStatus]) -> dict[str, int]:
    """Jobs per state over all datasets, plus ``total``."""
    out = {state.value: 0 for state in JobState}
    for dataset in counts:
        for state, n in dataset.states.items():
            out[state] += n
    out["total"] = sum(out.values())
    return out


def status_document(
    snapshot: StatusSnapshot,
    beats: Sequence[Heartbeat] | None,
    redis_state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``eaglegen status --json`` document. ``beats``: the live workers' heartbeats,
    None when Redis was not asked (then servers carry no in-flight or up/down);
    ``redis_state``: the Redis side of the window (``in_redis``, the feeder's ``bound``) and
    why each adaptive limit is what it is (``limit_reasons``), None likewise."""
    runs = sorted({d.run for d in snapshot.datasets})
    datasets = []
    for run in runs:
        of_run = [d for d in snapshot.datasets if d.run == run]
        mean = mean_completion(of_run)
        datasets += [_dataset_doc(d, dataset_progress(d, mean), snapshot) for d in of_run]
    whole = run_progress(snapshot.datasets)
    return {
        "now": snapshot.now.isoformat(timespec="seconds"),
        "windows_s": list(snapshot.windows_s),
        "datasets": datasets,
        "runs": [_run_doc(run, snapshot) for run in runs],
        "servers": _with_reasons(server_rows(snapshot.servers, beats or []), redis_state),
        "errors_without_server": dict(snapshot.unattributed_errors),
        "window": _window_doc(snapshot, redis_state),
        "jobs": totals(snapshot.datasets),
        "prompt_tokens": sum(d.done_prompt_tokens for d in snapshot.datasets),
        "completion_tokens": sum(d.done_completion_tokens for d in snapshot.datasets),
        **_progress_doc(whole, snapshot),
    }


def status_view(
    snapshot: StatusSnapshot,
    beats: Sequence[Heartbeat] | None,
    redis_state: Mapping[str, Any] | None = None,
) -> Group:
    """The terminal view: datasets, servers, the window and a line per run."""
    document = status_document(snapshot, beats, redis_state)
    parts: list[Any] = [_datasets_table(document), _budgets_table(document)]
    if any(len(d["conversations"]) > 1 for d in document["datasets"]):
        parts.append(_conversations_table(document))
    if any(d["samples"] > 1 or d["variants"] for d in document["datasets"]):
        parts.append(_samples_table(document))
    if document["servers"]:
        parts.append(_servers_table(document, known=beats is not None))
    if document["datasets"]:
        parts.append(_window_line(document["window"]))
    parts += [_run_line(run) for run in document["runs"]]
    if not document["datasets"]:
        parts.append(Text("no datasets yet: eaglegen enqueue stores a run's jobs"))
    return Group(*parts)


def connections_warning(in_use: int, limit: int) -> str | None:
    """What to do when Postgres nears its connection limit (at 80% of it), else None."""
    if in_use < 0.8 * limit:
        return None
    return (
        f"Postgres has {in_use} of its {limit} connections in use: each worker process opens "
        "up to EAGLEGEN_DB_POOL_SIZE; lower it, raise max_connections, or put PgBouncer in "
        'front (docs/reference/worker.md, "Many workers")'
    )


def _progress_doc(progress: Progress, snapshot: StatusSnapshot) -> dict[str, Any]:
    return {
        "rates": {r.label: r.as_dict() for r in progress.rates},
        "remaining_jobs": progress.remaining_jobs,
        "remaining_completion_tokens": (
            None if progress.remaining_tokens is None else round(progress.remaining_tokens)
        ),
        "eta_s": None if progress.eta_s is None else round(progress.eta_s, 1),
        "eta_at": eta_at(snapshot.now, progress.eta_s) if not progress.finished else None,
        "finished": progress.finished,
    }


def _dataset_doc(d: DatasetStatus, progress: Progress, snapshot: StatusSnapshot) -> dict[str, Any]:
    return {
        "run": d.run,
        "dataset": d.dataset,
        "jobs": {**d.states, "total": d.total},
        "turns": d.turns,
        "conversations": {**d.conversations, "turns_to_come": d.turns_to_come},
        "samples": d.samples,
        "variants": {name: weight for name, weight in d.variants},
        "prompt_tokens": d.done_prompt_tokens,
        "completion_tokens": d.done_completion_tokens,
        "budget": {
            "tokens": d.budget_tokens,
            "basis": d.budget_basis,
            "used": d.used_tokens,
            "reserved": d.reserved_tokens,
            "left": progress.budget_left,
            "reserve": d.reserve,
            "reserve_per_job": d.reserve_tokens,
        },
        **_progress_doc(progress, snapshot),
    }


def _with_reasons(
    rows: list[dict[str, Any]], redis_state: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    reasons = (redis_state or {}).get("limit_reasons") or {}
    return [{**row, "limit_reason": reasons.get(row["name"])} for row in rows]


def _window_doc(snapshot: StatusSnapshot, redis_state: Mapping[str, Any] | None) -> dict[str, Any]:
    queued = sum(d.states.get(JobState.QUEUED.value, 0) for d in snapshot.datasets)
    state = redis_state or {}
    return {
        "in_redis": state.get("in_redis"),
        "bound": state.get("bound"),
        "published": snapshot.published,
        "unpublished": max(0, queued - snapshot.published),
    }


def _window_line(window: dict[str, Any]) -> Text:
    line = Text()
    line.append("window: ", style="bold")
    if window["in_redis"] is None:
        line.append("Redis not asked; ")
    else:
        bound = "no feeder yet" if window["bound"] is None else f"bound {window['bound']:,}"
        line.append(f"{window['in_redis']:,} message(s) waiting in Redis ({bound}); ")
    line.append(
        f"{window['published']:,} queued job(s) with a message out, "
        f"{window['unpublished']:,} queued in Postgres for the feeder"
    )
    return line


def _run_doc(run: str, snapshot: StatusSnapshot) -> dict[str, Any]:
    of_run = [d for d in snapshot.datasets if d.run == run]
    return {
        "run": run,
        "order_seed": snapshot.order_seeds.get(run),
        "family": snapshot.families.get(run),
        "jobs": totals(of_run),
        "prompt_tokens": sum(d.done_prompt_tokens for d in of_run),
        "completion_tokens": sum(d.done_completion_tokens for d in of_run),
        **_progress_doc(run_progress(of_run), snapshot),
    }


def _rate(doc: dict[str, Any], label: str, key: str = "completion_tok_s") -> str:
    rate = doc["rates"].get(label)
    return "-" if rate is None else f"{rate[key]:,.1f}"


def _span(doc: dict[str, Any], label: str = "10m") -> str:
    """What a rate is over: the last 10 min, or the seconds its work spans when less."""
    rate = doc["rates"].get(label)
    if rate is None or rate["span_s"] >= 600:
        return "the last 10 min"
    return f"the last {format_eta(rate['span_s'])}"


def _eta(doc: dict[str, Any]) -> str:
    return format_eta(doc["eta_s"], doc["finished"])


def _datasets_table(document: dict[str, Any]) -> Table:
    table = Table(title="eaglegen status: jobs", title_justify="left")
    for name in ("run", "dataset"):
        table.add_column(name)
    for state in JobState:
        table.add_column(state.value, justify="right")
    for name in ("total", "done tok", "tok/s 1m", "tok/s 10m", "tok/s run", "done/min 10m"):
        table.add_column(name, justify="right")
    table.add_column("ETA", justify="right")
    for d in document["datasets"]:
        table.add_row(
            shown(d["run"]),
            shown(d["dataset"]),
            *(f"{d['jobs'][s.value]:,}" for s in JobState),
            f"{d['jobs']['total']:,}",
            f"{d['completion_tokens']:,}",
            _rate(d, "1m"),
            _rate(d, "10m"),
            _rate(d, "run"),
            _rate(d, "10m", "completions_per_min"),
            _eta(d),
        )
    return table


def _conversations_table(document: dict[str, Any]) -> Table:
    """Datasets answered turn by turn: conversations done, under way and ended (by reason),
    and the turns still to come (their jobs are created one by one)."""
    table = Table(title="conversations (turns = all)", title_justify="left")
    for name in ("run", "dataset", "done", "under way", "ended", "turns to come"):
        table.add_column(name, justify="left" if name in ("run", "dataset") else "right")
    for d in document["datasets"]:
        conv = d["conversations"]
        if len(conv) <= 1:
            continue
        ended = {k.removeprefix("ended: "): n for k, n in conv.items() if k.startswith("ended")}
        table.add_row(
            shown(d["run"]),
            shown(d["dataset"]),
            f"{conv.get('done', 0):,}",
            f"{conv.get('active', 0) + conv.get('waiting', 0):,}",
            ", ".join(f"{shown(k)} {n:,}" for k, n in sorted(ended.items())) or "0",
            f"{conv['turns_to_come']:,}",
        )
    return table


def _samples_table(document: dict[str, Any]) -> Table:
    """Datasets of several samples or with variants: samples per prompt, and each variant's
    share of them (by weight; `eaglegen stats` has each variant's figures)."""
    table = Table(title="samples and variants", title_justify="left")
    for name in ("run", "dataset", "samples per prompt", "variants (share)"):
        table.add_column(name)
    for d in document["datasets"]:
        if d["samples"] <= 1 and not d["variants"]:
            continue
        total = sum(d["variants"].values())
        table.add_row(
            shown(d["run"]),
            shown(d["dataset"]),
            f"{d['samples']}",
            ", ".join(f"{shown(n)} {w / total:.0%}" for n, w in d["variants"].items()) or "-",
        )
    return table


def _budgets_table(document: dict[str, Any]) -> Table:
    table = Table(title="budgets (tokens)", title_justify="left")
    columns = ("run", "dataset", "basis", "budget", "used", "reserved", "per job", "left")
    for name in (*columns, "prompt tok"):
        table.add_column(name, justify="left" if name in ("run", "dataset", "basis") else "right")
    for d in document["datasets"]:
        b = d["budget"]
        table.add_row(
            shown(d["run"]),
            shown(d["dataset"]),
            b["basis"],
            format_tokens(b["tokens"]),
            f"{b['used']:,}",
            f"{b['reserved']:,}",
            _per_job(b),
            "-" if b["left"] is None else f"{max(b['left'], 0):,}",
            f"{d['prompt_tokens']:,}",
        )
    return table


def _per_job(budget: dict[str, Any]) -> str:
    """What a job's claim reserves: its completion tokens and the policy (docs/design.md §4)."""
    tokens = budget.get("reserve_per_job")
    policy = str(budget.get("reserve", "")).replace("_", " ")
    return policy if tokens is None else f"{tokens:,} {policy}"


def _servers_table(document: dict[str, Any], *, known: bool) -> Table:
    table = Table(title="servers", title_justify="left")
    columns = ("server", "state", "model", "in flight", "tok/s 1m", "done/min 1m")
    left = ("server", "state", "model", "errors 10m", "limit")
    for name in (*columns, "errors 10m", "limit"):
        table.add_column(name, justify="left" if name in left else "right")
    for s in document["servers"]:
        if not known:
            state = "?"
        elif s["up"] is None:
            state = "no worker"
        else:
            state = "up" if s["up"] else "[red]down[/]"
        flight = "-" if s["in_flight"] is None else f"{s['in_flight']}/{s['limit']}"
        errors = ", ".join(f"{kind} {n}" for kind, n in sorted(s["errors"].items())) or "-"
        # a state is markup of ours; every other cell is a user or server string
        table.add_row(
            shown(s["name"]),
            state,
            shown(_model_cell(s)),
            flight,
            f"{s['completion_tok_s_1m']:,.1f}",
            f"{s['completions_per_min_1m']:,.1f}",
            shown(errors),
            shown(_limit_cell(s)),
        )
    return table


def _model_cell(server: dict[str, Any]) -> str:
    """The model its workers say it serves, and the one it served before, when another
    model was started behind its URL."""
    cell = ", ".join(server["models"]) or "-"
    if server["changed_from"]:
        cell += f" (changed from {', '.join(server['changed_from'])})"
    return cell


def _limit_cell(server: dict[str, Any]) -> str:
    """How the server's in-flight limit is set: fixed, or adaptive with its last reason."""
    if server["adaptive"] is None:
        return "-"
    if not server["adaptive"]:
        return "fixed"
    reason = server.get("limit_reason")
    return f"adaptive: {reason}" if reason else "adaptive"


def _family_text(family: str | None) -> str:
    """The run's model family as the header says it; an unknown one plainly."""
    if family is None:  # a run from before families were recorded: its readers detect it
        return "family not recorded; "
    if family == "unknown":
        return "family unknown (tool calls not checked); "
    return f"family {visible(family)}; "


def _run_line(run: dict[str, Any]) -> Text:
    jobs = run["jobs"]
    line = Text()
    line.append(f"run {visible(run['run'])}: ", style="bold")
    if run["order_seed"] is not None:
        line.append(f"order seed {run['order_seed']}; ")
    line.append(_family_text(run.get("family")))
    line.append(
        f"{jobs['done']:,} of {jobs['total']:,} jobs done, {jobs['failed']:,} failed, "
        f"{jobs['skipped_budget']:,} skipped; {_rate(run, '10m')} tok/s over {_span(run)}; "
    )
    if run["finished"]:
        line.append("finished", style="green")
    elif run["eta_s"] is None:
        line.append("ETA unknown (no completion in the last 10 minutes)", style="yellow")
    else:
        line.append(f"ETA {_eta(run)} ({run['eta_at']})")
    return line
