"""One export pass: stream the run's done generations, filter, split, write shards, then
the manifest.

Incremental exports resume by time and id. A generation's ``created_at`` is the start of
the transaction that recorded it (Postgres's ``now()``), and it becomes visible only at
commit, in any order; so a pass cannot say "everything up to time T". It can say so for
``T - RESUME_MARGIN``: a worker's session is ended by Postgres after 5 s idle inside a
transaction or waiting on a lock (``models.db.make_engine``'s hold limit), so a recording
transaction that commits at all commits within seconds of its start, and every generation
stamped before the pass's start minus the margin had committed when the pass read. The
manifest records that time (``resume.since``) and the ids of the rows it read that were
stamped after it (``resume.seen``: only those of the last minutes before the pass); the
next pass reads what is stamped at or after ``since`` and is not seen. A list of every
exported id would grow with the run; a job id watermark would miss jobs recorded late
(jobs are recorded out of id order: retries, many workers).

Conversations read whole (``--merge-turns``, ``--format conversations``) are read once in a
final state, done or ended: a conversation still under way is left out of the pass (the
manifest counts its done turns under ``conversation_turns_under_way``) and a later
incremental pass exports it whole. They resume the same way, by the time a conversation
reached its final state (``resume.since``) and the conversations read after it
(``resume.conversations``). A conversation that ended on a failed or skipped turn and is
taken up again afterwards (that turn queued again by ``eaglegen requeue`` or a raised
budget) reaches a final state a second time, and a later incremental pass exports it again,
whole: the rows of its first end stay in the shards written before.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from exporter.folder import MANIFEST, USAGE, Workspace, leftovers
from exporter.layouts import CONVERSATIONS, whole_name
from exporter.manifest import (
    Options,
    Previous,
    check_extends,
    encode,
    manifest_document,
    merge_shards,
    read_manifest,
)
from exporter.roundtrip import RoundTrips
from exporter.rows import TokenRow, select_row
from exporter.shaping import ConversationShaper, ValidityCheck
from exporter.split import TRAIN, VAL, split_key, split_of
from exporter.tally import Tally
from exporter.tokenizer import RunTokenizer, for_run, run_stop_ids
from exporter.usage import how_to_load
from exporter.whole import MergedTokens, Outcome
from exporter.writers import Row, Shard, SplitWriter
from models.export import ExportedConversation, PromptedGeneration
from models.records import ExportedGeneration, ExportRun
from models.repository import Repository

# Far above the seconds a recording transaction can take (see above).
RESUME_MARGIN = timedelta(minutes=5)
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ExportRequest:
    """What `eaglegen export` was asked for."""

    run: str
    out: Path
    options: Options
    shard_bytes: int
    incremental: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.shard_bytes < 1:
            raise ValueError("--shard-mb must be above 0")


@dataclass(frozen=True)
class ExportResult:
    """A finished pass: its new shards and counts, and the manifest as written."""

    shards: list[Shard]
    tally: Tally
    manifest: dict[str, Any]
    roundtrip: RoundTrips | None = None  # this pass's, for conversations
    # What an export that did not finish had left in the folder, removed by this one.
    removed: list[str] = field(default_factory=list)
    usage: str = ""  # how to load the export (written to how-to-load.txt)


def prepare(repo: Repository, request: ExportRequest) -> tuple[ExportRun, Previous | None, int]:
    """The run, the previous export in the folder (incremental), and how many rows this
    pass will read at most: or a ValueError saying why the export cannot start."""
    run = repo.export_run(request.run)
    if run is None:
        raise ValueError(f"run {request.run!r} not found (`eaglegen status` lists the runs)")
    wanted = request.options.filters.datasets
    unknown = sorted(set(wanted or ()) - set(run.sampling))
    if unknown:
        raise ValueError(
            f"run {run.name!r} has no dataset {', '.join(map(repr, unknown))} "
            f"(it has {', '.join(map(repr, sorted(run.sampling))) or 'none'})"
        )
    previous = _previous(request, run)
    done = repo.done_counts(run.id)
    selected = [d for d in done if wanted is None or d in wanted]
    before = {} if previous is None else previous.tally.datasets
    already = sum(before[d].read for d in selected if d in before)
    return run, previous, max(sum(done[d] for d in selected) - already, 0)


def needs_tokenizer(options: Options) -> bool:
    """Whether the export decodes: conversations always, tokens under --only-valid."""
    return options.format == CONVERSATIONS or options.filters.only_valid


def load_tokenizer(run: ExportRun, request: ExportRequest) -> RunTokenizer | None:
    """The run's tokenizer when the export needs one (a ValueError naming why it cannot)."""
    if not needs_tokenizer(request.options):
        return None
    return for_run(run, trust_remote_code=request.trust_remote_code)


