"""The `eaglegen` command line: thin wrappers that parse flags and call the packages."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from eaglegen.config import load_settings, parse_servers, require_services

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Regenerate EAGLE-3 training data with the target model's exact tokens.",
)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
app.add_typer(db_app, name="db")
budget_app = typer.Typer(no_args_is_help=True, help="Per-dataset token budgets, live.")
app.add_typer(budget_app, name="budget")
err = Console(stderr=True)

DatabaseUrl = Annotated[str | None, typer.Option(help="Postgres URL [env: EAGLEGEN_DATABASE_URL]")]
BrokerUrl = Annotated[str | None, typer.Option(help="Redis URL [env: EAGLEGEN_BROKER_URL]")]
DataDir = Annotated[Path | None, typer.Option(help="Data directory [env: EAGLEGEN_DATA_DIR]")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _ready(settings: Any, *, database: bool = True, broker: bool = True) -> None:
    """Raise ValueError saying what to do unless this command's services can be used."""
    from eaglegen.preflight import check_broker, check_database

    if broker:
        require_services(settings)
    elif settings.database_url is None:
        raise ValueError(
            "no database: set EAGLEGEN_DATABASE_URL, pass --database-url or run `eaglegen up`"
        )
    if database:
        check_database(settings.database_url)
    if broker:
        check_broker(settings.broker_url)


def _enqueue_or_explain(settings: Any, plan: Any, dry_run: bool, workers: int | None) -> Any:
    """Run the enqueue; a service lost mid-run is one sentence saying how to finish the job."""
    from concurrent.futures.process import BrokenProcessPool

    import redis as redis_lib
    from sqlalchemy.exc import OperationalError

    from eaglegen.settings import redact
    from producer.commands import run_enqueue

    try:
        return run_enqueue(settings, plan, dry_run=dry_run, workers=workers)
    except BrokenProcessPool as exc:
        raise ValueError(
            "a template worker process died (killed, or out of memory?). What was stored "
            "stays; run the same enqueue again, with --workers 0 to template in one process"
        ) from exc
    except (OperationalError, redis_lib.ConnectionError) as exc:
        service = "Postgres" if isinstance(exc, OperationalError) else "Redis"
        url = settings.database_url if service == "Postgres" else settings.broker_url
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0].rstrip(".")
        raise ValueError(
            f"lost {service} at {redact(url)} mid-run: {reason}. What was stored stays; run "
            "the same enqueue again to add the rest, then `eaglegen reconcile` to publish "
            "jobs stored but not yet published"
        ) from exc


def fail(message: str) -> NoReturn:
    """Print an error naming what went wrong and exit 2."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def emit_json(document: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Create or migrate the schema to the latest revision."""
    from models.db import upgrade

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    if settings.database_url is None:
        fail("no database: set EAGLEGEN_DATABASE_URL, pass --database-url or run `eaglegen up`")
    upgrade(settings.database_url)
    err.print("database schema is at the latest revision")


