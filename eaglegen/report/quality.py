"""The figures of `eaglegen stats`, pure: what the SQL aggregates and the token-level
checks found, put together per dataset and for the run, with the warnings a user must see.

The checks are those the real run did by hand (background/case-study.txt): are answers
short because of a dataset or because of a cut; did reasoning close; do tool calls hold
together, parse, and call what the row declared.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from core.anatomy import Anatomy, ToolCall
from core.onpolicy import ANSWER, departure
from models.stats import (
    Aggregate,
    ConversationFigures,
    Histogram,
    Spread,
    StatsDataset,
    TurnLengths,
    VariantFigures,
)

# Bins of a completion-length histogram.
HISTOGRAM_BINS = 40
# A truncation share from which it is a warning (below, the table still shows it).
TRUNCATION_WARNING = 0.01
# Job ids kept per kind of problem, for `eaglegen show`.
EXAMPLES = 5
# What the report says of the tool calls of a family whose calls it cannot read.
NOT_CHECKED = "not checked"


def bin_width(largest: float | None, bins: int = HISTOGRAM_BINS) -> int:
    """The integer width that puts 0..``largest`` into at most ``bins`` bins."""
    return max(1, math.ceil((int(largest or 0) + 1) / bins))


def share(part: int, whole: int) -> float | None:
    """``part / whole``, None for an empty whole."""
    return part / whole if whole else None


def percent(value: float) -> str:
    """A share as a user reads it: ``23%``, ``2.3%``, ``0.41%``."""
    pct = value * 100
    if pct >= 10 or pct == 0:
        return f"{pct:.0f}%"
    return f"{pct:.1f}%" if pct >= 1 else f"{pct:.2g}%"


def declared_names(tools: Any) -> frozenset[str] | None:
    """The function names a row's tools declare (OpenAI ``{"function": {"name"}}`` entries
    or flat ``{"name"}`` ones), None when it declared no tools."""
    if not isinstance(tools, list):
        return None
    names = set()
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


@dataclass
class ToolFigures:
    """Tool-call integrity of the generations the token-level checks covered."""

    checked: int = 0  # generations looked at
    declared: int = 0  # of those, rows that declared tools
    with_calls: int = 0  # generations holding at least one call
    calls: int = 0
    unbalanced: int = 0  # generations that stopped with a section or call left open
    cut_in_section: int = 0  # generations cut at max_new_tokens inside a section
    # Of the generations that were not cut by length: calls whose arguments are not JSON,
    # and calls of a function the row did not declare.
    invalid_arguments: int = 0
    undeclared: int = 0
    examples: dict[str, list[int]] = field(default_factory=dict)

    def add(self, other: ToolFigures) -> None:
        """Sum ``other`` into this one (the run's figures from the datasets')."""
        for f in fields(self):
            if f.name != "examples":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for kind, ids in other.examples.items():
            self.note(kind, *ids)

    def note(self, kind: str, *job_ids: int) -> None:
        """Keep ``job_ids`` as examples of ``kind`` (the first EXAMPLES of them)."""
        kept = self.examples.setdefault(kind, [])
        kept.extend(job_ids[: max(0, EXAMPLES - len(kept))])

    def document(self) -> dict[str, Any]:
        """The JSON form."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["invalid_arguments_share"] = share(self.invalid_arguments, self.calls)
        return body


