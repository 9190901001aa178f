"""What an export read, exported and removed, per dataset: the manifest's ``counts``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exporter.rows import REMOVALS

DATASETS = "datasets"  # what --datasets removed: every done job of a dataset left out


@dataclass
class DatasetTally:
    """One dataset's counts."""

    read: int = 0
    exported: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOVALS, 0))
    cut: int = 0  # exported, but cut to --max-len
    longest: int = 0  # ids in the longest exported row (what a trainer's max length must hold)

    def document(self) -> dict[str, Any]:
        """As the manifest writes it."""
        return {
            "read": self.read,
            "exported": self.exported,
            "splits": dict(sorted(self.splits.items())),
            "removed": dict(self.removed),
            "cut_to_max_len": self.cut,
            "longest_row": self.longest,
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> DatasetTally:
        """Inverse of :meth:`document`."""
        removed = dict.fromkeys(REMOVALS, 0) | {str(k): int(v) for k, v in doc["removed"].items()}
        return cls(
            read=int(doc["read"]),
            exported=int(doc["exported"]),
            splits={str(k): int(v) for k, v in doc["splits"].items()},
            removed=removed,
            cut=int(doc["cut_to_max_len"]),
            longest=int(doc.get("longest_row", 0)),
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


class Tally:
    """Counts of every dataset an export read."""

    def __init__(self) -> None:
        self.datasets: dict[str, DatasetTally] = {}

    def of(self, dataset: str) -> DatasetTally:
        """The counts of ``dataset`` (zero when it has none yet)."""
        return self.datasets.setdefault(dataset, DatasetTally())

    def exported(self, dataset: str, split: str, *, cut: bool, length: int = 0) -> None:
        """Count one exported row of ``length`` ids."""
        counts = self.of(dataset)
        counts.longest = max(counts.longest, length)
        counts.read += 1
        counts.exported += 1
        counts.splits[split] = counts.splits.get(split, 0) + 1
        counts.cut += cut

    def removed(self, dataset: str, reason: str) -> None:
        """Count one row a filter removed."""
        counts = self.of(dataset)
        counts.read += 1
        counts.removed[reason] = counts.removed.get(reason, 0) + 1

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
