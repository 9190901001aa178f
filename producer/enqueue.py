"""Enqueue datasets: read, validate, template, insert jobs, publish their ids.

Rows stream through in batches, so memory does not grow with the dataset. A bad row becomes
a `rejected_rows` entry and the run goes on.
"""

from __future__ import annotations

import heapq
import importlib.metadata
import json
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from eaglegen.queue import BulkPublisher
from models.records import DatasetSpec, NewJob, Rejection, RunSpec
from models.repository import Repository
from producer.plan import DatasetPlan, RunPlan
from producer.readers import detect_format, iter_rows
from producer.rows import Prompt, RawRow, RowError, to_prompt
from producer.stats import DatasetStats, totals
from producer.template import Templater

BATCH_ROWS = 1024
# Batches templated ahead of the writer; bounds memory to a few batches.
WRITES_IN_FLIGHT = 2
VERSIONED_PACKAGES = ("eaglegen", "transformers", "tokenizers", "jinja2")

Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class Prepared:
    """A batch after validation and templating."""

    jobs: list[NewJob]
    rejections: list[Rejection]


class Sink(Protocol):
    """Where prepared batches go; returns how many jobs were new."""

    def write(self, prepared: Prepared) -> int: ...


@dataclass
class DatabaseSink:
    """Insert jobs (duplicates skipped by the unique key), record rejections, publish ids."""

    repo: Repository
    publisher: BulkPublisher
    dataset_id: int

    def write(self, prepared: Prepared) -> int:
        new_ids = self.repo.insert_jobs(self.dataset_id, prepared.jobs)
        self.repo.record_rejections(self.dataset_id, prepared.rejections)
        # Published after the commit: a worker must find the job it is told about. A crash
        # between the two leaves jobs queued but unpublished, which `eaglegen reconcile` finds.
        self.publisher.publish(new_ids)
        return len(new_ids)


@dataclass
class DrySink:
    """Count what would be new without writing anything (16-byte digests keep memory small)."""

    seen: set[bytes] = field(default_factory=set)

    def write(self, prepared: Prepared) -> int:
        before = len(self.seen)
        self.seen.update(bytes.fromhex(job.prompt_sha256)[:16] for job in prepared.jobs)
        return len(self.seen) - before


@dataclass
class RunReport:
    """The outcome of one enqueue over all datasets of a run."""

    run: str
    dry_run: bool
    datasets: list[DatasetStats]

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "run": self.run,
            "dry_run": self.dry_run,
            **totals(self.datasets),
            "datasets": {s.dataset: s.as_dict() for s in self.datasets},
        }


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide tokenization, recorded on the run."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def run_spec(plan: RunPlan, templater: Templater) -> RunSpec:
    """The identity a run is created with (and checked against on every enqueue)."""
    return RunSpec(
        name=plan.run,
        tokenizer_path=str(plan.tokenizer),
        tokenizer_sha256=templater.tokenizer_sha256(),
        chat_template_sha256=templater.chat_template_sha256(),
        model_name=plan.model or plan.tokenizer.name,
        chat_template_kwargs=plan.chat_template_kwargs,
        max_context_len=plan.max_context_len,
        package_versions=package_versions(),
        think_end_id=templater.think_end_id(),
    )


def enqueue_run(
    plan: RunPlan,
    templater: Templater,
    *,
    repo: Repository | None,
    publisher: BulkPublisher | None,
    progress: Progress | None = None,
) -> RunReport:
    """Enqueue every dataset of ``plan``; with no repository it is a dry run.

    Inputs are checked and the run and its datasets are created (or checked against what
    exists) before the first job is written, so a refusal leaves no partial dataset.
    """
    for dataset in plan.datasets:
        detect_format(dataset.path, dataset.fmt)
    stop_ids = templater.stop_token_ids()
    params = {d.name: plan.sampling_params(d, stop_ids) for d in plan.datasets}
    sinks = _sinks(plan, templater, params, repo, publisher)
    report = RunReport(run=plan.run, dry_run=repo is None, datasets=[])
    for dataset in plan.datasets:
        stats = DatasetStats(
            dataset.name,
            int(params[dataset.name]["max_new_tokens"]),
            dataset.budget_tokens,
            dataset.budget_basis,
        )
        enqueue_dataset(templater, plan, dataset, sinks[dataset.name], stats, progress)
        report.datasets.append(stats)
    return report


def _sinks(
    plan: RunPlan,
    templater: Templater,
    params: dict[str, dict[str, Any]],
    repo: Repository | None,
    publisher: BulkPublisher | None,
) -> dict[str, Sink]:
    if repo is None or publisher is None:
        return {d.name: DrySink() for d in plan.datasets}
    run_id = repo.ensure_run(run_spec(plan, templater))
    sinks: dict[str, Sink] = {}
    for d in plan.datasets:
        dataset_id = repo.ensure_dataset(
            run_id,
            DatasetSpec(
                name=d.name,
                source=str(d.path),
                sampling_params=params[d.name],
                budget_tokens=d.budget_tokens,
                budget_basis=d.budget_basis.value,
            ),
        )
        sinks[d.name] = DatabaseSink(repo, publisher, dataset_id)
    return sinks