class ToolTally:
    """Accumulates the token-level checks per dataset, one generation at a time."""

    def __init__(self) -> None:
        self.datasets: dict[str, ToolFigures] = {}

    def add(
        self,
        dataset: str,
        job_id: int,
        anatomy: Anatomy,
        calls: Sequence[ToolCall],
        finish_type: str,
    ) -> None:
        """One generation holding a tool-call marker, dissected and its calls parsed."""
        figures = self.datasets.setdefault(dataset, ToolFigures())
        cut = finish_type == "length"
        if calls:
            figures.with_calls += 1
            figures.calls += len(calls)
        if not anatomy.sections_balanced:
            if cut:
                figures.cut_in_section += 1
            else:
                figures.unbalanced += 1
                figures.note("unbalanced", job_id)
        if cut:
            return  # a cut call's name and arguments are unfinished, not wrong
        invalid = sum(not c.arguments_json for c in calls)
        figures.invalid_arguments += invalid
        if invalid:
            figures.note("invalid_arguments", job_id)
        undeclared = sum(c.declared is not True for c in calls)
        figures.undeclared += undeclared
        if undeclared:
            figures.note("undeclared", job_id)

    def figures(self, dataset: str, scope: tuple[int, int]) -> ToolFigures:
        """The dataset's figures, with (generations checked, of them declaring tools)."""
        found = self.datasets.get(dataset, ToolFigures())
        found.checked, found.declared = scope
        return found


@dataclass(frozen=True)
class TokenChecks:
    """Which generations the token-level checks covered."""

    sample: int | None  # the seeded sample's size; None: every generation
    seed: int
    checked: int
    # False: the run's family's calls cannot be read (an unknown family, or a vocabulary
    # without its call tokens): tool calls were not checked.
    tool_markers: bool

    def document(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "sample": self.sample,
            "seed": self.seed,
            "generations": self.checked,
            "tool_markers": self.tool_markers,
        }


@dataclass(frozen=True)
class Figures:
    """Everything the report says about one dataset (``name`` None: the whole run)."""

    name: str | None
    jobs: dict[str, int]
    max_new_tokens: int | None
    sql: Aggregate
    finishes: dict[str, int]
    histogram: Histogram
    tools: ToolFigures | None  # None: nothing to check, or not checked (below)
    calls_checked: bool = True  # False: the family's calls are not read ("not checked")

    @property
    def truncated_share(self) -> float | None:
        """Share of generations cut at max_new_tokens."""
        return share(self.sql.at_max_new, self.sql.generations)

    def document(self) -> dict[str, Any]:
        """The JSON form."""
        a = self.sql
        return {
            "dataset": self.name,
            "jobs": {**self.jobs, "total": sum(self.jobs.values())},
            "generations": a.generations,
            "max_new_tokens": self.max_new_tokens,
            "completion_tokens": _distribution(a.completion_sum, a.generations, a.completion),
            "prompt_tokens": _distribution(a.prompt_sum, a.generations, a.prompt),
            "completion_per_prompt_token": share(a.completion_sum, a.prompt_sum),
            "histogram": histogram_document(self.histogram),
            "finish": dict(sorted(self.finishes.items())),
            "truncated": {
                "length": a.length,
                "at_max_new_tokens": a.at_max_new,
                "before_max_new_tokens": a.length - a.at_max_new,
                "share": self.truncated_share,
            },
            "reasoning": _reasoning_document(a),
            "empty_answers": a.empty_answers,
            "cache": {
                "prompt_tokens": a.prompt_sum,
                "cached_tokens": a.cached_sum,
                "hit_ratio": share(a.cached_sum, a.prompt_sum),
                "generations_with_hits": a.cache_hits,
            },
            "latency_s": {"mean": a.latency_mean, **_spread(a.latency)},
            "tool_calls": self._tool_calls(),
        }

    def _tool_calls(self) -> dict[str, Any] | str | None:
        """The tool-call figures; "not checked" for a family whose calls are not read
        (never 0 calls, nor null as if there were none)."""
        if not self.calls_checked:
            return NOT_CHECKED
        return None if self.tools is None else self.tools.document()


def _spread(s: Spread) -> dict[str, float | None]:
    return {"p50": s.p50, "p90": s.p90, "p99": s.p99, "max": s.max}


def _distribution(total: int, n: int, s: Spread) -> dict[str, Any]:
    return {"sum": total, "mean": share(total, n), **_spread(s)}


