"""The report's figures as PNG bytes (matplotlib's object API: no pyplot state, no
display, safe to call from any thread)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from matplotlib.figure import Figure

from eaglegen.report.quality import Figures, Report
from eaglegen.report.text import visible

_DPI = 100
_COLORS = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2")


def label(name: str | None) -> str:
    """A user string as a matplotlib label: ``$`` would start mathtext (and a lone one
    raises), a control character would be drawn as a box or not at all."""
    return visible("(run)" if name is None else name).replace("$", r"\$")


def plots(report: Report) -> dict[str, bytes]:
    """File name -> PNG of every figure; {} when the run has no generations to plot."""
    if not report.total.sql.generations:
        return {}
    return {
        "completion_lengths.png": _png(completion_lengths(report.datasets)),
        "finish_reasons.png": _png(finish_reasons(report.datasets)),
        "reasoning_split.png": _png(reasoning_split(report.datasets)),
        "prompt_vs_completion.png": _png(prompt_vs_completion(report)),
    }


def _png(figure: Figure) -> bytes:
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=_DPI, bbox_inches="tight")
    return out.getvalue()


def completion_lengths(datasets: Sequence[Figures]) -> Figure:
    """One histogram per dataset, with its max_new_tokens marked."""
    shown = [f for f in datasets if f.sql.generations] or list(datasets)
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    figure = Figure(figsize=(4.2 * cols, 2.8 * rows), layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    for i, f in enumerate(shown):
        ax = axes[i // cols][i % cols]
        width = f.histogram.width
        bins = sorted(f.histogram.counts)
        ax.bar(
            [b * width for b in bins],
            [f.histogram.counts[b] for b in bins],
            width=width,
            align="edge",
            color=_COLORS[i % len(_COLORS)],
        )
        if f.max_new_tokens is not None:
            ax.axvline(f.max_new_tokens, color="#d62728", linestyle="--", linewidth=1)
        ax.set_title(f"{label(f.name)}: {f.sql.generations:,} generations", fontsize=10)
        ax.set_xlabel("completion tokens")
        ax.set_ylabel("generations")
    for j in range(len(shown), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    figure.suptitle("Completion lengths (dashed: max_new_tokens)")
    return figure


def finish_reasons(datasets: Sequence[Figures]) -> Figure:
    """Share of each finish per dataset; a cut at max_new_tokens apart from other lengths."""
    figure = Figure(figsize=(8, 0.6 * len(datasets) + 1.6), layout="constrained")
    ax = figure.subplots()
    kinds = (
        ("stop", "#3ca951"),
        ("length at max_new_tokens", "#d62728"),
        ("length before it", "#ff8ab7"),
        ("other", "#9c9c9c"),
    )
    names = [label(f.name) for f in datasets]
    left = [0.0] * len(datasets)
    for kind, color in kinds:
        values = [_finish_share(f, kind) for f in datasets]
        ax.barh(names, values, left=left, color=color, label=kind)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of generations")
    ax.invert_yaxis()
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=4, fontsize=8, frameon=False)
    return figure


def _finish_share(f: Figures, kind: str) -> float:
    n = f.sql.generations
    if not n:
        return 0.0
    count = {
        "stop": f.finishes.get("stop", 0),
        "length at max_new_tokens": f.sql.at_max_new,
        "length before it": f.sql.length - f.sql.at_max_new,
    }.get(kind)
    if count is None:
        count = n - f.finishes.get("stop", 0) - f.sql.length
    return count / n


def reasoning_split(datasets: Sequence[Figures]) -> Figure:
    """Mean reasoning and answer tokens per generation, per dataset."""
    figure = Figure(figsize=(8, 0.6 * len(datasets) + 1.6), layout="constrained")
    ax = figure.subplots()
    names = [label(f.name) for f in datasets]
    reasoning, answer = [], []
    for f in datasets:
        a, n = f.sql, max(1, f.sql.generations)
        if a.opens_reasoning:
            reasoning.append(a.reasoning_sum / n)
            answer.append((a.completion_sum - a.reasoning_sum) / n)
        else:  # no reasoning block: the whole completion is the answer
            reasoning.append(0.0)
            answer.append(a.completion_sum / n)
    ax.barh(names, reasoning, color="#4269d0", label="reasoning")
    ax.barh(names, answer, left=reasoning, color="#efb118", label="answer")
    ax.set_xlabel("mean tokens per generation")
    ax.invert_yaxis()
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, fontsize=8, frameon=False)
    return figure


def scatter_scope(report: Report) -> str:
    """Which generations the scatter plot shows: all of them, or a seeded sample."""
    shown, total = len(report.points), report.total.sql.generations
    if shown >= total:
        return f"all {total:,} generations"
    return f"a seeded sample of {shown:,} of {total:,} generations"


def prompt_vs_completion(report: Report) -> Figure:
    """Prompt against completion length of every generation, or of a seeded sample of
    them when there are more than the report draws (eaglegen.report.stats.SCATTER_POINTS)."""
    figure = Figure(figsize=(7, 5), layout="constrained")
    ax = figure.subplots()
    names = [f.name for f in report.datasets]
    for i, name in enumerate(names):
        xs = [max(1, p) for d, p, _ in report.points if d == name]
        ys = [max(1, c) for d, _, c in report.points if d == name]
        if xs:
            ax.scatter(xs, ys, s=6, alpha=0.5, color=_COLORS[i % len(_COLORS)], label=label(name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("completion tokens")
    ax.set_title(f"Prompt vs completion ({scatter_scope(report)})")
    ax.legend(fontsize=8, markerscale=2)
    return figure
