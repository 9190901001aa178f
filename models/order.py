"""The order jobs are published in: seeded and random within a dataset (docs/design.md §7).

A job's sort key is a hash of the run's order seed and the job's prompt digest, so the
order is a random permutation that has nothing to do with the file's: any prefix of it,
which is what a budget-capped dataset generates, is a uniform sample of the file. The same
seed and the same prompts give the same order, whatever order the file lists them in.

The key is the first 60 bits of ``sha256(seed as 8 bytes big-endian, signed || digest)``:
non-negative in a bigint, and computable in SQL too (``SORT_KEY_SQL``, used by the
migration that gave existing jobs their keys; a test pins the two to each other).
"""

from __future__ import annotations

import hashlib
import secrets

SEED_BITS = 62
SORT_KEY_SQL = (
    "('x' || substr(encode(sha256(int8send({seed}) || {digest}), 'hex'), 1, 15))::bit(60)::bigint"
)


def sort_key(seed: int, prompt_sha256: bytes) -> int:
    """The job's place in its dataset's publishing order (ties are broken by job id)."""
    digest = hashlib.sha256(seed.to_bytes(8, "big", signed=True) + prompt_sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 4


def new_seed() -> int:
    """A seed for a run that was given none (recorded with the run, shown by `status`)."""
    return secrets.randbits(SEED_BITS)