def _reasoning_document(a: Aggregate) -> dict[str, Any]:
    return {
        "opens_reasoning": a.opens_reasoning,
        "think_end_present": a.opens_reasoning - a.no_think_end,
        "think_end_missing": a.no_think_end,
        "think_end_missing_cut": a.no_think_end_cut,
        "reasoning_tokens": {"sum": a.reasoning_sum, **_spread(a.reasoning)},
        "answer_tokens": {"sum": a.answer_sum},
        "reasoning_share": share(a.reasoning_sum, a.reasoning_sum + a.answer_sum),
    }


def histogram_document(h: Histogram) -> dict[str, Any]:
    """Dense counts from bin 0 to the last non-empty one."""
    top = max(h.counts, default=-1)
    return {"bin_width": h.width, "counts": [h.counts.get(i, 0) for i in range(top + 1)]}


@dataclass(frozen=True)
class Conversations:
    """A dataset's conversations (``turns = "all"``) as the report states them: by state,
    completion lengths by turn index, and the later turns that extend the turn before (the
    others' first departure, by part of the turn before, in a sample)."""

    dataset: str
    states: dict[str, int]
    by_turn: tuple[TurnLengths, ...]
    later_turns: int
    extending: int
    departs: dict[str, int]  # sampled later turns that do not extend: where they depart

    @classmethod
    def of(cls, f: ConversationFigures) -> Conversations:
        where = Counter(departure(ids, prompt, output)[0] for ids, prompt, output in f.departing)
        return cls(
            f.dataset, dict(f.states), tuple(f.by_turn), f.later_turns, f.extending, dict(where)
        )

    def document(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "states": dict(sorted(self.states.items())),
            "completion_by_turn": [
                {"turn": t.turn, "n": t.n, "p50": t.p50, "max": t.top} for t in self.by_turn
            ],
            "later_turns": self.later_turns,
            "extending": self.extending,
            "departing_sample": dict(sorted(self.departs.items())),
        }

    def warning(self) -> str | None:
        """Said plainly when later turns do not start with the turn before: the template
        writes earlier answers back otherwise than the model wrote them."""
        apart = self.later_turns - self.extending
        if not apart:
            return None
        where = max(self.departs, key=lambda k: self.departs[k]) if self.departs else None
        inside = (
            "inside the earlier answer (the chat template writes it back otherwise than the "
            "model wrote it, e.g. without its reasoning)"
            if where == ANSWER
            else "inside the earlier prompt (the template renders the history otherwise)"
        )
        return (
            f"`{self.dataset}`: {apart:,} of {self.later_turns:,} later turns do not start "
            f"with the turn before (its prompt and output ids); they depart {inside}. Each "
            "turn is still exactly what the model saw; `export --merge-turns` keeps such "
            "conversations one row per turn"
        )


@dataclass(frozen=True)
class Report:
    """The whole `eaglegen stats` report of a run."""

    run: str
    think_end: str  # how the think-end token reads, for the warnings
    datasets: tuple[Figures, ...]
    total: Figures
    checks: TokenChecks | None  # None: no generation to check
    points: tuple[tuple[str, int, int], ...] = ()  # (dataset, prompt, completion) sample
    family: str | None = None  # the run's model family (core.families); None: not told
    conversations: tuple[Conversations, ...] = ()
    # Datasets of several samples or with variants, by variant (models.stats).
    variants: tuple[VariantFigures, ...] = ()

    @property
    def warnings(self) -> list[str]:
        """What a user must see, most important first."""
        found = [w for f in self.datasets for w in dataset_warnings(f, self.think_end)]
        return found + [w for c in self.conversations if (w := c.warning())]

    def document(self) -> dict[str, Any]:
        """The ``eaglegen stats --json`` document."""
        return {
            "run": self.run,
            "family": self.family,
            "warnings": self.warnings,
            "datasets": [f.document() for f in self.datasets],
            "total": self.total.document(),
            "token_checks": None if self.checks is None else self.checks.document(),
            "scatter_sample": len(self.points),
            "conversations": [c.document() for c in self.conversations],
            "variants": [variant_document(v) for v in self.variants],
        }


