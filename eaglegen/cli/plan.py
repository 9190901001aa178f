"""`eaglegen plan`: how many requests to keep in flight on each server, and when the run is
done. eaglegen.report.plan does the arithmetic; this reads the servers and Postgres, and
prints the plan as tables or as one JSON document."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from core.names import check_name
from eaglegen.cli.base import (
    DatabaseUrl,
    DataDir,
    JsonFlag,
    checked_repository,
    command,
    console,
    emit_json,
    err,
    load_settings,
    parse_servers,
)
from eaglegen.report.text import inline, shown, visible

if TYPE_CHECKING:
    from core.settings import ServerSpec
    from eaglegen.report.plan import Forecast, RunPlan, ServerFacts, ServerPlan

app = typer.Typer()
# Both endpoints answer from memory on SGLang: a server slower than this is not answering.
SERVER_TIMEOUT_S = 10.0


@command(app)
def plan(
    run: Annotated[
        str | None, typer.Argument(help="Run to plan (default: the only run there is)")
    ] = None,
    server: Annotated[
        list[str] | None,
        typer.Option(
            "--server",
            help="A server to plan for, URL or NAME=URL (repeatable; default: EAGLEGEN_SERVERS)",
        ),
    ] = None,
    kv_tokens: Annotated[
        int | None,
        typer.Option(
            min=2, help="KV pool in tokens (max_total_num_tokens) instead of the server's"
        ),
    ] = None,
    max_running_requests: Annotated[
        int | None, typer.Option(min=1, help="The server's running cap instead of its own")
    ] = None,
    tok_s: Annotated[
        float | None,
        typer.Option(min=0.001, help="Completion tokens/s for the ETA instead of the measured"),
    ] = None,
    decode_tok_s_per_request: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Tokens/s one request decodes at: the ETA's throughput when none is measured",
        ),
    ] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Recommended requests in flight per server (what fits its KV pool under SGLang's
    admission) and the ETA per dataset and for the run."""
    from eaglegen.report.plan import plan_document, plan_run

    settings = load_settings(
        database_url=database_url, data_dir=data_dir, servers=parse_servers(server or [])
    )
    with checked_repository(settings) as repo:
        name = _run_name(repo.plan_run(None if run is None else check_name("run", run)), run)
        lengths = repo.plan_lengths(name)
        snapshot = repo.status(name)
    if not lengths:
        raise ValueError(f"run {name!r} has no dataset yet: `eaglegen enqueue` adds one")
    facts = _facts(settings.servers, kv_tokens, max_running_requests)
    result = plan_run(
        name,
        facts,
        lengths,
        snapshot.datasets,
        tok_s=tok_s,
        decode_tok_s_per_request=decode_tok_s_per_request,
    )
    if json_out:
        emit_json(plan_document(result, snapshot.now))
    else:
        console().print(plan_view(result, snapshot.now))
    for warning in warnings(result, settings.servers):
        err.print(f"[yellow]warning:[/] {inline(warning)}", highlight=False, soft_wrap=True)


def _run_name(found: str | None, asked: str | None) -> str:
    if found is None:
        raise ValueError(f"run {asked!r} not found")
    return found


# --- the servers ----------------------------------------------------------------------------


def _facts(
    specs: list[ServerSpec], kv_tokens: int | None, max_running: int | None
) -> list[ServerFacts]:
    """Each server's facts, the flags winning; with no server, one made of the flags."""
    from eaglegen.report.plan import server_facts

    if not specs:
        if kv_tokens is None:
            raise ValueError(
                "no server to plan for: pass --server URL (or set EAGLEGEN_SERVERS), or give "
                "the KV pool as --kv-tokens N"
            )
        return [
            server_facts("given", None, None, kv_tokens=kv_tokens, max_running_requests=max_running)
        ]
    return [_ask(spec, kv_tokens, max_running) for spec in specs]


def _ask(spec: ServerSpec, kv_tokens: int | None, max_running: int | None) -> ServerFacts:
    """One server's facts from /get_server_info and /metrics. Neither answering is an error
    unless the flags give the pool (then the plan goes on without the server)."""
    from eaglegen.report.plan import server_facts

    if kv_tokens is not None and max_running is not None:
        return server_facts(
            spec.name, None, None, kv_tokens=kv_tokens, max_running_requests=max_running
        )
    info, info_error = _get(spec.url, "/get_server_info")
    text, metrics_error = _get(spec.url, "/metrics")
    metrics = None if not isinstance(text, str) else parse_metrics(text)
    if not isinstance(info, dict):
        info = None
    if info is None and not metrics:
        message = (
            f"server {spec.name} ({spec.url}) answers neither /get_server_info ({info_error}) "
            f"nor /metrics ({metrics_error}): is it up?"
        )
        if kv_tokens is None:
            raise ValueError(f"{message} Or give its KV pool as --kv-tokens N")
        err.print(f"[yellow]warning:[/] {inline(message)}; planning from the flags")
    return server_facts(
        spec.name, info, metrics, kv_tokens=kv_tokens, max_running_requests=max_running
    )


def _get(url: str, path: str) -> tuple[Any, str | None]:
    """The JSON (or, for /metrics, the text) of ``url + path``, or None and why not."""
    import httpx

    from core import bounded

    try:
        with bounded.client(url) as http:
            response = bounded.get(http, path, SERVER_TIMEOUT_S)
        response.raise_for_status()
        return (response.text if path == "/metrics" else response.json()), None
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except ValueError:
        return None, "not JSON"


