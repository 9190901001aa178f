"""Run and dataset names: checked once where they come in (flags, run files, lookups).

They are stored in columns of 200 characters, used as keys, and shown in terminals, so a
name is 1 to 200 printable characters: no NUL (Postgres text cannot hold it) and no control
characters (an ANSI escape in a name would reach every terminal that shows it).
"""

from __future__ import annotations

MAX_NAME = 200


def check_name(kind: str, value: str) -> str:
    """``value`` if it is a valid ``kind`` name, else a ValueError saying why."""
    if not 1 <= len(value) <= MAX_NAME:
        raise ValueError(f"a {kind} name must be 1 to {MAX_NAME} characters, not {len(value)}")
    bad = next((ch for ch in value if not ch.isprintable()), None)
    if bad is not None:
        raise ValueError(
            f"{kind} name {value[:60]!r} holds the control character {bad!r}: "
            "use printable characters only"
        )
    return value
