"""Token id arrays stored as packed little-endian int32 ``bytea``.

Packed bytes cost 4 bytes a token like ``integer[]`` but cross the driver as one buffer
instead of one Python int per element, which matters for 10k-token reasoning traces. The
column type that packs them is models.schema's TokenArray; this module is SQLAlchemy-free.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

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
