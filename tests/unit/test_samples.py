"""Samples and variants (core.samples): identities, seeds and the draw of variants by weight."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from core.samples import (
    SEED_BITS,
    Variant,
    choose_variant,
    request_params,
    sample_identity,
    sampling_seed,
    variants_of,
)
from core.sampling import complete

DIGESTS = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]


def test_sample_zero_keeps_the_prompts_identity_and_the_others_are_distinct() -> None:
    digest = DIGESTS[0]
    assert sample_identity(digest, 0) == digest
    others = {sample_identity(digest, s) for s in range(1, 64)}
    assert len(others) == 63 and digest not in others
    # Another prompt's samples never meet these.
    assert others.isdisjoint(sample_identity(DIGESTS[1], s) for s in range(64))


def test_seeds_are_stable_distinct_per_sample_and_within_31_bits() -> None:
    seeds = [sampling_seed(7, DIGESTS[0], s) for s in range(8)]
    assert seeds == [sampling_seed(7, DIGESTS[0], s) for s in range(8)]
    assert len(set(seeds)) == 8
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert seeds != [sampling_seed(8, DIGESTS[0], s) for s in range(8)]  # the run's seed counts


def test_variants_are_drawn_in_proportion_to_their_weights() -> None:
    variants = (Variant("think", 3.0), Variant("fast", 1.0))
    drawn = Counter(
        v.name for d in DIGESTS for s in range(2) if (v := choose_variant(11, d, s, variants))
    )
    share = drawn["think"] / sum(drawn.values())
    # 40,000 draws: the standard error of a 0.75 share is about 0.002.
    assert 0.74 < share < 0.76, drawn
    # Seeded: the same draw every time; another seed draws otherwise.
    again = [choose_variant(11, d, 0, variants) for d in DIGESTS[:100]]
    assert again == [choose_variant(11, d, 0, variants) for d in DIGESTS[:100]]
    assert again != [choose_variant(12, d, 0, variants) for d in DIGESTS[:100]]
    assert choose_variant(11, DIGESTS[0], 0, ()) is None


def test_a_jobs_request_lays_its_variant_and_seed_over_the_datasets_params() -> None:
    stored = [
        Variant("cold", 1.0, {"temperature": 0.2}, {}).as_json(),
        Variant("short", 1.0, {"max_new_tokens": 8}, {"thinking": False}).as_json(),
    ]
    variants = variants_of(stored)
    assert variants[1].template == {"thinking": False}
    params = {"temperature": 1.0, "max_new_tokens": 100}
    assert request_params(params, variants, "short", 42) == {
        "temperature": 1.0,
        "max_new_tokens": 8,
        "sampling_seed": 42,
    }
    assert request_params(params, variants, None, None) == params
    assert request_params(params, variants, "cold", None)["temperature"] == 0.2


def test_n_is_refused_with_the_way_to_several_samples() -> None:
    with pytest.raises(ValueError, match="samples = k"):
        complete({"n": 4}, [])
