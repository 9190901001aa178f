"""Enqueue datasets: read, validate, template, insert jobs, wake the feeder.

Rows stream through in batches, so memory does not grow with the dataset. A bad row becomes
a `rejected_rows` entry and the run goes on.
"""

from __future__ import annotations

import gc
import heapq
import importlib.metadata
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import redis

from core.broker import Publisher
from core.samples import Variant, variants_of
from models.ledger import format_tokens
from models.records import DatasetSpec, RunSpec
from models.repository import Repository
from producer.parallel import (
    AUTO_START_BYTES,
    AUTO_START_ROWS,
    FORK_START_BYTES,
    Preparer,
    can_fork,
    default_workers,
)
from producer.plan import DatasetPlan, RunPlan
from producer.prepare import Prepared, prepare
from producer.readers import MAX_ROW_BYTES, InputError, detect_format, iter_rows
from producer.rows import RawRow
from producer.samples import SamplePlan, expand
from producer.stats import DatasetStats, totals
from producer.template import Templater

BATCH_ROWS = 1024
# Batches templated ahead of the writer; bounds memory to a few batches.
WRITES_IN_FLIGHT = 2
VERSIONED_PACKAGES = ("eaglegen", "transformers", "tokenizers", "jinja2")

Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class Written:
    """What a batch added: new jobs (a new conversation's first turn among them), and of
    the new conversations, how many and their answer points."""

    jobs: int
    conversations: int = 0
    conversation_turns: int = 0


class Sink(Protocol):
    """Where prepared batches go; says what was new."""

    @property
    def budget_tokens(self) -> int | None:
        """The dataset's budget in force (None: unlimited)."""
        ...

    @property
    def turns(self) -> str:
        """What of a multi-turn row the dataset answers (datasets.turns)."""
        ...

    @property
    def samples(self) -> SamplePlan:
        """What the dataset asks of each prompt (core.samples)."""
        ...

    def write(self, prepared: Prepared) -> Written: ...


def _new_conversations(prepared: Prepared, new: Iterable[bytes]) -> Written:
    """The ``new`` conversations' count and answer points (digests as stored)."""
    points = {c.digest: c.points for c in prepared.conversations}
    turns = [points[digest] for digest in new]
    return Written(len(turns), len(turns), sum(turns))


@dataclass
class DatabaseSink:
    """Insert jobs (duplicates skipped by the unique key), record rejections, wake the
    feeder that publishes them."""

    repo: Repository
    publisher: Publisher
    dataset_id: int
    budget_tokens: int | None
    turns: str = "last"
    # Until a batch holds prompts the dataset has (a re-run, repeats in the file), jobs are
    # expected new, which the repository inserts the cheap way (see insert_jobs).
    expect_new: bool = True
    # Why Redis refused the last wake of the feeder, if it did.
    wake_error: str | None = None
    # New jobs stored so far (committed), counted in the writer's thread as each batch is.
    stored: int = 0
    # What the dataset asks of each prompt (its samples and variants, as stored).
    samples: SamplePlan = field(default_factory=SamplePlan)

    def write(self, prepared: Prepared) -> Written:
        new_ids = self.repo.insert_jobs(self.dataset_id, prepared.jobs, expect_new=self.expect_new)
        begun = _new_conversations(
            prepared, self.repo.insert_conversations(self.dataset_id, prepared.conversations)
        )
        new = len(new_ids) + begun.jobs
        self.stored += new
        self.expect_new = self.expect_new and len(new_ids) == len(prepared.jobs)
        self.repo.record_rejections(self.dataset_id, prepared.rejections)
        if new:
            self._wake_feeder()
        return Written(new, begun.conversations, begun.conversation_turns)

    def _wake_feeder(self) -> None:
        """Tell the feeder, which publishes stored jobs in their order (worker.feeder), that
        there are some now. Best effort: Redis out of reach or full only means the feeder
        finds them at its next pass (the enqueue says so once)."""
        try:
            self.publisher.wake_feeder()
        except redis.RedisError as exc:
            self.wake_error = self.wake_error or " ".join(str(exc).split())[:200]


