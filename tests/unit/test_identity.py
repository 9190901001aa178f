"""Whether a server serves a run's model: compared by name, whatever the paths."""

from __future__ import annotations

import pytest

from models.records import RunModel
from worker.identity import Served, mismatch

KIMI = Served("/models/Kimi-K2.5", "/models/Kimi-K2.5")


@pytest.mark.parametrize(
    "wanted",
    [
        RunModel("r", "Kimi-K2.5", "/data/tok/Kimi-K2.5"),  # implicit: the tokenizer's name
        RunModel("r", "moonshotai/Kimi-K2.5", "/elsewhere/tokenizer"),  # explicit, hub id
        RunModel("r", "kimi-k2.5/", "/t/x"),  # case and a trailing slash aside
    ],
)
def test_the_same_model_under_other_paths_is_served(wanted: RunModel) -> None:
    assert mismatch(wanted, KIMI) is None


def test_an_implicit_run_matches_the_served_tokenizer_too() -> None:
    sim = Served("eaglegen/sim-reasoner", "/site-packages/eaglegen/assets/tokenizer")
    assert mismatch(RunModel("r", "tokenizer", "/repo/eaglegen/assets/tokenizer"), sim) is None
    # A run that names its model is held to it, whatever the tokenizer is called.
    named = RunModel("r", "org/model-a", "/repo/eaglegen/assets/tokenizer")
    assert "wants model 'org/model-a'" in (mismatch(named, sim) or "")


def test_another_model_is_refused_saying_what_differs() -> None:
    why = mismatch(RunModel("r", "DeepSeek-R1", "/t/DeepSeek-R1"), KIMI)
    assert why == (
        "run 'r' wants model 'DeepSeek-R1', the server serves '/models/Kimi-K2.5' "
        "(tokenizer '/models/Kimi-K2.5')"
    )


def test_a_model_info_without_a_model_path_is_refused() -> None:
    assert Served.of({"model_path": "m", "tokenizer_path": None}) == Served("m", "")
    with pytest.raises(ValueError, match="names no model_path"):
        Served.of({"is_generation": True})