def _previous(request: ExportRequest, run: ExportRun) -> Previous | None:
    out = request.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder: choose a folder for the export")
    _check_writable(out)
    previous = read_manifest(out) if out.is_dir() else None
    if previous is None:
        if out.is_dir():
            leftovers(out)  # only what a killed export leaves: the pass removes it
        return None
    if not request.incremental:
        raise ValueError(
            f"{out} already holds an export ({MANIFEST}): pass --incremental to add the rows "
            "generated since, or choose another folder"
        )
    check_extends(previous, run, request.options)
    return previous


def _check_writable(out: Path) -> None:
    """A ValueError unless the export can create files in ``out`` (or create ``out``)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{out}: cannot write there ({existing} is not writable)")


# One generation of the scan in, its row (or the filter that removed it) out.
Shape = Callable[[Any], tuple[ExportedGeneration, Row | str]]
# One conversation read whole in, its rows and removals out.
ShapeWhole = Callable[[ExportedConversation], Outcome]


@dataclass
class _Scan:
    started_at: datetime
    rows: Iterator[Any]
    conversations: Iterator[ExportedConversation]


def run_export(
    repo: Repository,
    request: ExportRequest,
    run: ExportRun,
    previous: Previous | None,
    progress: Progress | None = None,
    tokenizer: RunTokenizer | None = None,
) -> ExportResult:
    """Export the rows ``previous`` lacks (all, without one) and write the manifest."""
    if tokenizer is None:
        tokenizer = load_tokenizer(run, request)
    with Workspace(request.out, first=previous is None) as folder:
        return _write(repo, request, run, previous, folder, progress, tokenizer)


def _write(
    repo: Repository,
    request: ExportRequest,
    run: ExportRun,
    previous: Previous | None,
    folder: Workspace,
    progress: Progress | None,
    tokenizer: RunTokenizer | None,
) -> ExportResult:
    """The pass in ``folder``: the shards, then the manifest."""
    options = request.options
    before = {} if previous is None else {s.file: s for s in previous.shards}
    writers = {
        split: SplitWriter(
            folder,
            split,
            options.writer,
            request.shard_bytes,
            before.get(whole_name(options.writer, split)),
            options.seed,
        )
        for split in (TRAIN, VAL)
    }
    tally = Tally()
    trips = RoundTrips() if options.format == CONVERSATIONS else None
    shape, whole = _shapers(run, options, tokenizer, trips)
    cursor = None if previous is None else previous.cursor()
    seen = {} if previous is None else dict(previous.seen)
    seen_whole = {} if previous is None else dict(previous.conversations)
    try:
        with _scan(repo, run.id, options, cursor, prompted=tokenizer is not None) as scan:
            since = scan.started_at - RESUME_MARGIN
            if previous is not None:
                since = max(since, previous.since)  # never back: the seen ids would not cover
            for item in scan.rows:
                gen = _export_one(item, shape, options, writers, tally)
                if gen.created_at >= since:
                    seen[gen.job_id] = gen.created_at
                if progress is not None:
                    progress(1)
            for conversation in scan.conversations:
                assert whole is not None, "conversations are read whole only with a shaper"
                _export_whole(conversation, whole, options, writers, tally)
                if conversation.updated_at >= since:
                    seen_whole[conversation.id] = conversation.updated_at
                if progress is not None:
                    progress(len(conversation.turns))
            shards = [s for w in writers.values() for s in w.finish()]
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    seen = {i: t for i, t in seen.items() if t >= since}
    seen_whole = {i: t for i, t in seen_whole.items() if t >= since}
    context = _Context(
        run, request, previous, tally, shards, since, seen, scan.started_at, seen_whole
    )
    document = _manifest(repo, context, trips, tokenizer)
    usage = how_to_load(request.out, options, document)
    folder.write(USAGE, usage.encode())
    folder.write(MANIFEST, encode(document))
    return ExportResult(shards, tally, document, trips, folder.removed, usage)


@contextmanager
def _scan(
    repo: Repository, run_id: int, options: Options, cursor: Any, *, prompted: bool
) -> Iterator[_Scan]:
    """The repository's stream: with each job's prompt when the rows are decoded."""
    datasets = options.filters.datasets
    whole = options.whole_conversations
    if prompted:
        with repo.prompted_scan(run_id, datasets, cursor, whole=whole) as pscan:
            yield _Scan(pscan.started_at, pscan.rows, pscan.conversations)
    else:
        with repo.export_scan(run_id, datasets, cursor, whole=whole) as tscan:
            yield _Scan(tscan.started_at, tscan.rows, tscan.conversations)


def _shapers(
    run: ExportRun, options: Options, tokenizer: RunTokenizer | None, trips: RoundTrips | None
) -> tuple[Shape, ShapeWhole | None]:
    """How a generation becomes a row, and how a conversation read whole becomes rows (None
    unless conversations are read whole)."""
    merged = MergedTokens(options.filters) if options.merge_turns else None
    if tokenizer is None:
        return (lambda gen: (gen, select_row(gen, options.filters))), merged
    stops = run_stop_ids(run)  # the run's stored stop ids, never the tokenizer's again
    if trips is not None:
        shaper = ConversationShaper(options, tokenizer, trips, stops)
        return shaper, shaper.conversation
    check = ValidityCheck(tokenizer, stops)

    def tokens(item: PromptedGeneration) -> tuple[ExportedGeneration, Row | str]:
        gen = item.generation
        return gen, select_row(gen, options.filters, lambda: check(item))

    if options.merge_turns:
        merged = MergedTokens(options.filters, check)
    return tokens, merged


def _export_one(
    item: Any, shape: Shape, options: Options, writers: dict[str, SplitWriter], tally: Tally
) -> ExportedGeneration:
    gen, selected = shape(item)
    if isinstance(selected, str):
        tally.removed(gen.dataset, selected)
        return gen
    split = split_of(split_key(gen), options.seed, options.val_fraction)
    writers[split].add(selected)
    if isinstance(selected, TokenRow):
        cut, length = selected.cut, selected.seq_len
    else:  # a conversation, kept whole: a trainer cutting at --max-len cuts it
        length = (len(gen.prompt_packed) + len(gen.output_packed)) // 4
        max_len = options.filters.max_len
        cut = max_len is not None and length > max_len
    tally.exported(gen.dataset, split, cut=cut, length=length)
    return gen


def _export_whole(
    conversation: ExportedConversation,
    shape: ShapeWhole,
    options: Options,
    writers: dict[str, SplitWriter],
    tally: Tally,
) -> None:
    """Write a conversation read whole, every row of it in its conversation's split."""
    outcome = shape(conversation)
    dataset = conversation.dataset
    for reason, turns in outcome.removed:
        tally.removed(dataset, reason, turns)
    # Its turns' key: its own, or its sample 0's (a conversation read has a turn at least).
    split = split_of(
        split_key(conversation.turns[0].generation), options.seed, options.val_fraction
    )
    for written in outcome.rows:
        writers[split].add(written.row)
        tally.exported(dataset, split, cut=written.cut, length=written.length, turns=written.turns)
    tally.conversations(dataset).count(outcome.plan, written=bool(outcome.rows))