@dataclass
class DrySink:
    """Count what would be new without writing anything.

    Each prompt is remembered as the first 64 bits of its sha256 (~50 bytes in the set): a
    false duplicate among a million prompts has a chance of about 3 in 100 million.
    """

    budget_tokens: int | None
    turns: str = "all"
    seen: set[int] = field(default_factory=set)
    samples: SamplePlan = field(default_factory=SamplePlan)

    def write(self, prepared: Prepared) -> Written:
        before = len(self.seen)
        self.seen.update(int.from_bytes(sha[:8]) for sha in prepared.jobs.prompt_sha256)
        jobs = len(self.seen) - before
        new = []
        for conversation in prepared.conversations:
            key = int.from_bytes(conversation.digest[:8])
            if key not in self.seen:
                self.seen.add(key)
                new.append(conversation.digest)
        begun = _new_conversations(prepared, new)
        return Written(jobs + begun.jobs, begun.conversations, begun.conversation_turns)


class EnqueueInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped an enqueue: what it had stored by then, per dataset. Every
    stored job stays queued and is generated; the same command run again adds the rest."""

    def __init__(self, run: str, stored: dict[str, int], *, dry_run: bool) -> None:
        super().__init__(run, stored, dry_run)
        self.run = run
        self.stored = stored
        self.dry_run = dry_run

    def __str__(self) -> str:
        if self.dry_run:
            return "interrupted: a dry run, nothing was stored"
        parts = [f"{n:,} jobs of {name!r}" for name, n in self.stored.items() if n]
        if not parts:
            return "interrupted before any job was stored; run the same command again to enqueue"
        stored = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return (
            f"interrupted: {stored} stored (run {self.run!r}); run the same command again "
            "to go on: it adds only what is missing"
        )


@dataclass
class RunReport:
    """The outcome of one enqueue over all datasets of a run."""

    run: str
    dry_run: bool
    datasets: list[DatasetStats]
    warnings: list[str] = field(default_factory=list)
    # The run's publishing order seed (models.order); a dry run knows only a given one.
    order_seed: int | None = None
    # The run's model family (core.families): recorded with it (a dry run: what would be),
    # and where it comes from: "named" (run file or flag), "detected" (the tokenizer's
    # special tokens and template) or "recorded" (the run's, from an earlier enqueue).
    family: str = "unknown"
    family_source: str = "detected"
    # The stop ids a dataset stores when its sampling names none (RunTokenizer).
    default_stop_ids: list[int] = field(default_factory=list)

    @property
    def empty_datasets(self) -> list[str]:
        """Datasets of which no row is a job: an empty file, or every row rejected."""
        return [s.dataset for s in self.datasets if s.accepted + s.duplicates == 0]

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "run": self.run,
            "dry_run": self.dry_run,
            "order_seed": self.order_seed,
            "family": self.family,
            "family_source": self.family_source,
            "default_stop_token_ids": self.default_stop_ids,
            **totals(self.datasets),
            "datasets": {s.dataset: s.as_dict() for s in self.datasets},
            "empty_datasets": self.empty_datasets,
            "warnings": self.warnings,
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
        vocab_size=templater.vocab_size(),
        order_seed=plan.order_seed,
        family=templater.family.name,
        family_named=templater.family_named,
        trust_remote_code=plan.trust_remote_code,
    )


def enqueue_run(
    plan: RunPlan,
    templater: Templater,
    *,
    repo: Repository | None,
    publisher: Publisher | None,
    progress: Progress | None = None,
    preparer: Preparer | None = None,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> RunReport:
    """Enqueue every dataset of ``plan``; with no repository it is a dry run.

    Inputs are checked and the run and its datasets are created (or checked against what
    exists) before the first job is written, so a refusal leaves no partial dataset.
    ``preparer`` templates the batches (default: `make_preparer`'s); it is closed here.
    A file that breaks mid-stream raises InputError once the rows before the break are
    stored, saying how many; Ctrl-C raises EnqueueInterrupted once the writes under way
    are done, with the jobs stored per dataset.
    """
    for dataset in plan.datasets:
        detect_format(dataset.path, dataset.fmt)
    stop_ids = templater.default_stop_ids()
    params = {d.name: plan.sampling_params(d, stop_ids) for d in plan.datasets}
    sinks: dict[str, Sink] = {}
    try:
        sinks.update(_sinks(plan, templater, params, repo, publisher))
        return _enqueue_datasets(
            plan, templater, repo, params, sinks, progress, preparer, max_row_bytes
        )
    except EnqueueInterrupted:
        raise
    except KeyboardInterrupt as exc:  # the writes under way were waited for: counted
        stored = {
            name: sink.stored for name, sink in sinks.items() if isinstance(sink, DatabaseSink)
        }
        raise EnqueueInterrupted(plan.run, stored, dry_run=repo is None) from exc


def _enqueue_datasets(
    plan: RunPlan,
    templater: Templater,
    repo: Repository | None,
    params: dict[str, dict[str, Any]],
    sinks: dict[str, Sink],
    progress: Progress | None,
    preparer: Preparer | None,
    max_row_bytes: int,
) -> RunReport:
    """Enqueue every dataset of ``plan`` into its sink, in order."""
    seed = plan.order_seed if repo is None else repo.order_seed(plan.run)
    report = RunReport(
        plan.run,
        dry_run=repo is None,
        datasets=[],
        order_seed=seed,
        default_stop_ids=templater.default_stop_ids(),
    )
    report.family, report.family_source = _family(plan, templater, repo)
    report.warnings.extend(_budget_warnings(plan, sinks))
    if preparer is None:
        preparer = make_preparer(plan, templater, None)
    with _frozen_heap(), preparer:
        for dataset in plan.datasets:
            stats = DatasetStats(
                dataset.name,
                int(params[dataset.name]["max_new_tokens"]),
                sinks[dataset.name].budget_tokens,
                dataset.budget_basis,
                turns=sinks[dataset.name].turns,
                samples=sinks[dataset.name].samples.samples,
                variants=tuple(v.name for v in sinks[dataset.name].samples.variants),
            )
            enqueue_dataset(
                preparer, plan, dataset, sinks[dataset.name], stats, progress, max_row_bytes
            )
            report.datasets.append(stats)
            report.warnings.extend(_nothing_accepted(dataset, stats))
    refused = [e for sink in sinks.values() if (e := getattr(sink, "wake_error", None))]
    if refused:
        report.warnings.append(
            f"Redis refused to wake the feeder ({refused[0]}): every job above is stored, "
            "and the workers' feeder publishes them at its next pass once Redis takes writes"
        )
    return report


def _family(plan: RunPlan, templater: Templater, repo: Repository | None) -> tuple[str, str]:
    """The run's family and where it comes from (`RunReport.family_source`)."""
    mine = templater.family.name
    recorded = None if repo is None else repo.run_family(plan.run)
    if templater.family_named:
        return mine, "named"  # a run recorded with another refused it before this
    if recorded is not None and recorded != mine:
        return recorded, "recorded"
    return mine, "detected"


def _nothing_accepted(dataset: DatasetPlan, stats: DatasetStats) -> Iterator[str]:
    """A warning for a dataset of which no row is a job (`RunReport.empty_datasets`)."""
    if stats.rows == 0:
        yield f"dataset {dataset.name!r}: {dataset.path} is empty: no rows"
    elif stats.accepted + stats.duplicates == 0:
        reasons = ", ".join(f"{r} {n:,}" for r, n in stats.rejected_by_reason.most_common())
        yield (
            f"dataset {dataset.name!r}: none of the {stats.rows:,} rows of {dataset.path} "
            f"is a job ({reasons}); is it the file you meant?"
        )


def _budget_warnings(plan: RunPlan, sinks: dict[str, Sink]) -> Iterator[str]:
    """A dataset that exists keeps its budget: say so where this enqueue asked for another."""
    for d in plan.datasets:
        kept = sinks[d.name].budget_tokens
        if kept != d.budget_tokens:
            exact = "unlimited" if d.budget_tokens is None else str(d.budget_tokens)
            yield (
                f"dataset {d.name!r} keeps its budget {format_tokens(kept)} (this enqueue "
                f"asked for {format_tokens(d.budget_tokens)}); to change it: "
                f"eaglegen budget set --run {plan.run} {d.name} {exact}"
            )


def make_preparer(plan: RunPlan, templater: Templater, workers: int | None) -> Preparer:
    """Where batches are templated: ``workers`` processes (0: this process), or by default
    one per core once the input is long enough to repay starting them.

    Call it before this process starts any thread: a pool that starts here forks its
    workers from this process, at once, instead of from a fork server.
    """
    if workers is None:
        size = sum(_bytes_on_disk(d.path) for d in plan.datasets)
        if size < (FORK_START_BYTES if can_fork() else AUTO_START_BYTES):
            return Preparer(templater, default_workers(), start_after_rows=AUTO_START_ROWS)
        workers = default_workers()
    preparer = Preparer(templater, workers)
    preparer.start()
    return preparer


def _bytes_on_disk(path: Path) -> int:
    """A file's size, or the sum of the files in a folder (0 if unreadable: the enqueue
    reports that input itself)."""
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    except OSError:
        return 0


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the objects alive now (transformers, the tokenizer) out of full collections.

    Templating makes cyclic garbage (jinja contexts), so the collector runs often, and each
    full pass walked every object transformers created: a sixth of the run's CPU.
    """
    if gc.get_freeze_count():  # someone else froze the heap and will unfreeze it
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _sinks(
    plan: RunPlan,
    templater: Templater,
    params: dict[str, dict[str, Any]],
    repo: Repository | None,
    publisher: Publisher | None,
) -> dict[str, Sink]:
    if repo is None or publisher is None:
        return {
            d.name: DrySink(
                d.budget_tokens,
                d.turns or "all",
                samples=SamplePlan.of(
                    d.samples or 1,
                    d.variants or (),
                    plan.order_seed or 0,
                    plan.chat_template_kwargs,
                ),
            )
            for d in plan.datasets
        }
    run_id = repo.ensure_run(run_spec(plan, templater))
    order_seed = repo.order_seed(plan.run) or 0
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
                reserve=None if d.reserve is None else d.reserve.value,
                stops_defaulted=not plan.names_stop_ids(d),
                turns=d.turns,
                samples=d.samples,
                variants=None if d.variants is None else [v.as_json() for v in d.variants],
            ),
        )
        samples, variants = repo.dataset_samples(dataset_id)
        sinks[d.name] = DatabaseSink(
            repo,
            publisher,
            dataset_id,
            repo.budget_of(dataset_id),
            repo.dataset_turns(dataset_id),
            samples=SamplePlan.of(
                samples, variants_of(variants), order_seed, plan.chat_template_kwargs
            ),
        )
    return sinks


@dataclass
class VariantPreparer:
    """Templates rows again for the variants with template kwargs of their own, in this
    process: one templater per variant, loaded at its first rows."""

    plan: RunPlan
    max_new_tokens: int
    turns: str
    templaters: dict[str, Templater] = field(default_factory=dict)

    def __call__(self, variant: Variant, rows: list[RawRow]) -> Prepared:
        templater = self.templaters.get(variant.name)
        if templater is None:
            templater = Templater(
                self.plan.tokenizer,
                trust_remote_code=self.plan.trust_remote_code,
                template_kwargs={**self.plan.chat_template_kwargs, **variant.template},
                family=self.plan.family,
            )
            self.templaters[variant.name] = templater
        max_new = int(variant.sampling.get("max_new_tokens", self.max_new_tokens))
        return prepare(templater, rows, self.plan.max_context_len, max_new, self.turns)


def enqueue_dataset(
    preparer: Preparer,
    plan: RunPlan,
    dataset: DatasetPlan,
    sink: Sink,
    stats: DatasetStats,
    progress: Progress | None = None,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> None:
    """Stream one dataset's rows through validation, templating and the sink, in order.

    Batches are prepared ahead (in worker processes when the preparer has them); writing
    (the Postgres insert) runs on one background thread, in order, meanwhile.
    """
    # Rows stay undecoded here: decoding is part of preparing, which may run in workers.
    source = UntilBroken(
        iter_rows(dataset.path, dataset.fmt, decode=False, max_row_bytes=max_row_bytes)
    )
    rows = select_rows(source, dataset.limit, dataset.sample_seed)
    if source.broken is not None:  # a seeded sample read the whole file before any batch
        raise InputError(
            f"{source.broken}; nothing of dataset {dataset.name!r} is stored (a seeded "
            "sample needs the whole file): fix it and run the same enqueue again"
        )
    preparing: deque[tuple[list[RawRow], Future[Prepared] | Future[str]]] = deque()
    writing: deque[tuple[int, Prepared, Future[Written]]] = deque()
    variants = VariantPreparer(plan, stats.max_new_tokens, sink.turns)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue-writer") as writer:

        def write_oldest() -> None:
            batch, prepared = preparing.popleft()
            done = preparer.result(prepared)  # re-raises a failed batch here
            done = expand(sink.samples, batch, done, variants)
            writing.append((len(batch), done, writer.submit(sink.write, done)))
            while len(writing) > WRITES_IN_FLIGHT:
                _account(stats, *writing.popleft(), dataset.name, progress)

        for batch in batches(rows, BATCH_ROWS):
            future = preparer.submit(batch, plan.max_context_len, stats.max_new_tokens, sink.turns)
            preparing.append((batch, future))
            while len(preparing) > preparer.ahead:
                write_oldest()
        while preparing:
            write_oldest()
        while writing:
            _account(stats, *writing.popleft(), dataset.name, progress)
    if source.broken is not None:
        raise InputError(f"{source.broken}; {_what_is_stored(dataset, stats, sink)}")


class UntilBroken:
    """A reader's rows up to where its file breaks. The break is kept in ``broken`` instead
    of raised, so that the rows read before it are still prepared and stored."""

    def __init__(self, rows: Iterable[RawRow]) -> None:
        self._rows = rows
        self.broken: InputError | None = None

    def __iter__(self) -> Iterator[RawRow]:
        try:
            yield from self._rows
        except InputError as exc:
            self.broken = exc


def _what_is_stored(dataset: DatasetPlan, stats: DatasetStats, sink: Sink) -> str:
    """What an enqueue that stops at a broken file leaves behind, and how to finish it."""
    if isinstance(sink, DrySink):
        return f"dry run: {stats.rows:,} rows before it were read, nothing is stored"
    return (
        f"{stats.accepted:,} new job(s) of dataset {dataset.name!r} from the {stats.rows:,} "
        "rows before it are stored and queued (and every dataset before it); fix the file "
        "and run the same enqueue again: it adds only what is missing"
    )


def _account(
    stats: DatasetStats,
    rows: int,
    prepared: Prepared,
    written: Future[Written],
    dataset: str,
    progress: Progress | None,
) -> None:
    done = written.result()  # re-raises a failed write here, in the caller's thread
    new = done.jobs
    stats.rows += rows
    stats.accepted += new
    # With several samples a row adds several jobs: a row counts as a duplicate only when
    # the batch added nothing.
    stats.duplicates += max(0, rows - len(prepared.rejections) - new)
    stats.rejected_by_reason.update(r.reason for r in prepared.rejections)
    stats.prompt_lengths.extend(prepared.jobs.prompt_tokens)
    stats.prompt_lengths.extend(c.prompt_tokens for c in prepared.conversations)
    stats.conversations += done.conversations
    stats.conversation_turns += done.conversation_turns
    stats.conversation_points.extend(c.points for c in prepared.conversations)
    # Prompt tokens of new jobs only matter for the 'total' basis; when some were
    # duplicates, count the batch's share.
    stats.accepted_prompt_tokens += _new_share(
        prepared.jobs.prompt_tokens, new - done.conversations
    ) + _new_share([c.prompt_tokens for c in prepared.conversations], done.conversations)
    if progress is not None:
        progress(dataset, rows)


def _new_share(prompt_tokens: Sequence[int], new: int) -> int:
    if not prompt_tokens:
        return 0
    return round(sum(prompt_tokens) * new / len(prompt_tokens))


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
