"""The round trip of a conversation: re-templated and re-encoded, is it the recorded ids?

A conversation is only as good as the ids a trainer gets back from it: SpecForge and
Model-Optimizer re-apply the chat template to each row. Re-applying the run's template to the
prompt's messages plus the decoded assistant turn must give the recorded prompt + output ids
exactly. Where it does not, where it first differs tells why: in the prompt (the template
renders the history another way once an assistant turn follows, e.g. it strips earlier
reasoning) or in the output (it adds an empty think block, drops what the model wrote after
its calls, ends a turn the model never ended). ``text_equal`` separates a template that
writes other text from ids that are not the tokenizer's own encoding of their text (a model
may sample a split of a word the tokenizer would not make). Pure: ids and texts in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Ids of decoded context either side of the first difference.
CONTEXT_IDS = 8
# Differing rows kept per dataset as examples in the manifest.
EXAMPLES = 3
PROMPT, OUTPUT = "prompt", "output"


@dataclass(frozen=True)
class Check:
    """One row's round trip; the fields after ``exact`` describe the first difference."""

    exact: bool
    text_equal: bool = True
    position: int | None = None  # index into prompt + output ids
    part: str | None = None  # PROMPT or OUTPUT: where ``position`` falls
    recorded: str = ""  # decoded recorded ids around ``position``
    rendered: str = ""  # decoded re-rendered ids around ``position``
    error: str | None = None  # the template raised: nothing was rendered


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter's length when one is the
    other's prefix), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(
    recorded: Sequence[int],
    prompt_len: int,
    rendered_text: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
) -> Check:
    """Compare the recorded ids with ``rendered_text`` encoded."""
    rendered = encode(rendered_text)
    at = first_difference(recorded, rendered)
    if at is None:
        return Check(exact=True)
    lo, hi = max(at - CONTEXT_IDS, 0), at + CONTEXT_IDS
    return Check(
        exact=False,
        text_equal=decode(recorded) == rendered_text,
        position=at,
        part=PROMPT if at < prompt_len else OUTPUT,
        recorded=decode(recorded[lo:hi]),
        rendered=decode(rendered[lo:hi]),
    )


def failed(error: Exception) -> Check:
    """The round trip of a row the template refused to render."""
    return Check(exact=False, text_equal=False, error=f"{type(error).__name__}: {error}")


@dataclass
class DatasetRoundTrip:
    """One dataset's round trips: how many reproduce, and how the others differ."""

    checked: int = 0
    exact: int = 0
    text_equal: int = 0  # not exact, but the same text: the ids are not the canonical encoding
    differs_in: dict[str, int] = field(default_factory=lambda: {PROMPT: 0, OUTPUT: 0})
    template_errors: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, row_id: int, result: Check) -> None:
        """Count one row's round trip; keep the first few differing ones as examples."""
        self.checked += 1
        if result.exact:
            self.exact += 1
            return
        if result.error is not None:
            self.template_errors += 1
        elif result.text_equal:
            self.text_equal += 1
        if result.part is not None:
            self.differs_in[result.part] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(_example(row_id, result))

    def merge(self, other: DatasetRoundTrip) -> None:
        """Add ``other``'s counts (an incremental export's previous passes)."""
        self.checked += other.checked
        self.exact += other.exact
        self.text_equal += other.text_equal
        self.template_errors += other.template_errors
        for part, n in other.differs_in.items():
            self.differs_in[part] = self.differs_in.get(part, 0) + n
        self.examples = (self.examples + other.examples)[:EXAMPLES]

    def document(self) -> dict[str, Any]:
        """As the manifest writes it."""
        return {
            "checked": self.checked,
            "exact": self.exact,
            "exact_rate": round(self.exact / self.checked, 4) if self.checked else None,
            "same_text_other_ids": self.text_equal,
            "differs_in": dict(self.differs_in),
            "template_errors": self.template_errors,
            "examples": self.examples,
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> DatasetRoundTrip:
        """Inverse of :meth:`document`."""
        return cls(
            checked=int(doc["checked"]),
            exact=int(doc["exact"]),
            text_equal=int(doc["same_text_other_ids"]),
            differs_in={str(k): int(v) for k, v in doc["differs_in"].items()},
            template_errors=int(doc["template_errors"]),
            examples=list(doc["examples"]),
        )


def _example(row_id: int, result: Check) -> dict[str, Any]:
    return {
        "id": row_id,
        "position": result.position,
        "part": result.part,
        "same_text": result.text_equal,
        "recorded": result.recorded,
        "rendered": result.rendered,
        "error": result.error,
    }


class RoundTrips:
    """The round trips of every dataset an export read."""

    def __init__(self) -> None:
        self.datasets: dict[str, DatasetRoundTrip] = {}

    def add(self, dataset: str, row_id: int, result: Check) -> None:
        """Count one row's round trip."""
        self.datasets.setdefault(dataset, DatasetRoundTrip()).add(row_id, result)

    def merged(self, other: RoundTrips) -> RoundTrips:
        """A new tally of both."""
        merged = RoundTrips()
        for tally in (self, other):
            for name, counts in tally.datasets.items():
                merged.datasets.setdefault(name, DatasetRoundTrip()).merge(counts)
        return merged

    def document(self) -> dict[str, Any]:
        """Per dataset, as the manifest writes it."""
        return {name: c.document() for name, c in sorted(self.datasets.items())}

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> RoundTrips:
        """The round trips of an earlier manifest."""
        trips = cls()
        for name, counts in doc.items():
            trips.datasets[name] = DatasetRoundTrip.from_document(counts)
        return trips