def variant_document(v: VariantFigures) -> dict[str, Any]:
    """One dataset's figures of one variant, as ``stats --json`` writes them."""
    return {
        "dataset": v.dataset,
        "variant": v.variant,
        "samples_per_prompt": v.samples,
        "jobs": v.jobs,
        "done": v.done,
        "completion_tokens": v.completion_tokens,
        "completion": dict(zip(("p50", "p90", "p99"), v.completion_pct, strict=True)),
        "truncated": v.truncated,
        "truncated_share": share(v.truncated, v.done),
        "reasoning_share": v.reasoning_share,
    }


def dataset_warnings(f: Figures, think_end: str) -> list[str]:
    """The warnings of one dataset, as plain sentences (the caller escapes them)."""
    a, name, out = f.sql, f"`{f.name}`", []
    cut = f.truncated_share
    if cut is not None and cut >= TRUNCATION_WARNING and f.max_new_tokens is not None:
        out.append(
            f"{percent(cut)} of {name} truncated at {f.max_new_tokens:,} tokens "
            f"({a.at_max_new:,} of {a.generations:,} generations)"
        )
    if a.length > a.at_max_new:
        out.append(
            f"{_many(a.length - a.at_max_new, 'generation')} of {name} stopped by length before "
            "max_new_tokens (the context length)"
        )
    if a.no_think_end:
        stopped = a.no_think_end - a.no_think_end_cut
        out.append(
            f"{_many(a.no_think_end, 'generation')} of {name} "
            f"{_verb(a.no_think_end, 'lacks', 'lack')} `{think_end}` "
            f"({a.no_think_end_cut:,} cut by length, {stopped:,} stopped without it)"
        )
    if a.empty_answers:
        n = a.empty_answers
        out.append(f"{_many(n, 'generation')} of {name} {_verb(n, 'has', 'have')} an empty answer")
    if f.tools is not None:
        out += _tool_warnings(f.tools, name)
    return out


def _tool_warnings(t: ToolFigures, name: str) -> list[str]:
    out = []
    if t.invalid_arguments:
        out.append(
            f"{t.invalid_arguments:,} of {_many(t.calls, 'tool call')} of {name} "
            f"{_verb(t.invalid_arguments, 'has', 'have')} arguments that are not JSON "
            f"(e.g. job {_ids(t.examples.get('invalid_arguments'))})"
        )
    if t.undeclared:
        out.append(
            f"{_many(t.undeclared, 'tool call')} of {name} {_verb(t.undeclared, 'calls', 'call')} "
            "a function the row did not declare "
            f"(e.g. job {_ids(t.examples.get('undeclared'))})"
        )
    if t.unbalanced:
        out.append(
            f"{_many(t.unbalanced, 'generation')} of {name} stopped inside an unclosed tool-call "
            f"section (e.g. job {_ids(t.examples.get('unbalanced'))})"
        )
    return out


def _many(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _verb(n: int, one: str, more: str) -> str:
    return one if n == 1 else more


def _ids(ids: Iterable[int] | None) -> str:
    return ", ".join(str(i) for i in list(ids or ())[:3])


def total_tools(parts: Iterable[ToolFigures | None]) -> ToolFigures | None:
    """The run's tool figures: the datasets' summed (None when none was checked)."""
    found = [p for p in parts if p is not None]
    if not found:
        return None
    total = ToolFigures()
    for part in found:
        total.add(part)
    return total


def sum_states(states: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Jobs by state over every dataset."""
    out: dict[str, int] = {}
    for by_state in states.values():
        for state, n in by_state.items():
            out[state] = out.get(state, 0) + n
    return dict(sorted(out.items()))


def run_max_new_tokens(datasets: Iterable[StatsDataset]) -> int | None:
    """The run's max_new_tokens when every dataset has the same, else None."""
    values = {d.max_new_tokens for d in datasets}
    return values.pop() if len(values) == 1 else None


def no_generations(name: str | None) -> Aggregate:
    """The SQL figures of a dataset without generations."""
    none = Spread(None, None, None, None)
    return Aggregate(name, 0, 0, none, 0, none, 0, 0, 0, 0, 0, 0, none, 0, 0, 0, 0, none, None)
