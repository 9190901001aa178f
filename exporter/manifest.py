"""The manifest (``manifest.json`` next to the shards): what was exported, from what, how.

It is the list of an export's shards: a trainer reads the shards it names (a shard renamed
into place by an export that was killed before it wrote its manifest is in none). It also
holds where an incremental export resumes (``resume``): every generation recorded at or
after ``since`` whose id is not in ``seen``, and, for an export of whole conversations,
every conversation that reached its final state at or after ``since`` and is not in
``conversations``.

A manifest is read as a file in OUT, never through a link, and the shard names it lists
(and its passes list) must be plain names in OUT: an incremental export carries them into
the manifest it writes, so one naming ``../x`` would send a trainer out of the folder.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from exporter.folder import MANIFEST as MANIFEST  # where it always was, for importers
from exporter.layouts import CONVERSATIONS, HF, TOKENS
from exporter.roundtrip import RoundTrips
from exporter.rows import Filters
from exporter.split import TRAIN, VAL
from exporter.tally import Tally
from exporter.writers import Shard
from models.records import ExportCursor, ExportRun

FORMATS = (TOKENS, CONVERSATIONS)
# 4: rows carry their prompt's sample and variant (core.samples); 3: a token row's id is a
# string (a conversation's turn is "<conversation>_turn<t>"), and conversations are exported
# by conversation; 2: each split in a folder of its own (1 put the shards beside the
# manifest). Rows of two versions in one folder would not load as one data set.
VERSION = 4
# The options an incremental export must share with the export it extends, by the flag
# that sets each: rows of two settings in one folder would be one data set of neither.
FLAGS = {
    "for": "--for",
    "writer": "--jsonl/--hf-dataset",
    "datasets": "--datasets",
    "exclude_truncated": "--exclude-truncated",
    "min_completion_tokens": "--min-completion-tokens",
    "samples_per_prompt": "--samples-per-prompt",
    "max_len": "--max-len",
    "only_valid": "--only-valid",
    "require_exact": "--require-exact",
    "merge_turns": "--merge-turns",
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
    consumer: str = HF  # ``--for``: exporter.layouts.CONSUMERS
    # Tokens only: a prefix-consistent conversation as one row (exporter.merge).
    merge_turns: bool = False

    def __post_init__(self) -> None:
        if self.merge_turns and self.format != TOKENS:
            raise ValueError(
                "--merge-turns merges token rows: --format conversations already writes "
                "each conversation whole"
            )

    @property
    def whole_conversations(self) -> bool:
        """Whether conversations are read whole, once in a final state (merged token rows,
        or conversation rows), rather than turn by turn as their turns are done."""
        return self.merge_turns or self.format == CONVERSATIONS

    def document(self) -> dict[str, Any]:
        """As the manifest writes it (keys as in :data:`FLAGS`)."""
        datasets = self.filters.datasets
        return {
            "for": self.consumer,
            "writer": self.writer,
            "datasets": None if datasets is None else sorted(datasets),
            "exclude_truncated": self.filters.exclude_truncated,
            "min_completion_tokens": self.filters.min_completion_tokens,
            "samples_per_prompt": self.filters.samples_per_prompt,
            "max_len": self.filters.max_len,
            "only_valid": self.filters.only_valid,
            "require_exact": self.filters.require_exact,
            "merge_turns": self.merge_turns,
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
    # Conversations read whole after ``since``, by id (``resume.conversations``).
    conversations: dict[int, datetime] = field(default_factory=dict)

    def cursor(self) -> ExportCursor:
        """Where the next export resumes."""
        return ExportCursor(self.since, frozenset(self.seen), frozenset(self.conversations))


def read_manifest(out: Path) -> Previous | None:
    """The manifest in ``out``, or None if there is none (a ValueError if unreadable, or
    if a shard it lists is not a plain name in ``out``)."""
    path = out / MANIFEST
    data = _read_file(path)
    if data is None:
        return None
    try:
        doc = json.loads(data)
        resume = doc["resume"]
        previous = Previous(
            document=doc,
            shards=[Shard(**s) for s in doc["shards"]],
            tally=Tally.from_document(doc["counts"]),
            since=datetime.fromisoformat(resume["since"]),
            seen={int(i): datetime.fromisoformat(t) for i, t in resume["seen"]},
            roundtrip=RoundTrips.from_document(doc.get("roundtrip") or {}),
            conversations={
                int(i): datetime.fromisoformat(t) for i, t in resume.get("conversations", [])
            },
        )
        if doc.get("manifest_version") != VERSION:
            raise ValueError(
                f"{path} is from an export of another layout (manifest_version "
                f"{doc.get('manifest_version')!r}, this eaglegen writes {VERSION}: each split "
                "in a folder of its own, row ids as strings): export into a new folder"
            )
        names = [s.file for s in previous.shards]
        for done in doc["passes"]:
            if not isinstance(done["shards"], list):
                raise TypeError(f"a pass lists shards as {done['shards']!r}")
            names += done["shards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not an eaglegen export manifest ({exc})") from exc
    for name in names:
        if not _in_folder(out, name):
            raise ValueError(
                f"{path} lists shard {name!r}, which is not a file name in {out} (an export "
                "writes only those): restore the manifest, or choose another folder"
            )
    return previous


def _read_file(path: Path) -> bytes | None:
    """``path``'s bytes if it is a file (None if it is missing); a ValueError if it is a
    link or something else: an export writes a file there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"{path} is a symbolic link, not a manifest an export wrote: choose another folder"
        ) from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a file: choose another folder")
        return handle.read()


