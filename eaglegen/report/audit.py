"""The invariant check (`eaglegen audit`) as lines for a person and as one JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eaglegen.report.text import inline

Overshoot = tuple[str, str, int]  # run, dataset, tokens over budget


def audit_document(problems: Sequence[str], overshoot: Sequence[Overshoot]) -> dict[str, Any]:
    """The ``eaglegen audit --json`` document."""
    return {
        "ok": not problems,
        "violations": list(problems),
        "over_budget": [{"run": r, "dataset": d, "tokens": o} for r, d, o in overshoot],
    }


def audit_lines(problems: Sequence[str], overshoot: Sequence[Overshoot]) -> list[str]:
    """Rich-markup lines: each violation, each overshoot, then the verdict."""
    lines = [f"[red]violation:[/] {inline(problem)}" for problem in problems]
    lines += [
        f"{inline(r)}/{inline(d)}: {o:,} tokens over budget (bounded by one job's reservation)"
        for r, d, o in overshoot
    ]
    lines.append("ok: every invariant holds" if not problems else f"{len(problems)} violation(s)")
    return lines
