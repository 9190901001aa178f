"""`eaglegen stats`: gathering the report (SQL figures, then the token-level checks over the
generations that hold tool-call tokens) and showing it as terminal tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from core.anatomy import THINK_END
from core.tokenizer import RunTokenizer
from eaglegen.report.quality import (
    Conversations,
    Figures,
    Report,
    TokenChecks,
    ToolFigures,
    ToolTally,
    bin_width,
    declared_names,
    no_generations,
    percent,
    run_max_new_tokens,
    sum_states,
    total_tools,
)
from eaglegen.report.text import shown
from models.stats import StatsQueries, StatsRun, VariantFigures

# Points of the prompt-vs-completion plot (a seeded sample of the generations).
SCATTER_POINTS = 3000
_BARS = "▁▂▃▄▅▆▇█"


def run_tokenizer(
    run: StatsRun, override: Path | None = None, *, trust_remote_code: bool = False
) -> RunTokenizer:
    """The run's tokenizer (``override``: a copy of it elsewhere), read in the run's family,
    checked to be the one its ids were made with (by size)."""
    path = override or Path(run.tokenizer_path)
    if not path.is_dir():
        raise ValueError(
            f"the tokenizer of run {run.name!r} ({path}) is not on this machine: "
            "pass --tokenizer PATH, a copy of the same tokenizer"
        )
    tokenizer = RunTokenizer(
        path,
        trust_remote_code=trust_remote_code,
        template_kwargs=run.chat_template_kwargs,
        family=run.family,
    )
    size = tokenizer.vocab_size()
    if run.vocab_size is not None and size != run.vocab_size:
        raise ValueError(
            f"the tokenizer at {path} has {size:,} tokens, the run's had {run.vocab_size:,}: "
            "it is not the tokenizer the run was generated with"
        )
    return tokenizer


@dataclass(frozen=True)
class Scope:
    """What to report on: which datasets, and how the token-level checks sample."""

    datasets: tuple[str, ...]
    sample: int | None  # None: check every generation
    seed: int = 0


def collect(
    queries: StatsQueries,
    run: StatsRun,
    scope: Scope,
    tokenizer: RunTokenizer,
    progress: Callable[[int], None] = lambda n: None,
) -> Report:
    """The report of ``run``; ``progress`` is called per generation the checks dissect."""
    names = scope.datasets
    states = queries.job_states(run.id, names)
    found = {a.dataset: a for a in queries.aggregates(run.id, names)}
    aggregates = {n: found.get(n) or no_generations(n) for n in names}
    total = found.get(None) or no_generations(None)
    widths = {n: bin_width(a.completion.max) for n, a in aggregates.items()}
    histograms = queries.histograms(run.id, widths, bin_width(total.completion.max))
    finishes = queries.finishes(run.id, names)
    checks, tools = _tool_checks(queries, run, scope, tokenizer, total.generations, progress)
    checked = tokenizer.markers().calls_checked
    params = {d.name: d for d in run.datasets}
    figures = tuple(
        Figures(
            name=n,
            jobs=dict(sorted(states[n].items())),
            max_new_tokens=params[n].max_new_tokens,
            sql=aggregates[n],
            finishes=finishes.get(n, {}),
            histogram=histograms[n],
            tools=tools.get(n),
            calls_checked=checked,
        )
        for n in names
    )
    run_figures = Figures(
        name=None,
        jobs=sum_states(states),
        max_new_tokens=run_max_new_tokens(params[n] for n in names),
        sql=total,
        finishes=finishes.get(None, {}),
        histogram=histograms[None],
        tools=total_tools(f.tools for f in figures),
        calls_checked=checked,
    )
    points = queries.points(run.id, names, SCATTER_POINTS, scope.seed) if total.generations else []
    conversations = queries.conversations(run.id, names)
    return Report(
        run=run.name,
        think_end=tokenizer.token(run.think_end_id, THINK_END),
        datasets=figures,
        total=run_figures,
        checks=checks,
        points=tuple(points),
        family=tokenizer.family.name,
        conversations=tuple(
            Conversations.of(conversations[n]) for n in names if n in conversations
        ),
        variants=tuple(queries.by_variant(run.id, names)),
    )


def _tool_checks(
    queries: StatsQueries,
    run: StatsRun,
    scope: Scope,
    tokenizer: RunTokenizer,
    generations: int,
    progress: Callable[[int], None],
) -> tuple[TokenChecks | None, dict[str, ToolFigures]]:
    """Read every generation (of the sample) that holds one of its family's call tokens,
    cut at its dataset's stored stop ids."""
    if not generations:
        return None, {}
    marker_ids = sorted(tokenizer.markers().call_ids)
    if not marker_ids:  # the family's calls are not read: not checked, said so
        return TokenChecks(scope.sample, scope.seed, 0, tool_markers=False), {}
    stops = {d.name: d.stop_token_ids for d in run.datasets}
    tally = ToolTally()
    sample, seed = scope.sample, scope.seed
    with queries.tool_rows(run.id, scope.datasets, marker_ids, sample, seed) as rows:
        for row in rows:
            read = tokenizer.read(
                row.output_ids,
                stops[row.dataset],
                opens_reasoning=row.opens_reasoning,
                declared=declared_names(row.tools),
            )
            tally.add(row.dataset, row.job_id, read.anatomy, read.calls, row.finish_type)
            progress(1)
    scoped = queries.tool_scope(run.id, scope.datasets, sample, seed)
    figures = {n: tally.figures(n, scoped[n]) for n in scope.datasets if n in scoped}
    checked = sum(n for n, _ in scoped.values())
    return TokenChecks(sample, seed, checked, tool_markers=True), figures


