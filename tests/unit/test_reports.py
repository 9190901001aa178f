"""The report renderers' pure parts."""

from __future__ import annotations

from eaglegen.report.audit import audit_document, audit_lines
from eaglegen.report.status import connections_warning


def test_a_postgres_near_its_connection_limit_is_a_warning_saying_what_to_do() -> None:
    assert connections_warning(79, 100) is None
    warning = connections_warning(80, 100)
    assert warning is not None and "80 of its 100 connections" in warning
    assert "EAGLEGEN_DB_POOL_SIZE" in warning and "PgBouncer" in warning


def test_audit_lines_escape_markup_and_end_with_the_verdict() -> None:
    lines = audit_lines(["job 3 [done] has 2 generations"], [("r", "d[1]", 512)])
    assert lines[0] == "[red]violation:[/] job 3 \\[done] has 2 generations"
    assert lines[1].startswith("r/d[1]: 512 tokens over budget")  # not markup: kept
    assert lines[-1] == "1 violation(s)"
    assert audit_lines([], [])[-1] == "ok: every invariant holds"
    assert audit_document([], [("r", "d", 5)]) == {
        "ok": True,
        "violations": [],
        "over_budget": [{"run": "r", "dataset": "d", "tokens": 5}],
    }


def test_user_strings_reach_the_terminal_as_text() -> None:
    from eaglegen.report.text import inline, shown, visible

    assert visible("a\x1b[31mb\nc\x00 d") == "a\\x1b[31mb\\nc\\x00 d"
    assert visible("naïve 名前") == "naïve 名前"  # printable text stays as it is
    assert shown("[/]").plain == "[/]"
    assert inline("[bold]x\x07") == "\\[bold]x\\x07"
