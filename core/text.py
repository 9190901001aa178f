"""Text from outside (a server's error body, a user's names) as it may be stored or shown:
never with raw control characters, which would restyle or rewrite the terminal that later
prints it (an ANSI or OSC sequence in a log line, in `status`, in a report)."""

from __future__ import annotations


def visible(value: str) -> str:
    """``value`` with each control character written as its escape (``\\x1b``).

    Idempotent: an escape is printable text, so escaping twice changes nothing more."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
        for ch in value
    )
