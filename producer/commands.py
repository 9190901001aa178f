"""The enqueue command's wiring: plan, services, templater, progress bars."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from core.broker import Publisher
from core.settings import Services, Settings
from models.db import make_engine
from models.repository import Repository
from producer.enqueue import Progress as ProgressFn
from producer.enqueue import RunReport, enqueue_run, make_preparer
from producer.plan import DatasetPlan, RunPlan
from producer.readers import count_rows
from producer.template import Templater


def run_enqueue(
    settings: Settings,
    services: Services | None,
    plan: RunPlan,
    *,
    quiet: bool = False,
    workers: int | None = None,
) -> RunReport:
    """Enqueue a plan into ``services`` with a progress line per dataset on stderr.

    ``services`` None: a dry run, which reads and templates everything and writes nothing.

    ``workers``: processes that template batches; 0 keeps it all in this process, None
    (the default) uses every core once an input is long enough to repay their start-up.
    """
    templater = Templater(
        plan.tokenizer,
        trust_remote_code=plan.trust_remote_code,
        template_kwargs=plan.chat_template_kwargs,
        family=plan.family,
    )
    # Before the progress bars' threads start: workers can then fork from this process.
    with (
        make_preparer(plan, templater, workers) as preparer,
        _destination(settings, services) as (repo, publisher),
    ):
        return _with_progress(
            plan,
            quiet,
            lambda progress: enqueue_run(
                plan,
                templater,
                repo=repo,
                publisher=publisher,
                progress=progress,
                preparer=preparer,
                max_row_bytes=settings.max_row_bytes,
            ),
        )


@contextmanager
def _destination(
    settings: Settings, services: Services | None
) -> Iterator[tuple[Repository | None, Publisher | None]]:
    """The repository and publisher an enqueue writes to; none for a dry run."""
    if services is None:
        yield None, None
        return
    engine = make_engine(services.database_url, pool_size=2)
    try:
        with Publisher(services.broker_url, settings.queue) as publisher:
            yield Repository(engine), publisher
    finally:
        engine.dispose()


def _with_progress(
    plan: RunPlan, quiet: bool, work: Callable[[ProgressFn], RunReport]
) -> RunReport:
    """Run ``work`` with a bar per dataset; each gets its total once its rows are counted."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # a dataset may be named "[/]"
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TextColumn("rows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with (
        Progress(*columns, console=Console(stderr=True), transient=True, disable=quiet) as bar,
        ThreadPoolExecutor(1, thread_name_prefix="enqueue-count") as counting,
    ):
        tasks = {d.name: bar.add_task(f"enqueue {d.name}", total=None) for d in plan.datasets}
        if not quiet:
            for d in plan.datasets:
                counted = counting.submit(_expected_rows, d)
                counted.add_done_callback(partial(_set_total, bar, tasks[d.name]))
        try:
            return work(lambda name, n: bar.advance(tasks[name], n))
        finally:
            counting.shutdown(wait=False, cancel_futures=True)


def _expected_rows(dataset: DatasetPlan) -> int | None:
    """The rows the enqueue will read of ``dataset``, if cheap to know."""
    try:
        rows = count_rows(dataset.path, dataset.fmt)
    except (OSError, ValueError):  # the enqueue itself reports what is wrong with the input
        return None
    return rows if rows is None or dataset.limit is None else min(rows, dataset.limit)


def _set_total(bar: Progress, task: TaskID, counted: Future[int | None]) -> None:
    if not counted.cancelled() and counted.exception() is None:
        bar.update(task, total=counted.result())
