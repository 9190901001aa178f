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
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from exporter.files import write_atomically
from exporter.manifest import (
    MANIFEST,
    Options,
    Previous,
    check_extends,
    encode,
    manifest_document,
    read_manifest,
)
from exporter.rows import TokenRow, select_row
from exporter.split import TRAIN, VAL, split_of
from exporter.tally import Tally
from exporter.writers import Shard, SplitWriter
from models.export import ExportScan
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

    def __post_init__(self) -> None:
        if self.shard_bytes < 1:
            raise ValueError("--shard-mb must be above 0")


@dataclass(frozen=True)
class ExportResult:
    """A finished pass: its new shards and counts, and the manifest as written."""

    shards: list[Shard]
    tally: Tally
    manifest: dict[str, Any]


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


def _previous(request: ExportRequest, run: ExportRun) -> Previous | None:
    out = request.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder: choose a folder for the export")
    previous = read_manifest(out) if out.is_dir() else None
    if previous is None:
        if out.is_dir() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty and holds no {MANIFEST}: choose an empty folder")
        return None
    if not request.incremental:
        raise ValueError(
            f"{out} already holds an export ({MANIFEST}): pass --incremental to add the rows "
            "generated since, or choose another folder"
        )
    check_extends(previous, run, request.options)
    return previous


def run_export(
    repo: Repository,
    request: ExportRequest,
    run: ExportRun,
    previous: Previous | None,
    progress: Progress | None = None,
) -> ExportResult:
    """Export the rows ``previous`` lacks (all, without one) and write the manifest."""
    request.out.mkdir(parents=True, exist_ok=True)
    options = request.options
    writers = {
        split: SplitWriter(request.out, split, options.writer, request.shard_bytes)
        for split in (TRAIN, VAL)
    }
    tally = Tally()
    cursor = None if previous is None else previous.cursor()
    seen = {} if previous is None else dict(previous.seen)
    try:
        with repo.export_scan(run.id, options.filters.datasets, cursor) as scan:
            since = scan.started_at - RESUME_MARGIN
            if previous is not None:
                since = max(since, previous.since)  # never back: the seen ids would not cover
            for gen in scan.rows:
                _export_one(gen, options, writers, tally)
                if gen.created_at >= since:
                    seen[gen.job_id] = gen.created_at
                if progress is not None:
                    progress(1)
            shards = [s for w in writers.values() for s in w.finish()]
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    seen = {i: t for i, t in seen.items() if t >= since}
    document = _manifest(repo, run, request, previous, tally, shards, since, seen, scan)
    write_atomically(request.out / MANIFEST, encode(document))
    return ExportResult(shards, tally, document)


def _export_one(
    gen: ExportedGeneration, options: Options, writers: dict[str, SplitWriter], tally: Tally
) -> None:
    selected = select_row(gen, options.filters)
    if not isinstance(selected, TokenRow):
        tally.removed(gen.dataset, selected)
        return
    split = split_of(gen.job_id, options.seed, options.val_fraction)
    writers[split].add(selected)
    tally.exported(gen.dataset, split, cut=selected.cut)


def _manifest(
    repo: Repository,
    run: ExportRun,
    request: ExportRequest,
    previous: Previous | None,
    tally: Tally,
    shards: list[Shard],
    since: datetime,
    seen: dict[int, datetime],
    scan: ExportScan,
) -> dict[str, Any]:
    wanted = request.options.filters.datasets
    excluded = (
        {}
        if wanted is None
        else {d: n for d, n in repo.done_counts(run.id).items() if d not in wanted}
    )
    this_pass = {
        "started_at": scan.started_at.isoformat(),
        "rows": tally.rows,
        "shards": [s.file for s in shards],
        "counts": tally.document(),
    }
    return manifest_document(
        run=run,
        options=request.options,
        version=importlib.metadata.version("eaglegen"),
        tally=tally if previous is None else previous.tally.merged(tally),
        excluded=excluded,
        shards=([] if previous is None else previous.shards) + shards,
        passes=([] if previous is None else previous.document["passes"]) + [this_pass],
        since=since,
        seen=seen,
    )
