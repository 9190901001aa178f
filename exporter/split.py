"""The train/val split: by a hash of the seed and the row's key, so that an export of the
same run with the same seed (or an incremental one) puts every row where it was.

A plain job's key is its id. Every row of a conversation (each turn's, or its merged or
whole row) is keyed by the conversation, so no conversation has rows in both splits: a
validation row whose earlier turns were trained on would measure memory, not drafting.
Samples of one prompt (core.samples) are keyed by their sample 0's job or conversation, so
no prompt has samples in both splits either.
"""

from __future__ import annotations

import hashlib

from models.records import ExportedGeneration

TRAIN = "train"
VAL = "val"
_SCALE = 2**64


def check_fraction(val_fraction: float) -> float:
    """``val_fraction`` if it is in [0, 1), else a ValueError."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be at least 0 and below 1, not {val_fraction}")
    return val_fraction


def split_key(gen: ExportedGeneration) -> int | str:
    """What decides ``gen``'s split: its job id, or its conversation (its sample 0's)."""
    return gen.prompt_key if gen.conversation_id is None else conversation_key(gen.prompt_key)


def conversation_key(conversation_id: int) -> str:
    """The split key of every row of a conversation (apart from any job id's)."""
    return f"c{conversation_id}"


def split_of(key: int | str, seed: int, val_fraction: float) -> str:
    """``VAL`` for about ``val_fraction`` of the keys (the same ones for the same seed)."""
    if val_fraction <= 0.0:
        return TRAIN
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return VAL if int.from_bytes(digest[:8], "big") < val_fraction * _SCALE else TRAIN
