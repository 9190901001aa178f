"""The TOML run file: one run, its tokenizer and sampling, and its datasets."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.families import family_named
from models.ledger import BudgetBasis, ReservePolicy, parse_tokens

FORMATS = ("jsonl", "json", "parquet", "hf")


class VariantEntry(BaseModel):
    """One ``[[datasets.variants]]`` table (core.samples.Variant)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    weight: float = Field(default=1.0, gt=0)
    sampling: dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class DatasetEntry(BaseModel):
    """One ``[[datasets]]`` table."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    path: Path
    format: str | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    budget_tokens: int | None = None
    budget_basis: BudgetBasis = BudgetBasis.COMPLETION
    # None: a new dataset reserves "observed", one that exists keeps its policy.
    reserve: ReservePolicy | None = None
    limit: int | None = Field(default=None, ge=1)
    sample_seed: int | None = None
    # What of a multi-turn row is answered (core.dialogue): "all" its turns, on-policy, or
    # its "last" only; None: a new dataset answers all, one that exists keeps its choice.
    turns: Literal["all", "last"] | None = None
    # Generations of each prompt (core.samples); None: 1 for a new dataset, one that exists
    # keeps its own.
    samples: int | None = Field(default=None, ge=1, le=64)
    variants: list[VariantEntry] | None = None

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, value: list[VariantEntry] | None) -> list[VariantEntry] | None:
        names = [v.name for v in value or ()]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"variant names must be unique, repeated: {duplicated}")
        return value

    @field_validator("budget_tokens", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> int | None:
        return parse_tokens(value)

    @field_validator("format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        if value is not None and value not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}")
        return value


class RunFile(BaseModel):
    """The whole run file."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(min_length=1, max_length=200)
    tokenizer: Path
    model: str | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_context_len: int | None = Field(default=None, ge=2)
    sampling: dict[str, Any] = Field(default_factory=dict)
    order_seed: int | None = Field(default=None, ge=0, lt=1 << 62)
    # The model family whose layout the generations have (core.families); None: detected
    # from the tokenizer's special tokens and template.
    family: str | None = None
    datasets: list[DatasetEntry] = Field(min_length=1)

    @field_validator("family")
    @classmethod
    def _family(cls, value: str | None) -> str | None:
        return None if value is None else family_named(value).name

    @field_validator("datasets")
    @classmethod
    def _unique_names(cls, value: list[DatasetEntry]) -> list[DatasetEntry]:
        names = [d.name for d in value]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"dataset names must be unique, repeated: {duplicated}")
        return value


def load_run_file(path: Path) -> RunFile:
    """Parse and validate ``path``; relative paths are taken from the file's folder."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such run file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None
    try:
        run_file = RunFile.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{path}: {_describe(exc)}") from None
    return _resolve_paths(run_file, path.parent)


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
    )


def _resolve_paths(run_file: RunFile, base: Path) -> RunFile:
    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else (base / p)

    datasets = [d.model_copy(update={"path": resolve(d.path)}) for d in run_file.datasets]
    return run_file.model_copy(
        update={"tokenizer": resolve(run_file.tokenizer), "datasets": datasets}
    )
