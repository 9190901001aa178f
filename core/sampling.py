"""The SGLang sampling contract: every key the worker may send, once.

The producer completes and validates a run's sampling params against this table and stores
them with the dataset; the worker sends exactly what was stored, after checking it against
the same table (SGLang raises on an unknown key, docs/design.md §5).

A key with a default is always sent, so the server's own defaults (which SGLang takes from
the model's generation config) never decide a run. A key without one is sent only when the
run file sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NUMBER = (int, float)


@dataclass(frozen=True)
class Param:
    """One key of SGLang's ``sampling_params``."""

    name: str
    kinds: tuple[type, ...]
    default: Any = None  # None: not sent unless set
    settable: bool = True  # may a run file or a flag set it
    refusal: str = ""  # why it may not, when it may not


PARAMS: tuple[Param, ...] = (
    Param("max_new_tokens", (int,), 4096),
    Param("temperature", NUMBER, 1.0),
    Param("top_p", NUMBER, 0.95),
    Param("top_k", (int,), -1),
    Param("min_p", NUMBER, 0.0),
    Param("frequency_penalty", NUMBER, 0.0),
    Param("presence_penalty", NUMBER, 0.0),
    Param("repetition_penalty", NUMBER, 1.0),
    Param("ignore_eos", (bool,), False),
    Param("skip_special_tokens", (bool,), False),
    # Filled from the tokenizer's stop tokens by `complete`; a run file may replace them.
    Param("stop_token_ids", (list,)),
    Param("min_new_tokens", (int,)),
    Param("stop", (str, list)),
    Param("spaces_between_special_tokens", (bool,)),
    Param("sampling_seed", (int,)),
    Param("no_stop_trim", (bool,)),
    Param(
        "n",
        (int,),
        settable=False,
        refusal=(
            "one job is one sample: set `samples = k` on the dataset (--samples k) for k "
            "samples of each prompt, each a job with its own sampling_seed"
        ),
    ),
)
BY_NAME = {p.name: p for p in PARAMS}
DEFAULTS: dict[str, Any] = {p.name: p.default for p in PARAMS if p.default is not None}


def complete(overrides: dict[str, Any], stop_token_ids: list[int]) -> dict[str, Any]:
    """What a dataset's jobs send: defaults, then the tokenizer's stop ids, then the user's.

    Raises ValueError naming every key that is unknown, refused or of the wrong type.
    """
    problems = [p for name, value in overrides.items() if (p := _problem(name, value))]
    if problems:
        raise ValueError("sampling: " + "; ".join(problems))
    return {**DEFAULTS, "stop_token_ids": list(stop_token_ids), **overrides}


def unsendable(params: dict[str, Any]) -> list[str]:
    """The keys of stored params the worker must not send (a database edited by hand)."""
    return sorted(name for name in params if name not in BY_NAME or not BY_NAME[name].settable)


def _problem(name: str, value: Any) -> str | None:
    param = BY_NAME.get(name)
    if param is None:
        return f"unknown sampling param {name!r} (known: {', '.join(sorted(BY_NAME))})"
    if not param.settable:
        return f"{name!r} cannot be set: {param.refusal}"
    # bool is an int in Python: a `true` where a number belongs is a mistake, not a 1.
    wrong_bool = isinstance(value, bool) and bool not in param.kinds
    if wrong_bool or not isinstance(value, param.kinds):
        wanted = " or ".join(k.__name__ for k in param.kinds)
        return f"{name!r} must be {wanted}, got {value!r}"
    return None
