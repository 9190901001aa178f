"""Whether a server serves a run's model: compared by name, whatever the paths."""

from __future__ import annotations

import pytest

from core.settings import ServerSpec
from models.records import RunModel
from worker.identity import Served, mismatch
from worker.servers import Server
from worker.sglang import SGLangClient

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


def test_what_a_server_says_it_serves_is_kept_without_control_characters() -> None:
    # Logged, in the heartbeat, in `status` and in jobs' last_error: escaped, never raw.
    hostile = Served.of({"model_path": "m\x1b]0;pwned\x07", "tokenizer_path": "t\x1b[2J"})
    assert hostile == Served("m\\x1b]0;pwned\\x07", "t\\x1b[2J")


def test_an_answer_counts_for_the_run_only_while_the_server_still_serves_its_model() -> None:
    spec = ServerSpec(name="s", url="http://127.0.0.1:9")  # never called
    server = Server(spec, SGLangClient(spec, timeout_s=1.0), limit=1)
    run = RunModel("r", "Kimi-K2.5", "/t/Kimi-K2.5")
    try:
        assert "not known yet" in (server.still_serves(run) or "")
        server.known = server.served = KIMI
        assert server.still_serves(run) is None
        # Down, then back up and not asked yet: nothing says another model answered.
        server.served = None
        assert server.still_serves(run) is None
        # Asked again, it serves another model: what it answered meanwhile is not the run's.
        server.known = server.served = Served("/models/DeepSeek-R1", "")
        assert (server.still_serves(run) or "").startswith("s changed model: run 'r' wants")
    finally:
        server.client.close()
