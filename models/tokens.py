"""Token id arrays stored as packed little-endian int32 ``bytea``.

Packed bytes cost 4 bytes a token like ``integer[]`` but cross the driver as one buffer
instead of one Python int per element, which matters for 10k-token reasoning traces.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

from sqlalchemy import LargeBinary
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

_LITTLE = sys.byteorder == "little"


def pack(ids: Sequence[int]) -> bytes:
    """Pack token ids into little-endian int32 bytes."""
    packed = array("i", ids)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> list[int]:
    """Inverse of :func:`pack`."""
    packed = array("i")
    packed.frombytes(data)
    if not _LITTLE:
        packed.byteswap()
    return packed.tolist()


class TokenArray(TypeDecorator[list[int]]):
    """A column holding a list of token ids."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> list[int] | None:
        return None if value is None else unpack(bytes(value))
