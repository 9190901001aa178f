"""A prepared batch made into its samples: k jobs (or conversations) per prompt, each with
its variant, sampling seed and identity (core.samples).

The batch is prepared once with the run's template (the base prompts, whose identities
every sample derives from); a variant whose template kwargs change the prompt templates the
rows it is drawn for again, with its own templater. A sample whose prompt ids an earlier
sample of the same row already has names that sample as their holder: the ids are stored
once (models.repository).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from core.samples import Variant, choose_variant, sample_identity, sampling_seed
from models.records import JobBatch, NewConversation, Rejection, SampleColumns, prompt_sha256
from producer.prepare import Prepared
from producer.rows import RawRow

# Prepares a batch of raw rows with one variant's templater: (variant, rows) -> Prepared.
PrepareVariant = Callable[[Variant, list[RawRow]], Prepared]


@dataclass(frozen=True)
class SamplePlan:
    """What a dataset asks of each prompt: ``samples`` of it, spread over ``variants``;
    ``own_template``: the variants whose template kwargs differ from the run's."""

    samples: int = 1
    variants: tuple[Variant, ...] = ()
    order_seed: int = 0
    own_template: frozenset[str] = field(default_factory=frozenset)

    @property
    def active(self) -> bool:
        """Whether jobs carry sample columns: several samples, or variants."""
        return self.samples > 1 or bool(self.variants)

    @classmethod
    def of(
        cls,
        samples: int,
        variants: Sequence[Variant],
        order_seed: int,
        run_kwargs: Mapping[str, Any],
    ) -> SamplePlan:
        """A dataset's samples and variants; those of its variants whose template kwargs
        change the run's (``run_kwargs``) template its rows again."""
        own = frozenset(v.name for v in variants if {**run_kwargs, **v.template} != run_kwargs)
        return cls(samples, tuple(variants), order_seed, own)

    def draw(self, digest: bytes, sample: int) -> Variant | None:
        """The variant of the prompt ``digest``'s ``sample``."""
        return choose_variant(self.order_seed, digest, sample, self.variants)

    def templated_apart(self, variant: Variant | None) -> bool:
        """Whether a sample of ``variant`` has its own prompt (its template kwargs)."""
        return variant is not None and variant.name in self.own_template


@dataclass(frozen=True)
class _Prompt:
    """One prompt as a job stores it."""

    packed: bytes
    tokens: int
    messages: str
    opens_reasoning: bool

    @classmethod
    def at(cls, batch: JobBatch, i: int) -> _Prompt:
        """The ``i``-th job's prompt of ``batch``."""
        return cls(
            batch.packed_ids[i],
            batch.prompt_tokens[i],
            batch.messages_json[i],
            batch.opens_reasoning[i],
        )


def expand(
    plan: SamplePlan, rows: Sequence[RawRow], prepared: Prepared, prepare: PrepareVariant
) -> Prepared:
    """``prepared`` (the base prompts of ``rows``) as the jobs and conversations of every
    sample; a sample whose variant cannot template its row is left out, said as a
    rejection of the row."""
    if not plan.active:
        return prepared
    jobs = JobBatch()
    draws = _draws(plan, prepared)
    alternates, rejections = _alternates(plan, rows, draws, prepare)
    base_rows = zip(prepared.jobs.row_index, prepared.jobs.prompt_sha256, strict=True)
    for i, (row_index, sha) in enumerate(base_rows):
        base = _Prompt.at(prepared.jobs, i)
        holders: dict[bytes, bytes] = {}
        for sample, variant in enumerate(draws[row_index]):
            prompt = _prompt_of(plan, base, variant, alternates.get(row_index, {}))
            if not isinstance(prompt, _Prompt):
                continue
            identity = sample_identity(sha, sample)
            ids_key = sha if prompt is base else prompt_sha256(prompt.packed)
            holder = holders.setdefault(ids_key, identity)
            columns = SampleColumns(
                sample,
                None if variant is None else variant.name,
                sampling_seed(plan.order_seed, sha, sample),
                first=None if sample == 0 else sha,
                holder=None if holder == identity else holder,
            )
            jobs.add(
                row_index,
                identity,
                prompt.packed,
                prompt.tokens,
                prompt.messages,
                prompt.opens_reasoning,
                columns,
            )
    conversations = [
        c
        for base in prepared.conversations
        for c in _conversation_samples(plan, base, draws[base.row_index], alternates)
    ]
    return Prepared(jobs, [*prepared.rejections, *rejections], conversations)


def _draws(plan: SamplePlan, prepared: Prepared) -> dict[int, list[Variant | None]]:
    """Each base row's variants, by sample."""
    digests = dict(zip(prepared.jobs.row_index, prepared.jobs.prompt_sha256, strict=True))
    digests.update((c.row_index, c.row_digest) for c in prepared.conversations)
    return {
        row: [plan.draw(digest, s) for s in range(plan.samples)] for row, digest in digests.items()
    }


_Alternate = dict[int, dict[str, "_Prompt | NewConversation"]]


def _alternates(
    plan: SamplePlan,
    rows: Sequence[RawRow],
    draws: Mapping[int, list[Variant | None]],
    prepare: PrepareVariant,
) -> tuple[_Alternate, list[Rejection]]:
    """The rows templated again by each variant of their own template drawn for them."""
    by_index = {raw.index: raw for raw in rows}
    out: _Alternate = {}
    rejections: list[Rejection] = []
    for variant in {v.name: v for d in draws.values() for v in d if v is not None}.values():
        if not plan.templated_apart(variant):
            continue
        wanted = [
            by_index[r]
            for r, drawn in draws.items()
            if r in by_index and any(v is not None and v.name == variant.name for v in drawn)
        ]
        done = prepare(variant, wanted)
        for i, row_index in enumerate(done.jobs.row_index):
            out.setdefault(row_index, {})[variant.name] = _Prompt.at(done.jobs, i)
        for c in done.conversations:
            out.setdefault(c.row_index, {})[variant.name] = c
        rejections += [
            Rejection(r.row_index, f"variant {variant.name}: {r.reason}", r.excerpt)
            for r in done.rejections
        ]
    return out, rejections


def _prompt_of(
    plan: SamplePlan,
    base: _Prompt | NewConversation,
    variant: Variant | None,
    alternates: Mapping[str, _Prompt | NewConversation],
) -> _Prompt | NewConversation | None:
    """A sample's prompt (a conversation's first turn): its variant's own when the variant
    has a template of its own (None: that template refused the row), else the base."""
    if not plan.templated_apart(variant):
        return base
    assert variant is not None
    alternate = alternates.get(variant.name)
    return alternate if isinstance(alternate, type(base)) else None


def _conversation_samples(
    plan: SamplePlan,
    base: NewConversation,
    draws: list[Variant | None],
    alternates: _Alternate,
) -> list[NewConversation]:
    """A conversation row's samples, each its own conversation."""
    row_digest = base.row_digest
    out = []
    for sample, variant in enumerate(draws):
        first = _prompt_of(plan, base, variant, alternates.get(base.row_index, {}))
        if not isinstance(first, NewConversation):
            continue
        out.append(
            replace(
                first,
                source=base.source,
                sample=sample,
                variant=None if variant is None else variant.name,
                sampling_seed=sampling_seed(plan.order_seed, row_digest, sample),
            )
        )
    return out