@dataclass(frozen=True)
class _Context:
    """What a pass knows at its end, for its manifest."""

    run: ExportRun
    request: ExportRequest
    previous: Previous | None
    tally: Tally
    shards: list[Shard]
    since: datetime
    seen: dict[int, datetime]
    started_at: datetime
    seen_conversations: dict[int, datetime]


def _manifest(
    repo: Repository, ctx: _Context, trips: RoundTrips | None, tokenizer: RunTokenizer | None
) -> dict[str, Any]:
    run, request, previous, tally, shards = (
        ctx.run,
        ctx.request,
        ctx.previous,
        ctx.tally,
        ctx.shards,
    )
    wanted = request.options.filters.datasets
    excluded = (
        {}
        if wanted is None
        else {d: n for d, n in repo.done_counts(run.id).items() if d not in wanted}
    )
    this_pass: dict[str, Any] = {
        "started_at": ctx.started_at.isoformat(),
        "rows": tally.rows,
        "shards": [s.file for s in shards],
        "counts": tally.document(),
    }
    if trips is not None:
        this_pass["roundtrip"] = trips.document()
        trips = trips if previous is None else previous.roundtrip.merged(trips)
    return manifest_document(
        run=run,
        options=request.options,
        version=importlib.metadata.version("eaglegen"),
        tally=tally if previous is None else previous.tally.merged(tally),
        excluded=excluded,
        shards=shards if previous is None else merge_shards(previous.shards, shards),
        passes=([] if previous is None else previous.document["passes"]) + [this_pass],
        since=ctx.since,
        seen=ctx.seen,
        roundtrip=trips,
        template_matches_run=None if tokenizer is None else tokenizer.template_matches_run,
        seen_conversations=ctx.seen_conversations,
        under_way=(
            repo.under_way_turns(run.id, wanted) if request.options.whole_conversations else None
        ),
    )