# --- terminal ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Columns:
    """One table of the report: a title, headers and rows of plain strings (the terminal
    and the HTML page draw the same tables)."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _pct(part: int, whole: int) -> str:
    return "-" if not whole else percent(part / whole)


def sparkline(counts: Sequence[int], width: int = 20) -> str:
    """A histogram as one line of block characters (bins merged down to ``width``)."""
    if not counts or not any(counts):
        return ""
    step = max(1, -(-len(counts) // width))
    merged = [sum(counts[i : i + step]) for i in range(0, len(counts), step)]
    top = max(merged)
    return "".join(
        " " if c == 0 else _BARS[min(len(_BARS) - 1, c * len(_BARS) // (top + 1))] for c in merged
    )


def _label(f: Figures) -> str:
    return "(run)" if f.name is None else f.name


def tables(report: Report) -> list[Columns]:
    """The report's tables: lengths and finishes, reasoning, tool calls, serving."""
    every = [*report.datasets, report.total]
    out = [_lengths(every), _reasoning(every, report.think_end)]
    if report.checks is not None and report.checks.tool_markers:
        out.append(_tools(every))
    out.append(_serving(every))
    if report.conversations:
        out.append(_conversations(report.conversations))
    if report.variants:
        out.append(_variants(report.variants))
    return out


def _variants(found: Sequence[VariantFigures]) -> Columns:
    """Datasets of several samples or with variants: each variant's jobs, tokens, lengths,
    truncation and reasoning share."""
    rows = []
    for v in found:
        p50, p90, _ = v.completion_pct
        reasoning = v.reasoning_share
        rows.append(
            (
                v.dataset,
                "(dataset's sampling)" if v.variant is None else v.variant,
                f"{v.samples}",
                f"{v.done:,}/{v.jobs:,}",
                f"{v.completion_tokens:,}",
                _n(p50),
                _n(p90),
                f"{v.truncated:,}",
                "-" if reasoning is None else f"{reasoning:.1%}",
            )
        )
    headers = (
        "dataset", "variant", "samples", "done/jobs", "completion tokens", "p50", "p90",
        "truncated", "reasoning share",
    )  # fmt: skip
    return Columns("samples and variants", headers, tuple(rows))


def _conversations(found: Sequence[Conversations]) -> Columns:
    """Datasets answered turn by turn: conversations by how they stand, turns that extend
    the turn before, and the median completion by turn index."""
    rows = []
    for c in found:
        ended = sum(n for k, n in c.states.items() if k.startswith("ended"))
        rows.append(
            (
                c.dataset,
                f"{c.states.get('done', 0):,}",
                f"{c.states.get('active', 0) + c.states.get('waiting', 0):,}",
                f"{ended:,}",
                ", ".join(
                    f"{k.removeprefix('ended: ')} {n:,}"
                    for k, n in sorted(c.states.items())
                    if k.startswith("ended")
                )
                or "-",
                f"{c.extending:,} of {c.later_turns:,}",
                " ".join(f"{t.turn}:{t.p50:,.0f}" for t in c.by_turn),
            )
        )
    headers = (
        "dataset", "done", "under way", "ended", "ended by", "later turns extending",
        "completion p50 by turn",
    )  # fmt: skip
    return Columns("conversations", headers, tuple(rows))


