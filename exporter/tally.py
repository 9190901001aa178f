"""What an export read, exported and removed, per dataset: the manifest's ``counts``.

``read`` and ``removed`` count generations (turns); ``exported`` counts rows, and a merged
or whole conversation is one row of several turns (``conversations`` says how many).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.merge import Plan
from exporter.rows import REMOVALS

DATASETS = "datasets"  # what --datasets removed: every done job of a dataset left out


def _added(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted({*a, *b})}


@dataclass
class ConversationTally:
    """One dataset's conversations read whole (``--merge-turns``, ``--format
    conversations``): how many became one row, and the turns of the others by why they
    stayed one row per turn (``exporter.merge.UNMERGED``)."""

    read: int = 0
    merged: int = 0
    merged_turns: int = 0
    unmerged: dict[str, int] = field(default_factory=dict)  # conversations, by reason
    unmerged_turns: dict[str, int] = field(default_factory=dict)  # their kept turns

    def count(self, decided: Plan, *, written: bool) -> None:
        """Count one conversation read, as ``decided``; ``written``: a row of it was (a
        merged row may still be removed, by --max-len or the round trip)."""
        self.read += 1
        if decided.merged and written:
            self.merged += 1
            self.merged_turns += len(decided.merged)
        elif decided.reason is not None:
            self.unmerged[decided.reason] = self.unmerged.get(decided.reason, 0) + 1
            turns = self.unmerged_turns.get(decided.reason, 0) + len(decided.apart)
            self.unmerged_turns[decided.reason] = turns

    def document(self) -> dict[str, Any]:
        """As the manifest writes it."""
        return {
            "read": self.read,
            "merged": self.merged,
            "merged_turns": self.merged_turns,
            "unmerged": dict(sorted(self.unmerged.items())),
            "unmerged_turns": dict(sorted(self.unmerged_turns.items())),
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> ConversationTally:
        """Inverse of :meth:`document`."""
        return cls(
            read=int(doc["read"]),
            merged=int(doc["merged"]),
            merged_turns=int(doc["merged_turns"]),
            unmerged={str(k): int(v) for k, v in doc["unmerged"].items()},
            unmerged_turns={str(k): int(v) for k, v in doc["unmerged_turns"].items()},
        )

    def add(self, other: ConversationTally) -> None:
        """Add ``other``'s counts to these."""
        self.read += other.read
        self.merged += other.merged
        self.merged_turns += other.merged_turns
        self.unmerged = _added(self.unmerged, other.unmerged)
        self.unmerged_turns = _added(self.unmerged_turns, other.unmerged_turns)


@dataclass
class DatasetTally:
    """One dataset's counts."""

    read: int = 0
    exported: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOVALS, 0))
    cut: int = 0  # exported, but cut to --max-len
    longest: int = 0  # ids in the longest exported row (what a trainer's max length must hold)
    conversations: ConversationTally | None = None  # only when conversations are read whole

    def document(self) -> dict[str, Any]:
        """As the manifest writes it."""
        doc = {
            "read": self.read,
            "exported": self.exported,
            "splits": dict(sorted(self.splits.items())),
            "removed": dict(self.removed),
            "cut_to_max_len": self.cut,
            "longest_row": self.longest,
        }
        if self.conversations is not None:
            doc["conversations"] = self.conversations.document()
        return doc

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> DatasetTally:
        """Inverse of :meth:`document`."""
        removed = dict.fromkeys(REMOVALS, 0) | {str(k): int(v) for k, v in doc["removed"].items()}
        conversations = doc.get("conversations")
        return cls(
            read=int(doc["read"]),
            exported=int(doc["exported"]),
            splits={str(k): int(v) for k, v in doc["splits"].items()},
            removed=removed,
            cut=int(doc["cut_to_max_len"]),
            longest=int(doc.get("longest_row", 0)),
            conversations=None
            if conversations is None
            else ConversationTally.from_document(conversations),
        )

    def add(self, other: DatasetTally) -> None:
        """Add ``other``'s counts to these."""
        self.read += other.read
        self.exported += other.exported
        self.cut += other.cut
        self.longest = max(self.longest, other.longest)
        for split, n in other.splits.items():
            self.splits[split] = self.splits.get(split, 0) + n
        for reason, n in other.removed.items():
            self.removed[reason] = self.removed.get(reason, 0) + n
        if other.conversations is not None:
            if self.conversations is None:
                self.conversations = ConversationTally()
            self.conversations.add(other.conversations)


class Tally:
    """Counts of every dataset an export read."""

    def __init__(self) -> None:
        self.datasets: dict[str, DatasetTally] = {}

    def of(self, dataset: str) -> DatasetTally:
        """The counts of ``dataset`` (zero when it has none yet)."""
        return self.datasets.setdefault(dataset, DatasetTally())

    def exported(
        self, dataset: str, split: str, *, cut: bool, length: int = 0, turns: int = 1
    ) -> None:
        """Count one exported row of ``length`` ids, made of ``turns`` generations."""
        counts = self.of(dataset)
        counts.longest = max(counts.longest, length)
        counts.read += turns
        counts.exported += 1
        counts.splits[split] = counts.splits.get(split, 0) + 1
        counts.cut += cut

    def removed(self, dataset: str, reason: str, turns: int = 1) -> None:
        """Count ``turns`` generations a filter removed (one row's)."""
        counts = self.of(dataset)
        counts.read += turns
        counts.removed[reason] = counts.removed.get(reason, 0) + turns

    def conversations(self, dataset: str) -> ConversationTally:
        """The conversation counts of ``dataset`` (zero when it has none yet)."""
        counts = self.of(dataset)
        if counts.conversations is None:
            counts.conversations = ConversationTally()
        return counts.conversations

    @property
    def rows(self) -> int:
        """Rows exported, all datasets."""
        return sum(c.exported for c in self.datasets.values())

    def merged(self, other: Tally) -> Tally:
        """A new tally of both."""
        merged = Tally()
        for tally in (self, other):
            for name, counts in tally.datasets.items():
                merged.of(name).add(counts)
        return merged

    def document(self, excluded: dict[str, int] | None = None) -> dict[str, Any]:
        """Per dataset, as the manifest writes it; ``excluded``: the done jobs of each
        dataset --datasets left out."""
        doc = {name: c.document() for name, c in sorted(self.datasets.items())}
        for name, done in sorted((excluded or {}).items()):
            doc[name] = DatasetTally().document() | {"removed": {DATASETS: done}}
        return doc

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Tally:
        """The tally of an earlier manifest (datasets --datasets left out are not counted:
        their entry is rewritten from the database on every export)."""
        tally = cls()
        for name, counts in doc.items():
            if DATASETS not in counts["removed"]:
                tally.datasets[name] = DatasetTally.from_document(counts)
        return tally
