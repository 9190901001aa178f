"""`eaglegen stats --html`: the report as one self-contained page (the plots embedded as
base64 PNGs, the style inline; nothing is fetched). Every user string is escaped."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from html import escape

from eaglegen.report.quality import Report
from eaglegen.report.stats import Columns, coverage, tables
from eaglegen.report.text import visible

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 2em; }
.scroll { max-width: 100%; overflow-x: auto; margin: 0.5em 0; }
table { border-collapse: collapse; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right;
         white-space: nowrap; }
th { white-space: normal; vertical-align: bottom; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f6; }
tr.total td { font-weight: 600; }
ul.warnings { background: #fff4e5; border-left: 4px solid #f0a020; padding: 0.8em 2em; }
.ok { color: #2a7a2a; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
.muted { color: #666; }
"""


def _text(value: str) -> str:
    return escape(visible(value))


def _table(columns: Columns) -> str:
    head = "".join(f"<th>{_text(h)}</th>" for h in columns.headers)
    body = []
    for i, row in enumerate(columns.rows):
        # The run's row is the last one (by position: a dataset may be named "(run)").
        css = ' class="total"' if i == len(columns.rows) - 1 else ""
        cells = "".join(f"<td>{_text(c)}</td>" for c in row)
        body.append(f"<tr{css}>{cells}</tr>")
    # In a box of its own that scrolls sideways: a wide table never widens the page.
    return (
        f'<h2>{_text(columns.title)}</h2>\n<div class="scroll"><table><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def _warnings(report: Report) -> str:
    found = report.warnings
    if not found:
        return '<p class="ok">No warnings.</p>'
    items = "".join(f"<li>{_text(w)}</li>" for w in found)
    return f'<ul class="warnings">{items}</ul>'


def _images(pngs: Mapping[str, bytes]) -> str:
    if not pngs:
        return '<p class="muted">No plots: the run has no generations yet.</p>'
    out = ["<h2>plots</h2>"]
    for name, png in pngs.items():
        data = base64.b64encode(png).decode("ascii")
        out.append(f'<img alt="{escape(name)}" src="data:image/png;base64,{data}">')
    return "\n".join(out)


def page(report: Report, pngs: Mapping[str, bytes]) -> str:
    """The whole HTML document."""
    title = f"eaglegen stats: {report.run}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_text(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_text(title)}</h1>",
        f'<p class="muted">{_text(coverage(report))}</p>',
        _warnings(report),
        *(_table(c) for c in tables(report)),
        _images(pngs),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
