"""The simulator speaks each model family's vocabulary: outputs the family's readers
(`core.families`) cut into reasoning, calls and stop, for every family's test tokenizer."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoTokenizer

from core.families import UNKNOWN, family_for
from eaglegen.assets import TOKENIZER_DIR
from eaglegen.sim import SimConfig, SimServer
from eaglegen.sim.declarations import INVENTED
from tests.helpers import family_tokenizer
from tests.unit.test_sim_tools import matches_schema, tool_rows

# Test tokenizer -> (the family it is served as, its template's keyword arguments).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "kimi_k2": ("kimi_k2", {}),  # the bundled tokenizer
    "qwen3": ("qwen3", {}),  # hybrid: the model opens its reasoning itself
    "qwen3_thinking": ("qwen3", {}),
    "deepseek_r1": ("deepseek_v3", {}),
    "deepseek_v31": ("deepseek_v31", {"thinking": True}),
    "glm45": ("glm45", {}),
    "gpt_oss": ("gpt_oss", {}),
}
SEEDS = 16
# Short outputs and fast steps: the layout, not the timing, is under test.
FAST: dict[str, Any] = {
    "context_length": 8192,
    "decode_step_ms": 0.2,
    "decode_ms_per_request": 0.0,
    "mean_output_tokens": 40,
    "max_output_tokens": 400,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo, and 30 EUR in USD?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's test tokenizer, built once."""
    root = tmp_path_factory.mktemp("families")
    return {
        name: TOKENIZER_DIR if name == "kimi_k2" else family_tokenizer(root, name, structure=True)
        for name in FAMILIES
    }


