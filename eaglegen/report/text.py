"""User strings (run and dataset names, file names, errors) as they may reach a terminal:
never as rich markup (a dataset named ``[/]`` would raise), never as raw control
characters (an ANSI escape in a name would restyle or rewrite the terminal)."""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text

# The one escape, shared with the worker and the database layer (which may not import this
# package): re-exported for the reports and commands that use it from here.
from core.text import visible

__all__ = ["inline", "shown", "visible"]


def shown(value: str) -> Text:
    """A table cell or title holding ``value`` as it is: no markup, controls visible."""
    return Text(visible(value))


def inline(value: str) -> str:
    """``value`` for a rich markup string (``err.print(f"...{inline(name)}...")``)."""
    return escape(visible(value))
