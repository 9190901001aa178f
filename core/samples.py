"""Several samples of each prompt, and named sampling variants: who gets what. Pure.

A dataset with ``samples = k`` generates each prompt (each conversation) k times, each
sample a job of its own. Each (prompt, sample) gets

- an identity (``sample_identity``): sample 0 keeps the prompt's own, so a dataset that
  goes from one sample to several keeps the jobs it has and adds the others;
- a ``sampling_seed`` (``sampling_seed``) from the run's order seed, the prompt and the
  sample index: a re-run asks the server for the same seeds;
- a variant (``choose_variant``) by a seeded hash, in proportion to the variants' weights,
  so the share of each is fixed by the weights however the file is ordered.

A variant is a name, a weight and what it changes: sampling params laid over the dataset's
(``sampling``), chat-template kwargs laid over the run's (``template``). A variant whose
template kwargs change the prompt has prompt ids of its own, templated at enqueue.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Seeds stay below 2**31: a server may hold them in a 32-bit integer.
SEED_BITS = 31
_SCALE = 1 << 64


@dataclass(frozen=True)
class Variant:
    """A named set of sampling params and template kwargs, with its weight."""

    name: str
    weight: float = 1.0
    sampling: Mapping[str, Any] = field(default_factory=dict)
    template: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """What ``datasets.variants`` stores of it."""
        return {
            "name": self.name,
            "weight": self.weight,
            "sampling": dict(self.sampling),
            "template": dict(self.template),
        }

    @classmethod
    def of(cls, stored: Mapping[str, Any]) -> Variant:
        """The variant ``as_json`` stored."""
        return cls(
            str(stored["name"]),
            float(stored.get("weight", 1.0)),
            dict(stored.get("sampling") or {}),
            dict(stored.get("template") or {}),
        )


def variants_of(stored: Sequence[Mapping[str, Any]] | None) -> tuple[Variant, ...]:
    """A dataset's variants as stored (``datasets.variants``)."""
    return tuple(Variant.of(v) for v in stored or ())


def _hash(tag: bytes, seed: int, digest: bytes, sample: int) -> int:
    data = tag + seed.to_bytes(8, "big", signed=True) + digest + sample.to_bytes(4, "big")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def sample_identity(digest: bytes, sample: int) -> bytes:
    """The identity (jobs.prompt_sha256, conversations.digest) of a prompt's ``sample``:
    sample 0 is the prompt's own ``digest``."""
    if sample == 0:
        return digest
    return hashlib.sha256(b"sample" + digest + sample.to_bytes(4, "big")).digest()


def sampling_seed(order_seed: int, digest: bytes, sample: int) -> int:
    """The ``sampling_seed`` a prompt's ``sample`` is sent with."""
    return _hash(b"seed", order_seed, digest, sample) >> (64 - SEED_BITS)


def choose_variant(
    order_seed: int, digest: bytes, sample: int, variants: Sequence[Variant]
) -> Variant | None:
    """The variant of a prompt's ``sample`` (None: the dataset has none): each with a chance
    of its weight over the weights' sum, drawn by a hash of the seed, prompt and sample."""
    if not variants:
        return None
    total = sum(v.weight for v in variants)
    point = _hash(b"variant", order_seed, digest, sample) / _SCALE * total
    for variant in variants:
        point -= variant.weight
        if point < 0:
            return variant
    return variants[-1]


def with_variant(params: Mapping[str, Any], variant: Variant | None) -> dict[str, Any]:
    """Sampling params with a variant's laid over them."""
    return {**params, **(variant.sampling if variant is not None else {})}


def variant_named(variants: Sequence[Variant], name: str | None) -> Variant | None:
    """The variant called ``name`` (None for None or a name not among them)."""
    return next((v for v in variants if v.name == name), None)


def request_params(
    params: Mapping[str, Any],
    variants: Sequence[Variant],
    variant: str | None,
    seed: int | None,
) -> dict[str, Any]:
    """What a job is sent with: its dataset's sampling params, its variant's over them and
    its ``sampling_seed`` when it has one."""
    sent = with_variant(params, variant_named(variants, variant))
    if seed is not None:
        sent["sampling_seed"] = seed
    return sent