class Served:
    """One family's tokenizer as the test reads the simulator's outputs."""

    def __init__(self, folder: Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.vocab: dict[str, int] = self.hf.get_vocab()
        self.family = family_for(self.vocab, self.hf.chat_template)
        self.stops = self.family.stop_ids(self.vocab)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.backend_tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt(self, tools: list[Any], **kwargs: Any) -> list[int]:
        ids = self.hf.apply_chat_template(
            MESSAGES, tools=tools, add_generation_prompt=True, return_dict=False, **kwargs
        )
        return list(ids)

    def opens_reasoning(self, prompt: Sequence[int]) -> bool:
        """The producer's rule: the prompt's last id but white space is think-start."""
        start = self.vocab.get("<think>")
        last = next((t for t in reversed(prompt) if self.decode([t]).strip()), None)
        return start is not None and last == start


def generate(url: str, prompt: list[int], params: dict[str, Any]) -> list[list[int]]:
    """The outputs to prompt for sampling seeds 0..SEEDS-1, in one batch."""
    sampling = [{"max_new_tokens": 2000, "sampling_seed": s, **params} for s in range(SEEDS)]
    body = {"input_ids": [prompt] * SEEDS, "sampling_params": sampling}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    outputs = response.json()
    for out in outputs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    return [out["output_ids"] for out in outputs]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_sim(request: pytest.FixtureRequest, folders: dict[str, Path]) -> Iterator[Any]:
    """(test tokenizer's name, Served, simulator) for each family."""
    folder = folders[request.param]
    with SimServer(SimConfig(tokenizer_dir=folder, **FAST)) as sim:
        yield request.param, Served(folder), sim


def declared_names(served: Served, prompt: list[int], tools: list[dict[str, Any]]) -> set[str]:
    """The tools' names when the template wrote them into the prompt, else the simulator's
    made-up functions' (DeepSeek-R1, V3.1 and Qwen3-Thinking's templates declare none)."""
    names = {tool["function"]["name"] for tool in tools}
    if any(name in served.decode(prompt) for name in names):
        return names
    return {fn.name for fn in INVENTED}


def read(served: Served, prompt: list[int], output: list[int]) -> tuple[Any, list[Any]]:
    """(anatomy, calls) of output, as eaglegen's readers read them."""
    family = served.family
    markers = family.markers(served.vocab, served.stops)
    anatomy = family.dissect(output, markers, opens_reasoning=served.opens_reasoning(prompt))
    return anatomy, family.parse_calls(anatomy, served.decode, None)


def test_each_family_reads_back_reasoning_calls_and_stop(family_sim: Any) -> None:
    name, served, sim = family_sim
    assert served.family.name == FAMILIES[name][0]
    tools = tool_rows()[0]["tools"]
    prompt = served.prompt(tools, **FAMILIES[name][1])
    declared = declared_names(served, prompt, tools)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls_seen = 0
    for output in generate(sim.url, prompt, {"stop_token_ids": served.stops}):
        assert all(0 <= t < len(served.hf) for t in output)
        anatomy, calls = read(served, prompt, output)
        assert anatomy.reasoning and anatomy.think_end_present, served.decode(output)
        assert anatomy.answer and anatomy.sections_balanced
        assert anatomy.stop == output[-1] and output[-1] in served.stops
        assert len(calls) == len(anatomy.calls)
        for call in calls:
            assert call.name in declared and call.arguments_json, call
            arguments = json.loads(call.arguments)
            # GLM's values are read back as JSON when they parse ("2024" becomes 2024).
            if call.name in schemas and served.family.name != "glm45":
                assert matches_schema(arguments, schemas[call.name]), call
        calls_seen += len(calls)
    assert calls_seen >= 3  # one prompt in two calls a tool: 16 seeds hold a few


def test_each_family_breaks_arguments_readably(family_sim: Any) -> None:
    name, served, sim = family_sim
    prompt = served.prompt(tool_rows()[0]["tools"], **FAMILIES[name][1])
    httpx.post(f"{sim.url}/sim/faults", json={"broken_tool_args_rate": 1.0}).raise_for_status()
    try:
        outputs = generate(sim.url, prompt, {"stop_token_ids": served.stops})
    finally:
        httpx.post(f"{sim.url}/sim/faults", json={}).raise_for_status()
    calls = [call for output in outputs for call in read(served, prompt, output)[1]]
    assert calls and not any(call.arguments_json for call in calls)


def test_the_server_says_what_it_serves(family_sim: Any, folders: dict[str, Path]) -> None:
    name, served, sim = family_sim
    info = httpx.get(f"{sim.url}/get_model_info").json()
    assert info["tokenizer_path"] == str(folders[name])
    server = httpx.get(f"{sim.url}/get_server_info").json()
    assert server["simulator"]["family"] == served.family.name


def test_a_closed_reasoning_block_gets_an_answer_only(folders: dict[str, Path]) -> None:
    served = Served(folders["qwen3"])
    prompt = served.prompt(tool_rows()[0]["tools"], enable_thinking=False)
    assert not served.opens_reasoning(prompt)
    with SimServer(SimConfig(tokenizer_dir=folders["qwen3"], **FAST)) as sim:
        outputs = generate(sim.url, prompt, {"stop_token_ids": served.stops})
    for output in outputs:
        anatomy, _ = read(served, prompt, output)
        assert anatomy.reasoning is None and served.vocab["</think>"] not in output


def test_a_run_stopping_at_other_ids_gets_its_stop(folders: dict[str, Path]) -> None:
    # The DeepSeek test tokenizer's eos is the bundled <|im_end|>, not its end of sentence:
    # a run whose stop ids are its eos gets outputs ending with one of them.
    served = Served(folders["deepseek_r1"])
    eos = served.vocab["<|im_end|>"]
    prompt = served.prompt(tool_rows()[0]["tools"])
    with SimServer(SimConfig(tokenizer_dir=folders["deepseek_r1"], **FAST)) as sim:
        outputs = generate(sim.url, prompt, {"stop_token_ids": [eos]})
    assert all(output[-1] == eos and output.count(eos) == 1 for output in outputs)


def test_an_unknown_family_gets_reasoning_text_and_stop(caplog: pytest.LogCaptureFixture) -> None:
    served = Served(TOKENIZER_DIR)
    prompt = served.prompt(tool_rows()[0]["tools"])
    with (
        caplog.at_level(logging.WARNING, "eaglegen.sim"),
        SimServer(SimConfig(family="unknown", **FAST)) as sim,
    ):
        outputs = generate(sim.url, prompt, {})
    [warning] = [r.getMessage() for r in caplog.records if r.name.startswith("eaglegen.sim")]
    assert "--family unknown" in warning and "no tool calls" in warning
    markers = UNKNOWN.markers(served.vocab, [served.vocab["<|im_end|>"]])
    for output in outputs:
        anatomy = UNKNOWN.dissect(output, markers, opens_reasoning=True)
        assert anatomy.reasoning and anatomy.stop == output[-1] and not anatomy.calls_checked
        assert served.vocab["<|tool_calls_section_begin|>"] not in output


def _sim(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "eaglegen", "sim", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_an_unusable_tokenizer_is_one_line(tmp_path: Path, folders: dict[str, Path]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": ')
    # A vocabulary of no family and no eos: nothing could end an answer.
    stopless = tmp_path / "stopless"
    stopless.mkdir()
    words = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.save(str(stopless / "tokenizer.json"))
    cases: list[tuple[list[str], Callable[[str], bool]]] = [
        (["--tokenizer", str(empty)], lambda line: "no tokenizer.json" in line),
        (["--tokenizer", str(broken)], lambda line: "does not load" in line),
        (
            ["--tokenizer", str(folders["qwen3"]), "--family", "glm45"],
            lambda line: "<arg_key>" in line,
        ),
        (["--family", "nope"], lambda line: "unknown model family 'nope'" in line),
        (["--tokenizer", str(stopless)], lambda line: "no stop token" in line),
    ]
    running = [(_sim(*args), check) for args, check in cases]  # in parallel: each starts Python
    for process, check in running:
        _, stderr = process.communicate(timeout=60)
        lines = stderr.strip().splitlines()
        assert process.returncode == 2, stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and check(lines[0]), stderr


def test_an_unknown_family_is_one_warning_line() -> None:
    process = _sim("--family", "unknown")
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline() for _ in range(2)]
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert lines[0].startswith("warning: ") and "no tool calls" in lines[0], lines
    assert lines[1].startswith("simulator listening on"), lines