def parse_metrics(text: str) -> dict[str, float]:
    """SGLang's gauges by name from a /metrics body (the first sample of each: one scheduler
    per server); empty when it is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    gauges: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name.startswith("sglang:") and family.samples:
                gauges.setdefault(family.name, float(family.samples[0].value))
    except ValueError:
        return {}
    return gauges


# --- the view ---------------------------------------------------------------------------


def plan_view(result: RunPlan, now: datetime) -> Group:
    """The terminal view: servers, the mean request, datasets, the run's line."""
    parts: list[Any] = [_servers_table(result)]
    parts += [_request_line(s) for s in result.servers[:1]]
    parts += [_datasets_table(result), _run_line(result, now)]
    return Group(*parts)


def _servers_table(result: RunPlan) -> Table:
    table = Table(title=f"eaglegen plan: {visible(result.run)}", title_justify="left")
    columns = ("server", "KV tokens", "max running", "fit: KV only", "at ratio floor",
               "at ratio init", "recommended", "limited by", "running/queued now")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("server", "limited by") else "right")
    for s in result.servers:
        facts, fit = s.facts, s.concurrency
        table.add_row(
            shown(facts.name),
            f"{facts.kv_tokens:,}",
            "-" if facts.max_running_requests is None else f"{facts.max_running_requests:,}",
            f"{fit.kv_only:,}",
            f"{fit.at_floor:,} ({facts.floor_ratio:.3g})",
            f"{fit.at_init:,} ({facts.init_ratio:.3g})",
            Text(f"{fit.recommended:,}", style="bold"),
            fit.limited_by,
            _now_cell(facts),
        )
    return table


def _now_cell(facts: ServerFacts) -> str:
    if facts.running_now is None:
        return "-"
    return f"{facts.running_now:,}/{'?' if facts.queued_now is None else f'{facts.queued_now:,}'}"


def _request_line(server: ServerPlan) -> Text:
    shape = server.shape
    return Text(
        f"mean request ({shape.source}): prompt {shape.prompt:,.0f}, completion "
        f"{shape.completion:,.0f} tokens; holds {shape.held:,.0f} KV tokens on average, "
        f"{shape.footprint(server.facts.floor_ratio):,.0f} with SGLang's reserve at the floor"
    )


def _datasets_table(result: RunPlan) -> Table:
    from eaglegen.report.progress import format_eta
    from models.ledger import format_tokens

    table = Table(title="datasets", title_justify="left")
    columns = ("dataset", "lengths from", "prompt", "completion", "max_new", "jobs left",
               "tokens left", "budget left", "server time", "ETA")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:2] else "right")
    for f in result.datasets:
        table.add_row(
            shown(f.dataset),
            "-" if f.shape is None else f.shape.source,
            *_lengths_cells(f),
            f"{f.max_new_tokens:,}",
            f"{f.remaining_jobs:,.0f}",
            format_tokens(round(f.remaining_tokens)),
            "-" if f.budget_left is None else format_tokens(max(f.budget_left, 0)),
            format_eta(f.alone_s, f.finished),
            format_eta(f.eta_s, f.finished),
        )
    return table


def _lengths_cells(f: Forecast) -> tuple[str, str]:
    if f.shape is None:
        return "-", "-"
    return f"{f.shape.prompt:,.0f}", f"{f.shape.completion:,.0f}"


def _run_line(result: RunPlan, now: datetime) -> Text:
    from eaglegen.report.progress import eta_at, format_eta
    from models.ledger import format_tokens

    line = Text()
    line.append(f"run {visible(result.run)}: ", style="bold")
    line.append(f"{result.recommended:,} in flight over {len(result.servers)} server(s); ")
    if result.finished:
        line.append("finished", style="green")
        return line
    line.append(f"{format_tokens(round(result.remaining_tokens))} completion tokens left")
    speed = result.throughput
    if speed.tok_s is None:
        line.append("; ETA unknown (no throughput measured or given)", style="yellow")
    else:
        line.append(f" at {speed.tok_s:,.0f} tok/s ({speed.source}): ")
        line.append(f"ETA {format_eta(result.eta_s)} ({eta_at(now, result.eta_s)})", style="bold")
    return line


def warnings(result: RunPlan, specs: list[ServerSpec]) -> list[str]:
    """What the user should know or do: an unknown ETA, a prior, a cap not reported, a
    fixed in-flight limit above what fits."""
    out = []
    if result.throughput.tok_s is None and not result.finished:
        out.append(
            "no completion in the last 10 minutes to measure throughput: pass --tok-s, or "
            "--decode-tok-s-per-request to estimate it from the recommended concurrency"
        )
    prior = [f.dataset for f in result.datasets if f.shape and f.shape.source == "prior"]
    if prior:
        out.append(
            f"no generation yet in {', '.join(prior)}: their lengths are a prior (their "
            "prompts, every answer max_new_tokens long), so the plan errs towards fewer in "
            "flight and more tokens left"
        )
    limits = {spec.name: spec.max_inflight for spec in specs}
    for s in result.servers:
        if s.facts.max_running_requests is None:
            out.append(
                f"server {s.facts.name} reports no max_running_requests: no cap applied "
                "(pass --max-running-requests)"
            )
        fixed = limits.get(s.facts.name)
        if fixed is not None and fixed > s.concurrency.recommended:
            out.append(
                f"server {s.facts.name}: max_inflight {fixed} is above the "
                f"{s.concurrency.recommended} that fit: the rest wait in its queue or are "
                f"retracted; set max_inflight to {s.concurrency.recommended}, or unset it "
                "for the adaptive controller"
            )
    return out