def _in_folder(out: Path, name: object) -> bool:
    """Whether ``name`` is a split's folder in ``out`` or a plain name in one (a link on
    the way must stay in ``out``)."""
    if not isinstance(name, str) or "\0" in name or "\\" in name:
        return False
    parts = name.split("/")
    if parts[0] not in (TRAIN, VAL) or len(parts) > 2:
        return False
    if len(parts) == 2 and parts[1] in ("", ".", ".."):
        return False
    if os.altsep and os.altsep in name:
        return False
    path = out / name
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(out))


def merge_shards(before: list[Shard], new: list[Shard]) -> list[Shard]:
    """The shards of an export extended by a pass that wrote ``new``: a whole split's file
    written again replaces its entry, in place."""
    files = {s.file: s for s in new}
    merged = [files.pop(s.file, s) for s in before]
    return merged + [s for s in new if s.file in files]


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


_OFF: dict[str, Any] = {
    "samples_per_prompt": None,
    "only_valid": False,
    "require_exact": False,
    "merge_turns": False,
    "style": None,
}
_COLUMNS = {
    TOKENS: {
        "id": "the job id; a conversation's turn: <conversation>_turn<t>; its turns 0 to t "
        "merged (--merge-turns): <conversation>_turn0-<t>; in a dataset of several samples "
        "or variants, the job (conversation) is <prompt>_gen<k>: its sample 0's id and k",
        "sample": "which of its prompt's samples the row is (0 unless the dataset has several)",
        "variant": "the sampling variant it was generated with (null: the dataset's sampling)",
        "input_ids": "prompt ids then output ids, as generated (cut to max_len if set); a "
        "merged row: its last turn's",
        "loss_mask": "0 over the prompt, 1 over every generated token, stop token included; a "
        "merged row: 1 over every turn's output, 0 over everything else",
        "turns": "the turns whose output the row trains (1 unless merged)",
    },
    CONVERSATIONS: {
        "assistant": "the last turn, decoded from the exact output ids: reasoning_content "
        "before the think-end token, content after it, tool_calls from the tool-call sections; "
        "a conversation's row holds every turn so decoded, its id <conversation>_turn0-<t>",
        "metadata.roundtrip_exact": "the run's chat template re-applied to the row gives the "
        "recorded prompt + output ids exactly, or exactly but for what the template writes "
        "after the turn's stop token (roundtrip.DATASET.exact_up_to_turn_suffix counts those)",
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
    seen_conversations: dict[int, datetime] | None = None,
    under_way: dict[str, int] | None = None,
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
            # The model family whose layout the rows were read by (None: detected, not recorded).
            "family": run.family,
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
            "conversations": [
                [i, t.isoformat()] for i, t in sorted((seen_conversations or {}).items())
            ],
        },
    }
    if under_way is not None:
        # Done turns left for a later pass: their conversation was still under way.
        document["conversation_turns_under_way"] = dict(sorted(under_way.items()))
    if roundtrip is not None:
        document["roundtrip"] = roundtrip.document()
    return document


def encode(document: dict[str, Any]) -> bytes:
    """The manifest's bytes."""
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode()
