"""The train/val split: by a hash of the seed and the row's id, so that an export of the
same run with the same seed (or an incremental one) puts every row where it was."""

from __future__ import annotations

import hashlib

TRAIN = "train"
VAL = "val"
_SCALE = 2**64


def check_fraction(val_fraction: float) -> float:
    """``val_fraction`` if it is in [0, 1), else a ValueError."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be at least 0 and below 1, not {val_fraction}")
    return val_fraction


def split_of(row_id: int, seed: int, val_fraction: float) -> str:
    """``VAL`` for about ``val_fraction`` of the ids (the same ones for the same seed)."""
    if val_fraction <= 0.0:
        return TRAIN
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return VAL if int.from_bytes(digest[:8], "big") < val_fraction * _SCALE else TRAIN