def enqueue_dataset(
    templater: Templater,
    plan: RunPlan,
    dataset: DatasetPlan,
    sink: Sink,
    stats: DatasetStats,
    progress: Progress | None = None,
) -> None:
    """Stream one dataset's rows through validation, templating and the sink.

    Writing (Postgres insert, Redis publish) runs on one background thread, in order, while
    the next batch is templated: both wait on I/O or Rust code that releases the GIL.
    """
    rows = select_rows(iter_rows(dataset.path, dataset.fmt), dataset.limit, dataset.sample_seed)
    pending: deque[tuple[list[RawRow], Prepared, Future[int]]] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue-writer") as writer:
        for batch in batches(rows, BATCH_ROWS):
            prepared = prepare(templater, batch, plan.max_context_len, stats.max_new_tokens)
            pending.append((batch, prepared, writer.submit(sink.write, prepared)))
            while len(pending) > WRITES_IN_FLIGHT:
                _account(stats, *pending.popleft(), dataset.name, progress)
        while pending:
            _account(stats, *pending.popleft(), dataset.name, progress)


def _account(
    stats: DatasetStats,
    batch: list[RawRow],
    prepared: Prepared,
    written: Future[int],
    dataset: str,
    progress: Progress | None,
) -> None:
    new = written.result()  # re-raises a failed write here, in the caller's thread
    stats.rows += len(batch)
    stats.accepted += new
    stats.duplicates += len(batch) - len(prepared.rejections) - new
    stats.rejected_by_reason.update(r.reason for r in prepared.rejections)
    stats.prompt_lengths.extend(len(job.input_ids) for job in prepared.jobs)
    # Prompt tokens of new jobs only matter for the 'total' basis; when some were
    # duplicates, count the batch's share.
    stats.accepted_prompt_tokens += _new_share(prepared.jobs, new)
    if progress is not None:
        progress(dataset, len(batch))


def prepare(
    templater: Templater, batch: list[RawRow], max_context_len: int | None, max_new_tokens: int
) -> Prepared:
    """Validate, render and tokenize a batch; every bad row becomes a Rejection."""
    rejections: list[Rejection] = []
    valid: list[tuple[RawRow, Prompt]] = []
    for raw in batch:
        try:
            if raw.error is not None:
                raise raw.error
            valid.append((raw, to_prompt(raw.value)))
        except RowError as err:
            rejections.append(Rejection(raw.index, err.reason, excerpt(raw, err)))
    rendered: list[tuple[RawRow, Prompt, str]] = []
    for (raw, prompt), text in zip(
        valid, templater.render_many([p for _, p in valid]), strict=True
    ):
        if isinstance(text, RowError):
            rejections.append(Rejection(raw.index, text.reason, excerpt(raw, text)))
        else:
            rendered.append((raw, prompt, text))
    jobs: dict[str, NewJob] = {}
    encoded = templater.encode_batch([text for _, _, text in rendered])
    for (raw, prompt, _), input_ids in zip(rendered, encoded, strict=True):
        too_long = _too_long(len(input_ids), max_context_len, max_new_tokens)
        if too_long is not None:
            rejections.append(Rejection(raw.index, too_long.reason, excerpt(raw, too_long)))
            continue
        job = NewJob(raw.index, input_ids, _messages(prompt))
        # A prompt repeated inside one batch is one job; the database dedups across batches.
        jobs.setdefault(job.prompt_sha256, job)
    return Prepared(list(jobs.values()), rejections)


def _too_long(prompt_tokens: int, max_context_len: int | None, max_new: int) -> RowError | None:
    if max_context_len is None or prompt_tokens + max_new <= max_context_len:
        return None
    return RowError(
        "too_long",
        f"{prompt_tokens} prompt tokens + max_new_tokens {max_new} "
        f"exceed the context length {max_context_len}",
    )


def _new_share(jobs: list[NewJob], new: int) -> int:
    if not jobs:
        return 0
    return round(sum(len(j.input_ids) for j in jobs) * new / len(jobs))


def _messages(prompt: Prompt) -> dict[str, Any]:
    return {"messages": prompt.messages, "tools": prompt.tools}


def excerpt(raw: RawRow, err: RowError) -> str:
    """The reason's detail and the start of the row, for `rejected_rows`."""
    source = raw.excerpt or json.dumps(raw.value, ensure_ascii=False, default=str)
    return f"{err.detail} | {source[:300]}"


def select_rows(rows: Iterable[RawRow], limit: int | None, seed: int | None) -> Iterator[RawRow]:
    """All rows; the first ``limit``; or, with a seed, a uniform sample of ``limit`` rows."""
    if limit is None:
        return iter(rows)
    if seed is None:
        return islice(rows, limit)
    return iter(sample_rows(rows, limit, seed))


def sample_rows(rows: Iterable[RawRow], k: int, seed: int) -> list[RawRow]:
    """A seeded uniform sample of ``k`` rows in file order (memory grows with k, not the file)."""
    rng = random.Random(seed)
    # Keep the k rows with the largest random keys: a reservoir that needs one pass.
    heap: list[tuple[float, int, RawRow]] = []
    for raw in rows:
        key = rng.random()
        if len(heap) < k:
            heapq.heappush(heap, (key, raw.index, raw))
        elif key > heap[0][0]:
            heapq.heapreplace(heap, (key, raw.index, raw))
    return [raw for _, _, raw in sorted(heap, key=lambda item: item[1])]


def batches(rows: Iterable[RawRow], size: int) -> Iterator[list[RawRow]]:
    """Consecutive lists of ``size`` rows (the last may be shorter)."""
    iterator = iter(rows)
    while batch := list(islice(iterator, size)):
        yield batch
