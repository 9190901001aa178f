"""What an enqueue will do, from a run file or from flags: one shape for both."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.families import family_named
from core.names import check_name
from core.samples import Variant
from core.sampling import complete
from models.ledger import BudgetBasis, ReservePolicy, parse_tokens
from producer.runfile import RunFile


@dataclass(frozen=True)
class DatasetPlan:
    """One dataset to enqueue."""

    name: str
    path: Path
    fmt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    budget_tokens: int | None = None
    budget_basis: BudgetBasis = BudgetBasis.COMPLETION
    limit: int | None = None
    sample_seed: int | None = None
    # What its claims reserve (models.ledger.ReservePolicy); None: the default for a new
    # dataset, the stored policy for one that exists.
    reserve: ReservePolicy | None = None
    # "all" or "last" (runfile.DatasetEntry.turns); None: "all" for a new dataset, the
    # recorded choice for one that exists.
    turns: str | None = None
    # Generations of each prompt and the variants they are spread over (core.samples);
    # None: a new dataset's default (1, none), the recorded ones for one that exists.
    samples: int | None = None
    variants: tuple[Variant, ...] | None = None

    def __post_init__(self) -> None:
        check_name("dataset", self.name)
        for variant in self.variants or ():
            try:
                complete(dict(variant.sampling), [])
            except ValueError as exc:
                where = f"dataset {self.name!r}, variant {variant.name!r}"
                raise ValueError(f"{where}: {exc}") from None
        if self.turns not in (None, "all", "last"):
            raise ValueError(f"turns must be 'all' or 'last', not {self.turns!r}")


@dataclass(frozen=True)
class RunPlan:
    """A run and the datasets to enqueue into it."""

    run: str
    tokenizer: Path
    datasets: list[DatasetPlan]
    model: str | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_context_len: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    # Seeds the order jobs are generated in (models.order); None: a new run draws one.
    order_seed: int | None = None
    # The model family (core.families) by name; None: detected from the tokenizer.
    family: str | None = None

    def __post_init__(self) -> None:
        check_name("run", self.run)

    def sampling_params(self, dataset: DatasetPlan, stop_token_ids: list[int]) -> dict[str, Any]:
        """Every sampling value sent for this dataset: defaults < run < dataset;
        ``stop_token_ids`` unless the run file names its own (stored as given)."""
        return complete({**self.sampling, **dataset.sampling}, stop_token_ids)

    def names_stop_ids(self, dataset: DatasetPlan) -> bool:
        """Whether the run file names the dataset's stop ids (else the tokenizer's default)."""
        return "stop_token_ids" in {**self.sampling, **dataset.sampling}


def plan_from_run_file(run_file: RunFile) -> RunPlan:
    """The plan a validated run file describes."""
    return RunPlan(
        run=run_file.run,
        tokenizer=run_file.tokenizer,
        model=run_file.model,
        trust_remote_code=run_file.trust_remote_code,
        chat_template_kwargs=dict(run_file.chat_template_kwargs),
        max_context_len=run_file.max_context_len,
        sampling=dict(run_file.sampling),
        order_seed=run_file.order_seed,
        family=run_file.family,
        datasets=[
            DatasetPlan(
                name=d.name,
                path=d.path,
                fmt=d.format,
                sampling=dict(d.sampling),
                budget_tokens=d.budget_tokens,
                budget_basis=d.budget_basis,
                limit=d.limit,
                sample_seed=d.sample_seed,
                reserve=d.reserve,
                turns=d.turns,
                samples=d.samples,
                variants=None
                if d.variants is None
                else tuple(
                    Variant(v.name, v.weight, dict(v.sampling), dict(v.chat_template_kwargs))
                    for v in d.variants
                ),
            )
            for d in run_file.datasets
        ],
    )


def plan_from_flags(
    path: Path,
    *,
    run: str | None,
    dataset: str | None,
    tokenizer: Path | None,
    sampling: dict[str, Any],
    fmt: str | None = None,
    max_context_len: int | None = None,
    budget: str | None = None,
    budget_basis: str = "completion",
    limit: int | None = None,
    sample_seed: int | None = None,
    template_kwargs: list[str] | None = None,
    trust_remote_code: bool = False,
    model: str | None = None,
    order_seed: int | None = None,
    family: str | None = None,
    turns: str | None = None,
    samples: int | None = None,
) -> RunPlan:
    """The quick form: one dataset file and the same knobs as flags."""
    missing = [
        flag
        for flag, value in (("--run", run), ("--dataset", dataset), ("--tokenizer", tokenizer))
        if value is None
    ]
    if missing:
        raise ValueError(f"{path}: without a run file, pass {', '.join(missing)}")
    assert run is not None and dataset is not None and tokenizer is not None
    try:
        basis = BudgetBasis(budget_basis)
    except ValueError:
        raise ValueError(
            f"--budget-basis must be completion or total, not {budget_basis!r}"
        ) from None
    return RunPlan(
        run=run,
        tokenizer=tokenizer,
        model=model,
        trust_remote_code=trust_remote_code,
        chat_template_kwargs=parse_template_kwargs(template_kwargs or []),
        max_context_len=max_context_len,
        order_seed=order_seed,
        family=None if family is None else family_named(family).name,
        datasets=[
            DatasetPlan(
                name=dataset,
                path=path,
                fmt=fmt,
                sampling=sampling,
                budget_tokens=parse_tokens(budget),
                budget_basis=basis,
                limit=limit,
                sample_seed=sample_seed,
                turns=turns,
                samples=samples,
            )
        ],
    )


def parse_template_kwargs(items: list[str]) -> dict[str, Any]:
    """``thinking=true`` flags as a dict; values are JSON, or plain strings."""
    kwargs: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--template-kwarg takes NAME=VALUE, got {item!r}")
        try:
            kwargs[name] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[name] = value
    return kwargs
