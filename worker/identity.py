"""Which model a server serves, and whether it is a run's: a run's prompts go to its model only.

The run records its model name (the run file's ``model``, else the tokenizer folder's name)
and its tokenizer folder; a server says what it serves in ``/get_model_info`` (SGLang's
``model_path`` and ``tokenizer_path``). Paths differ between hosts, so names are compared by
their last component, case aside. A run that names its model explicitly is matched on the
served model only; one that does not, on the served model or the served tokenizer's name.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.text import visible
from models.records import RunModel


@dataclass(frozen=True)
class Served:
    """What one server said it serves."""

    model_path: str
    tokenizer_path: str

    @classmethod
    def of(cls, model_info: Any) -> Served:
        """From a ``/get_model_info`` body; ValueError if it names no model."""
        if not isinstance(model_info, dict) or not isinstance(model_info.get("model_path"), str):
            raise ValueError(f"/get_model_info names no model_path: {str(model_info)[:200]}")
        tokenizer = model_info.get("tokenizer_path")
        # The server's words go to logs, the heartbeat, `status` and jobs' last_error: never
        # with the control characters that would rewrite the terminal showing them.
        return cls(
            visible(model_info["model_path"]),
            visible(tokenizer) if isinstance(tokenizer, str) else "",
        )


def name(path: str) -> str:
    """A model or tokenizer path's last component, lower case: what is compared."""
    return path.rstrip("/").rsplit("/", 1)[-1].lower()


def mismatch(wanted: RunModel, served: Served) -> str | None:
    """None when ``served`` is the run's model, else what differs."""
    if name(wanted.model) == name(served.model_path):
        return None
    implicit = name(wanted.model) == name(wanted.tokenizer_path)
    if (
        implicit
        and served.tokenizer_path
        and name(wanted.tokenizer_path) == name(served.tokenizer_path)
    ):
        return None
    return (
        f"run {wanted.run!r} wants model {wanted.model!r}, the server serves "
        f"{served.model_path!r} (tokenizer {served.tokenizer_path or 'not said'!r})"
    )
