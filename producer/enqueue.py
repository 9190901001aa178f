"""Enqueue a dataset: read, validate, template, insert jobs, publish their ids."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from celery import Celery

from eaglegen.queue import publish
from models.records import DatasetSpec, NewJob, Rejection, RunSpec
from models.repository import Repository
from producer.rows import RawRow, RowError, read_jsonl, to_prompt
from producer.template import Templater, prompt_sha256

BATCH_ROWS = 512


@dataclass
class EnqueueSummary:
    """What one enqueue did to one dataset."""

    dataset: str
    accepted: int = 0
    rejected: int = 0
    duplicates: int = 0
    rejected_by_reason: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` shape."""
        return {
            "dataset": self.dataset,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "duplicates": self.duplicates,
            "rejected_by_reason": dict(self.rejected_by_reason),
        }


@dataclass(frozen=True)
class EnqueueRequest:
    """Which rows go into which run and dataset."""

    run: str
    dataset: str
    path: Path
    sampling_params: dict[str, Any]
    model_name: str | None = None
    budget_tokens: int | None = None


def enqueue(
    repo: Repository,
    app: Celery,
    queue: str,
    templater: Templater,
    request: EnqueueRequest,
    progress: Callable[[int], None] | None = None,
) -> EnqueueSummary:
    """Enqueue every row of ``request.path``; bad rows are recorded, never fatal."""
    run_id = repo.ensure_run(
        RunSpec(
            name=request.run,
            tokenizer_path=str(templater.path),
            tokenizer_sha256=templater.tokenizer_sha256(),
            chat_template_sha256=templater.chat_template_sha256(),
            model_name=request.model_name or templater.path.name,
        )
    )
    dataset_id = repo.ensure_dataset(
        run_id,
        DatasetSpec(
            name=request.dataset,
            source=str(request.path),
            sampling_params=request.sampling_params,
            budget_tokens=request.budget_tokens,
        ),
    )
    summary = EnqueueSummary(dataset=request.dataset)
    for batch in _batches(read_jsonl(request.path), BATCH_ROWS):
        jobs, rejections = _prepare(templater, batch)
        new_ids = repo.insert_jobs(dataset_id, jobs)
        repo.record_rejections(dataset_id, rejections)
        publish(app, new_ids, queue)
        summary.accepted += len(new_ids)
        summary.duplicates += len(batch) - len(rejections) - len(new_ids)
        summary.rejected += len(rejections)
        summary.rejected_by_reason.update(r.reason for r in rejections)
        if progress is not None:
            progress(len(batch))
    return summary


def _prepare(templater: Templater, batch: list[RawRow]) -> tuple[list[NewJob], list[Rejection]]:
    rejections: list[Rejection] = []
    rendered: list[tuple[RawRow, Any, str]] = []
    for raw in batch:
        try:
            if raw.error is not None:
                raise raw.error
            prompt = to_prompt(raw.value)
            rendered.append((raw, prompt, templater.render(prompt)))
        except RowError as err:
            rejections.append(Rejection(raw.index, err.reason, _excerpt(raw, err)))
    ids = templater.encode_batch([text for _, _, text in rendered])
    jobs: dict[str, NewJob] = {}
    for (raw, prompt, _), input_ids in zip(rendered, ids, strict=True):
        sha = prompt_sha256(input_ids)
        # A prompt repeated inside one batch is one job; the database dedups across batches.
        jobs.setdefault(sha, NewJob(raw.index, sha, input_ids, _messages_json(prompt)))
    return list(jobs.values()), rejections


def _messages_json(prompt: Any) -> dict[str, Any]:
    return {"messages": prompt.messages, "tools": prompt.tools}


def _excerpt(raw: RawRow, err: RowError) -> str:
    source = raw.excerpt or json.dumps(raw.value, ensure_ascii=False, default=str)
    return f"{err.detail} | {source[:200]}"


def _batches(rows: Iterable[RawRow], size: int) -> Iterator[list[RawRow]]:
    iterator = iter(rows)
    while batch := list(islice(iterator, size)):
        yield batch