@app.command()
def enqueue(
    source: Annotated[Path, typer.Argument(help="A run file (RUN.toml) or one dataset file")],
    run: Annotated[str | None, typer.Option(help="Run name (without a run file)")] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset name (without a run file)")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder")] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="jsonl, json, parquet or hf (default: detect)")
    ] = None,
    max_context_len: Annotated[int | None, typer.Option(min=2, help="Reject longer")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 4096,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.95,
    budget: Annotated[str | None, typer.Option(help="Token budget: 10M, 500k, unlimited")] = None,
    budget_basis: Annotated[str, typer.Option(help="completion or total")] = "completion",
    limit: Annotated[int | None, typer.Option(min=1, help="Take at most N rows")] = None,
    sample_seed: Annotated[int | None, typer.Option(help="With --limit: seeded sample")] = None,
    template_kwarg: Annotated[
        list[str], typer.Option(help="Chat template kwarg NAME=JSON, e.g. thinking=true")
    ] = [],  # noqa: B006
    trust_remote_code: Annotated[bool, typer.Option(help="Allow tokenizer code")] = False,
    model: Annotated[str | None, typer.Option(help="Model name recorded on the run")] = None,
    dry_run: Annotated[bool, typer.Option(help="Read and template only; write nothing")] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Processes that template rows; 0: all in this one "
            "(default: one per core, for inputs long enough to repay starting them)",
        ),
    ] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Template every row with the model's chat template and enqueue one job per prompt."""
    from producer.plan import plan_from_flags, plan_from_run_file
    from producer.readers import detect_format
    from producer.runfile import load_run_file

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    try:
        if source.suffix == ".toml":
            if run or dataset or tokenizer:
                raise ValueError(
                    f"{source}: a run file names the run, datasets and tokenizer; "
                    "drop --run/--dataset/--tokenizer"
                )
            plan = plan_from_run_file(load_run_file(source))
        else:
            plan = plan_from_flags(
                source,
                run=run,
                dataset=dataset,
                tokenizer=tokenizer,
                fmt=fmt,
                max_context_len=max_context_len,
                budget=budget,
                budget_basis=budget_basis,
                limit=limit,
                sample_seed=sample_seed,
                template_kwargs=template_kwarg,
                trust_remote_code=trust_remote_code,
                model=model,
                sampling={
                    "max_new_tokens": max_new_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                },
            )
        for dataset_plan in plan.datasets:  # a bad input is the first thing to hear about
            detect_format(dataset_plan.path, dataset_plan.fmt)
        if not dry_run:
            _ready(settings)
        report = _enqueue_or_explain(settings, plan, dry_run, workers)
    except (ValueError, OSError) as exc:  # InputError is a ValueError
        fail(str(exc))
    if json_out:
        emit_json(report.as_dict())
    else:
        Console(stderr=True).print(enqueue_table(report))
    for warning in report.warnings:
        Console(stderr=True).print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)


@app.command(context_settings={"allow_extra_args": False})
def worker(
    server: Annotated[list[str], typer.Option(help="SGLang server URL or NAME=URL (repeat)")] = [],  # noqa: B006
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Threads (in-flight requests)")
    ] = None,
    numa_node: Annotated[
        str | None, typer.Option(help="Pin to NUMA node N, a list 0,1, or auto (one per node)")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 0 if this host's workers are alive, else 1")
    ] = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Run a Celery worker (threads pool) that generates queued jobs."""
    import socket

    from worker.commands import alive_workers, run_worker

    settings = load_settings(
        database_url=database_url,
        broker_url=broker_url,
        data_dir=data_dir,
        worker_concurrency=concurrency,
        servers=parse_servers(server) if server else None,
    )
    try:
        _ready(settings, database=not check)  # --check only reads heartbeats in Redis
    except ValueError as exc:
        fail(str(exc))
    assert settings.broker_url is not None
    if check:
        alive = alive_workers(
            settings.broker_url, socket.gethostname(), 3 * settings.heartbeat_interval_s
        )
        err.print(f"{len(alive)} live worker process(es) on {socket.gethostname()}")
        raise typer.Exit(0 if alive else 1)
    if not settings.servers:
        fail("no SGLang servers: pass --server URL or set EAGLEGEN_SERVERS")
    passthrough = [f"--server={s}" for s in server]
    if concurrency is not None:
        passthrough.append(f"--concurrency={concurrency}")
    try:
        code = run_worker(settings, numa_node, passthrough)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command()
def status(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Jobs by state per dataset."""
    from eaglegen.report.status import status_document, status_table
    from models.db import make_engine
    from models.repository import Repository

    settings = load_settings(database_url=database_url, data_dir=data_dir)
    try:
        _ready(settings, broker=False)
    except ValueError as exc:
        fail(str(exc))
    assert settings.database_url is not None
    engine = make_engine(settings.database_url, pool_size=1)
    counts = Repository(engine).counts(run)
    engine.dispose()
    if json_out:
        emit_json(status_document(counts))
    else:
        Console().print(status_table(counts))


