"""The hand-packed LPUSH is the command redis-py would send."""

from __future__ import annotations

from redis.connection import Connection

from core.wire import lpush_command


def test_lpush_command_is_what_redis_py_packs() -> None:
    values = [b"{}", "é \r\n$*".encode(), b"", b"x" * 70_000]
    for key in ("q", "queue with ünïcode"):
        packed = b"".join(Connection().pack_command("LPUSH", key, *values))
        assert lpush_command(key, values) == packed