def _lengths(every: list[Figures]) -> Columns:
    rows = []
    for f in every:
        a = f.sql
        c = a.completion
        rows.append(
            (
                _label(f),
                f"{f.jobs.get('done', 0):,}/{sum(f.jobs.values()):,}",
                _n(c.p50),
                _n(c.p90),
                _n(c.p99),
                _n(c.max),
                _n(f.max_new_tokens),
                f"{a.at_max_new:,} ({_pct(a.at_max_new, a.generations)})",
                _finish_text(f.finishes),
                _n(a.prompt.p50),
                _n(a.completion_sum / a.prompt_sum if a.prompt_sum else None, 2),
                sparkline(_counts(f)),
            )
        )
    headers = (
        "dataset", "done/jobs", "p50", "p90", "p99", "max", "max_new", "truncated",
        "finish", "prompt p50", "compl/prompt", "histogram",
    )  # fmt: skip
    return Columns("completion tokens", headers, tuple(rows))


def _counts(f: Figures) -> list[int]:
    top = max(f.histogram.counts, default=-1)
    return [f.histogram.counts.get(i, 0) for i in range(top + 1)]


def _finish_text(finishes: dict[str, int]) -> str:
    return " ".join(f"{k} {v:,}" for k, v in sorted(finishes.items())) or "-"


def _reasoning(every: list[Figures], think_end: str) -> Columns:
    rows = []
    for f in every:
        a = f.sql
        rows.append(
            (
                _label(f),
                f"{a.opens_reasoning:,}",
                f"{a.no_think_end:,} ({a.no_think_end_cut:,} cut)",
                _pct(a.reasoning_sum, a.reasoning_sum + a.answer_sum),
                _n(a.reasoning.p50),
                _n(a.reasoning.p90),
                f"{a.answer_sum:,}",
                f"{a.empty_answers:,}",
            )
        )
    headers = (
        "dataset", "opens reasoning", f"no {think_end}", "reasoning share", "reasoning p50",
        "reasoning p90", "answer tokens", "empty answers",
    )  # fmt: skip
    return Columns("reasoning and answers", headers, tuple(rows))


def _tools(every: list[Figures]) -> Columns:
    rows = []
    for f in every:
        t = f.tools
        if t is None:
            rows.append((_label(f), *(["-"] * 8)))
            continue
        rows.append(
            (
                _label(f),
                f"{t.checked:,}",
                f"{t.declared:,}",
                f"{t.with_calls:,}",
                f"{t.calls:,}",
                f"{t.invalid_arguments:,}",
                f"{t.undeclared:,}",
                f"{t.unbalanced:,}",
                f"{t.cut_in_section:,}",
            )
        )
    headers = (
        "dataset", "checked", "declare tools", "with calls", "calls", "args not JSON",
        "undeclared", "unclosed", "cut in section",
    )  # fmt: skip
    return Columns("tool calls", headers, tuple(rows))


def _serving(every: list[Figures]) -> Columns:
    rows = []
    for f in every:
        a = f.sql
        lat = a.latency
        rows.append(
            (
                _label(f),
                _pct(a.cached_sum, a.prompt_sum),
                f"{a.cache_hits:,}",
                _n(lat.p50, 2),
                _n(lat.p90, 2),
                _n(lat.p99, 2),
                _n(lat.max, 2),
            )
        )
    headers = (
        "dataset", "cache hit (tokens)", "gens with hits", "latency p50 s", "p90 s", "p99 s",
        "max s",
    )  # fmt: skip
    return Columns("cache and latency", headers, tuple(rows))


def coverage(report: Report) -> str:
    """One sentence on what the report covers (and how the token checks sampled)."""
    total = report.total.sql.generations
    jobs = sum(report.total.jobs.values())
    if not total:
        states = ", ".join(f"{k} {v:,}" for k, v in report.total.jobs.items()) or "none"
        family = "" if report.family is None else f"; family {report.family}"
        return f"run {report.run}: no generations yet ({jobs:,} jobs: {states}){family}"
    head = f"run {report.run}: {total:,} generations of {jobs:,} jobs"
    if report.family is not None:
        head += f"; family {report.family}"
    checks = report.checks
    if checks is None or not checks.tool_markers:
        return f"{head} — tool calls not checked"
    if checks.sample is None:
        return f"{head}; tool calls checked in every generation"
    return (
        f"{head}; tool calls checked in a seeded sample of {checks.checked:,} generations "
        f"(--sample {checks.sample:,}, --seed {checks.seed})"
    )


def terminal(report: Report) -> Group:
    """The report as rich renderables; every user string goes in as plain text."""
    parts: list[Any] = [shown(coverage(report))]
    for columns in tables(report):
        table = Table(title=columns.title, title_justify="left")
        for i, header in enumerate(columns.headers):
            table.add_column(shown(header), justify="left" if i == 0 else "right")
        for row in columns.rows:
            table.add_row(*(shown(cell) for cell in row))
        parts.append(table)
    return Group(*parts)


def warning_lines(report: Report) -> list[Text]:
    """The warnings as lines for stderr."""
    return [Text.assemble(("warning: ", "yellow"), shown(w)) for w in report.warnings]
