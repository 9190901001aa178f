"""The manifest (``manifest.json`` next to the shards): what was exported, from what, how.

It is the list of an export's shards: a trainer reads the shards it names (a shard renamed
into place by an export that was killed before it wrote its manifest is in none). It also
holds where an incremental export resumes (``resume``): every generation recorded at or
after ``since`` whose id is not in ``seen``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from exporter.roundtrip import RoundTrips
from exporter.rows import Filters
from exporter.tally import Tally
from exporter.writers import Shard
from models.records import ExportCursor, ExportRun

MANIFEST = "manifest.json"
TOKENS = "tokens"
CONVERSATIONS = "conversations"
FORMATS = (TOKENS, CONVERSATIONS)
VERSION = 1
# The options an incremental export must share with the export it extends, by the flag
# that sets each: rows of two settings in one folder would be one data set of neither.
FLAGS = {
    "writer": "--jsonl/--hf-dataset",
    "datasets": "--datasets",
    "exclude_truncated": "--exclude-truncated",
    "min_completion_tokens": "--min-completion-tokens",
    "max_len": "--max-len",
    "only_valid": "--only-valid",
    "require_exact": "--require-exact",
    "style": "--style",
    "val_fraction": "--val-fraction",
    "seed": "--seed",
}


@dataclass(frozen=True)
class Options:
    """What shapes the rows of an export."""

    writer: str
    filters: Filters = field(default_factory=Filters)
    val_fraction: float = 0.0
    seed: int = 0
    format: str = TOKENS
    style: str | None = None  # conversations only: exporter.conversations.STYLES

    def document(self) -> dict[str, Any]:
        """As the manifest writes it (keys as in :data:`FLAGS`)."""
        datasets = self.filters.datasets
        return {
            "writer": self.writer,
            "datasets": None if datasets is None else sorted(datasets),
            "exclude_truncated": self.filters.exclude_truncated,
            "min_completion_tokens": self.filters.min_completion_tokens,
            "max_len": self.filters.max_len,
            "only_valid": self.filters.only_valid,
            "require_exact": self.filters.require_exact,
            "style": self.style,
            "val_fraction": self.val_fraction,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Previous:
    """What an earlier export of a folder left in its manifest."""

    document: dict[str, Any]
    shards: list[Shard]
    tally: Tally
    since: datetime
    seen: dict[int, datetime]
    roundtrip: RoundTrips = field(default_factory=RoundTrips)

    def cursor(self) -> ExportCursor:
        """Where the next export resumes."""
        return ExportCursor(self.since, frozenset(self.seen))


def read_manifest(out: Path) -> Previous | None:
    """The manifest in ``out``, or None if there is none (a ValueError if unreadable)."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes())
        resume = doc["resume"]
        return Previous(
            document=doc,
            shards=[Shard(**s) for s in doc["shards"]],
            tally=Tally.from_document(doc["counts"]),
            since=datetime.fromisoformat(resume["since"]),
            seen={int(i): datetime.fromisoformat(t) for i, t in resume["seen"]},
            roundtrip=RoundTrips.from_document(doc.get("roundtrip") or {}),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not an eaglegen export manifest ({exc})") from exc


def check_extends(previous: Previous, run: ExportRun, options: Options) -> None:
    """A ValueError unless an export of ``run`` with ``options`` may extend ``previous``."""
    doc = previous.document
    if doc.get("format") != options.format or doc.get("run", {}).get("name") != run.name:
        raise ValueError(
            f"the folder holds an export of run {doc.get('run', {}).get('name')!r} "
            f"({doc.get('format')!r} format), not of {run.name!r} ({options.format!r}): "
            "choose another folder"
        )
    if doc["run"].get("tokenizer_sha256") != run.tokenizer_sha256:
        raise ValueError("the folder's export was tokenized differently: choose another folder")
    before, now = doc.get("options", {}), options.document()
    # An option a manifest predates was off when it was written.
    differs = [
        f"{FLAGS[k]} was {before.get(k, _OFF.get(k))!r}, now {v!r}"
        for k, v in now.items()
        if before.get(k, _OFF.get(k)) != v
    ]
    if differs:
        raise ValueError(
            "an incremental export keeps the options of the export it extends: "
            + "; ".join(differs)
        )


_OFF: dict[str, Any] = {"only_valid": False, "require_exact": False, "style": None}
_COLUMNS = {
    TOKENS: {
        "input_ids": "prompt ids then output ids, as generated (cut to max_len if set)",
        "loss_mask": "0 over the prompt, 1 over every generated token, stop token included",
    },
    CONVERSATIONS: {
        "assistant": "the last turn, decoded from the exact output ids: reasoning_content "
        "before the think-end token, content after it, tool_calls from the tool-call sections",
        "metadata.roundtrip_exact": "the run's chat template re-applied to the row gives the "
        "recorded prompt + output ids exactly",
    },
}


def manifest_document(
    *,
    run: ExportRun,
    options: Options,
    version: str,
    tally: Tally,
    excluded: dict[str, int],
    shards: list[Shard],
    passes: list[dict[str, Any]],
    since: datetime,
    seen: dict[int, datetime],
    roundtrip: RoundTrips | None = None,
    template_matches_run: bool | None = None,
) -> dict[str, Any]:
    """The manifest's document; ``roundtrip`` for conversations."""
    document: dict[str, Any] = {
        "format": options.format,
        "manifest_version": VERSION,
        "eaglegen_version": version,
        "run": {
            "name": run.name,
            "model": run.model_name,
            "tokenizer_path": run.tokenizer_path,
            "tokenizer_sha256": run.tokenizer_sha256,
            "chat_template_sha256": run.chat_template_sha256,
            "chat_template_kwargs": run.chat_template_kwargs,
            "think_end_id": run.think_end_id,
            "template_matches_run": template_matches_run,
        },
        "sampling": {name: params for name, params in sorted(run.sampling.items())},
        "options": options.document(),
        "columns": _COLUMNS[options.format],
        "rows": tally.rows,
        "counts": tally.document(excluded),
        "shards": [s.document() for s in shards],
        "passes": passes,
        "resume": {
            "since": since.isoformat(),
            "seen": [[i, t.isoformat()] for i, t in sorted(seen.items())],
        },
    }
    if roundtrip is not None:
        document["roundtrip"] = roundtrip.document()
    return document


def encode(document: dict[str, Any]) -> bytes:
    """The manifest's bytes."""
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode()
