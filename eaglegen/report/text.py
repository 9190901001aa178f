"""User strings (run and dataset names, file names, errors) as they may reach a terminal:
never as rich markup (a dataset named ``[/]`` would raise), never as raw control
characters (an ANSI escape in a name would restyle or rewrite the terminal)."""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text


def visible(value: str) -> str:
    """``value`` with each control character written as its escape (``\\x1b``)."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
        for ch in value
    )


def shown(value: str) -> Text:
    """A table cell or title holding ``value`` as it is: no markup, controls visible."""
    return Text(visible(value))


def inline(value: str) -> str:
    """``value`` for a rich markup string (``err.print(f"...{inline(name)}...")``)."""
    return escape(visible(value))