@app.command()
def demo(
    json_out: JsonFlag = False,
    data_dir: DataDir = None,
    concurrency: Annotated[int, typer.Option(min=1)] = 64,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 1024,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds")] = 600.0,
) -> None:
    """Start everything embedded, generate a bundled sample dataset, summarize, stop."""
    from eaglegen.demo import DemoOptions, run_demo

    settings = load_settings(data_dir=data_dir)
    summary = run_demo(
        settings,
        DemoOptions(concurrency=concurrency, max_new_tokens=max_new_tokens, timeout_s=timeout),
    )
    if json_out:
        emit_json(summary)
    else:
        err.print(summary["summary_line"], highlight=False, soft_wrap=True)
    if summary["jobs"]["done"] != summary["jobs"]["total"]:
        raise typer.Exit(1)


@app.command()
def up(
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    flower_address: Annotated[str, typer.Option(help="Flower bind address")] = "127.0.0.1",
    flower_port: Annotated[int, typer.Option(help="Flower port")] = 5555,
    flower_basic_auth: Annotated[
        str | None,
        typer.Option(envvar="FLOWER_BASIC_AUTH", help="USER:PASSWORD, required off loopback"),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Start embedded Postgres and Redis (unless configured) and Flower; migrate the schema."""
    from eaglegen import stack
    from eaglegen.settings import redact
    from models.db import upgrade

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    try:
        info = stack.up(
            settings.data_dir,
            database_url=settings.database_url,
            broker_url=settings.broker_url,
            flower_address=flower_address,
            flower_port=flower_port,
            flower_basic_auth=flower_basic_auth,
        )
    except ValueError as exc:
        fail(str(exc))
    upgrade(info["database_url"])
    shown = {
        **info,
        "database_url": redact(info["database_url"]),
        "broker_url": redact(info["broker_url"]),
    }
    if json_out:
        emit_json(shown)
    else:
        for key in ("database_url", "broker_url", "flower_url", "data_dir"):
            err.print(f"{key}: {shown[key]}", highlight=False)


@app.command()
def down(data_dir: DataDir = None) -> None:
    """Stop what `eaglegen up` started."""
    from eaglegen import stack

    settings = load_settings(data_dir=data_dir)
    stopped = stack.down(settings.data_dir)
    err.print(f"stopped: {', '.join(stopped) or 'nothing was up'}")


@app.command()
def sim(
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 = any free port)")] = 30000,
    kv_tokens: Annotated[int, typer.Option(help="KV pool size in tokens")] = 159_000,
    context_length: Annotated[int, typer.Option(help="Model context length")] = 32_768,
    max_running_requests: Annotated[int, typer.Option(help="Running batch cap")] = 1024,
    max_queued_requests: Annotated[
        int | None, typer.Option(help="Waiting-queue cap; beyond it requests get 503")
    ] = None,
    max_prefill_tokens: Annotated[int, typer.Option(help="Prefill tokens per batch")] = 16_384,
    max_output_tokens: Annotated[int, typer.Option(help="Longest natural output")] = 4096,
    model_path: Annotated[str, typer.Option(help="Model name reported")] = "eaglegen/sim-reasoner",
    seed: Annotated[int, typer.Option(help="Default sampling seed")] = 0,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder")] = None,
    decode_step_ms: Annotated[float, typer.Option(help="Decode step base time")] = 4.0,
    decode_ms_per_request: Annotated[float, typer.Option(help="Added per running request")] = 0.15,
    prefill_tokens_per_ms: Annotated[float, typer.Option(help="Prefill speed")] = 50.0,
    mean_output_tokens: Annotated[int, typer.Option(help="Mean natural output length")] = 300,
    error_rate: Annotated[
        list[str] | None,
        typer.Option(metavar="STATUS=P", help="Answer STATUS with probability P (repeatable)"),
    ] = None,
    added_latency_ms: Annotated[float, typer.Option(help="Extra delay on each /generate")] = 0.0,
    drop_rate: Annotated[float, typer.Option(help="Probability of closing unanswered")] = 0.0,
    malformed_rate: Annotated[float, typer.Option(help="Probability of a non-JSON 200")] = 0.0,
    leak_prompt_tokens: Annotated[
        bool, typer.Option("--leak-prompt-tokens", help="Prepend the prompt to output_ids")
    ] = False,
    fault_seed: Annotated[int, typer.Option(help="Seed of the per-request fault draws")] = 0,
) -> None:
    """Run the SGLang-compatible simulator (speaks /generate, /metrics, ...)."""
    from eaglegen.sim import FaultConfig, SimConfig, serve
    from eaglegen.sim.config import parse_error_rate

    try:
        faults = FaultConfig(
            error_rates=tuple(parse_error_rate(text) for text in error_rate or ()),
            added_latency_ms=added_latency_ms,
            drop_rate=drop_rate,
            malformed_rate=malformed_rate,
            leak_prompt_tokens=leak_prompt_tokens,
            seed=fault_seed,
        )
        config = SimConfig(
            host=host,
            port=port,
            kv_tokens=kv_tokens,
            context_length=context_length,
            max_running_requests=max_running_requests,
            max_queued_requests=max_queued_requests,
            max_prefill_tokens=max_prefill_tokens,
            max_output_tokens=max_output_tokens,
            model_path=model_path,
            seed=seed,
            tokenizer_dir=tokenizer,
            decode_step_ms=decode_step_ms,
            decode_ms_per_request=decode_ms_per_request,
            prefill_tokens_per_ms=prefill_tokens_per_ms,
            mean_output_tokens=mean_output_tokens,
            faults=faults,
        )
    except ValueError as exc:
        fail(str(exc))
    if faults.any_enabled():
        err.print(f"injecting faults: {json.dumps(faults.to_json())}", highlight=False)
    serve(config, on_ready=lambda url: err.print(f"simulator listening on {url}"))


def _repository(settings: Any, *, broker: bool = False) -> Any:
    """The repository, once the database (and with ``broker`` Redis too) proved usable."""
    from models.db import make_engine
    from models.repository import Repository

    try:
        _ready(settings, broker=broker)
    except ValueError as exc:
        fail(str(exc))
    return Repository(make_engine(settings.database_url, pool_size=1))


@budget_app.command("show")
def budget_show(
    run: Annotated[str | None, typer.Option(help="Only this run")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Budget, used and reserved tokens, and skipped jobs per dataset."""
    from dataclasses import asdict

    from rich.table import Table

    from models.budget import format_tokens

    repo = _repository(load_settings(database_url=database_url, data_dir=data_dir))
    rows = repo.budgets(run)
    repo.engine.dispose()
    if json_out:
        emit_json({"datasets": [asdict(r) for r in rows]})
        return
    table = Table(title="budgets")
    for column in ("run", "dataset", "budget", "basis", "used", "reserved", "skipped jobs"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.run,
            r.dataset,
            format_tokens(r.budget_tokens),
            r.budget_basis,
            f"{r.used_tokens:,}",
            f"{r.reserved_tokens:,}",
            f"{r.skipped_jobs:,}",
        )
    Console().print(table)


@budget_app.command("set")
def budget_set(
    dataset: Annotated[str, typer.Argument(help="Dataset name")],
    amount: Annotated[str, typer.Argument(help="10M, 500k, 1200000 or unlimited")],
    run: Annotated[str | None, typer.Option(help="Run (needed when names repeat)")] = None,
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Change a budget; raising it re-queues and publishes the jobs it had skipped."""
    from eaglegen.queue import BulkPublisher
    from models.budget import format_tokens, parse_tokens

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    try:
        budget = parse_tokens(amount)
        repo = _repository(settings, broker=True)
        _, broker = require_services(settings)
        requeued = repo.set_budget(run, dataset, budget)
    except ValueError as exc:
        fail(str(exc))
    publisher = BulkPublisher(broker, settings.queue)
    publisher.publish(requeued)
    publisher.close()
    repo.engine.dispose()
    if json_out:
        emit_json({"dataset": dataset, "budget_tokens": budget, "requeued": len(requeued)})
    else:
        err.print(
            f"{dataset}: budget {format_tokens(budget)}; {len(requeued)} skipped job(s) "
            "queued again"
        )


@app.command()
def reconcile(
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    broker_url: BrokerUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Re-queue jobs of dead workers and publish queued jobs missing from Redis."""
    import redis as redis_lib

    from eaglegen.queue import BulkPublisher
    from worker.reconcile import reconcile as run_reconcile

    settings = load_settings(database_url=database_url, broker_url=broker_url, data_dir=data_dir)
    repo = _repository(settings, broker=True)
    _, broker = require_services(settings)
    client = redis_lib.Redis.from_url(broker)
    publisher = BulkPublisher(broker, settings.queue)
    report = run_reconcile(
        repo,
        client,
        publisher,
        max_attempts=settings.max_attempts,
        republish_after_s=settings.republish_after_s,
    )
    publisher.close()
    client.close()
    repo.engine.dispose()
    if json_out:
        emit_json(report.as_dict())
    else:
        err.print(
            f"re-queued {report.expired_leases} job(s) with expired leases, published "
            f"{report.republished} missing message(s)"
        )


@app.command()
def audit(
    json_out: JsonFlag = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Check the invariants on a live database; exit 1 naming any violation."""
    settings = load_settings(database_url=database_url, data_dir=data_dir)
    repo = _repository(settings)
    # A lease may lapse for up to one reconciler interval before it is noticed.
    problems = repo.audit(lease_grace_s=2 * settings.reconcile_interval_s)
    overshoot = repo.max_overshoot()
    repo.engine.dispose()
    if json_out:
        emit_json(
            {
                "ok": not problems,
                "violations": problems,
                "over_budget": [{"run": r, "dataset": d, "tokens": o} for r, d, o in overshoot],
            }
        )
    else:
        for problem in problems:
            err.print(f"[red]violation:[/] {problem}", highlight=False)
        for r, d, o in overshoot:
            err.print(f"{r}/{d}: {o:,} tokens over budget (bounded by one job's reservation)")
        err.print("ok: every invariant holds" if not problems else f"{len(problems)} violation(s)")
    if problems:
        raise typer.Exit(1)


def enqueue_table(report: Any) -> Any:
    """The human summary of an enqueue: one row per dataset."""
    from rich.table import Table

    from models.budget import format_tokens

    title = f"{'dry run of ' if report.dry_run else ''}enqueue into run {report.run!r}"
    table = Table(title=title)
    for column in (
        "dataset",
        "rows",
        "accepted",
        "rejected",
        "duplicates",
        "prompt p50/p99/max",
        "worst case",
        "budget",
    ):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for stats in report.datasets:
        doc = stats.as_dict()
        pt = doc["prompt_tokens"]
        reasons = ", ".join(f"{k} {v}" for k, v in doc["rejected_by_reason"].items())
        table.add_row(
            stats.dataset,
            f"{doc['rows']:,}",
            f"{doc['accepted']:,}",
            f"{doc['rejected']:,}" + (f" ({reasons})" if reasons else ""),
            f"{doc['duplicates']:,}",
            f"{pt['p50']}/{pt['p99']}/{pt['max']}",
            format_tokens(doc["worst_case_tokens"]),
            format_tokens(doc["budget_tokens"]),
        )
    return table


def main() -> None:
    """Console-script entry point."""
    app()
