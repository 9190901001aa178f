"""The TOML run file and the quick-form flags produce the same plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.ledger import BudgetBasis, ReservePolicy
from producer.plan import parse_template_kwargs, plan_from_flags, plan_from_run_file
from producer.runfile import load_run_file

RUN_FILE = """
run = "kimi-k25"
model = "moonshotai/Kimi-K2.5"
tokenizer = "tok"
trust_remote_code = true
max_context_len = 32768

[chat_template_kwargs]
thinking = true

[sampling]
max_new_tokens = 16384
temperature = 1.0

[[datasets]]
name = "chat"
path = "data/chat.jsonl"
budget_tokens = "10M"

[[datasets]]
name = "tools"
path = "/abs/tools.parquet"
format = "parquet"
budget_tokens = "500k"
budget_basis = "total"
limit = 100
sample_seed = 7
[datasets.sampling]
max_new_tokens = 4096
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_run_file_is_parsed_with_paths_relative_to_it(tmp_path: Path) -> None:
    plan = plan_from_run_file(load_run_file(write(tmp_path, RUN_FILE)))
    assert plan.run == "kimi-k25"
    assert plan.tokenizer == tmp_path / "tok"
    assert plan.chat_template_kwargs == {"thinking": True}
    chat, tools = plan.datasets
    assert chat.path == tmp_path / "data/chat.jsonl"
    assert (chat.budget_tokens, chat.budget_basis) == (10_000_000, BudgetBasis.COMPLETION)
    assert tools.path == Path("/abs/tools.parquet")
    assert (tools.budget_tokens, tools.budget_basis) == (500_000, BudgetBasis.TOTAL)
    assert (tools.limit, tools.sample_seed, tools.fmt) == (100, 7, "parquet")


def test_a_dataset_may_name_its_reserve_policy(tmp_path: Path) -> None:
    text = RUN_FILE.replace(
        'budget_tokens = "10M"', 'budget_tokens = "10M"\nreserve = "worst_case"'
    )
    chat, tools = plan_from_run_file(load_run_file(write(tmp_path, text))).datasets
    # Named: applied; left out: the default for a new dataset, kept by one that exists.
    assert (chat.reserve, tools.reserve) == (ReservePolicy.WORST_CASE, None)


def test_sampling_precedence_is_defaults_then_run_then_dataset(tmp_path: Path) -> None:
    plan = plan_from_run_file(load_run_file(write(tmp_path, RUN_FILE)))
    chat, tools = plan.datasets
    assert plan.sampling_params(chat, [4])["max_new_tokens"] == 16384
    params = plan.sampling_params(tools, [4])
    assert params["max_new_tokens"] == 4096
    assert params["temperature"] == 1.0 and params["stop_token_ids"] == [4]
    assert params["top_k"] == -1  # a default, sent explicitly


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("run = ", "invalid TOML"),
        ('run = "r"\ntokenizer = "t"\ndatasets = []', "datasets"),
        ('run = "r"\ntokenizer = "t"\ncolour = 1\n[[datasets]]\nname="a"\npath="x"', "colour"),
        (
            'run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\nbudget_tokens="lots"',
            "datasets.0.budget_tokens",
        ),
        ('run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\nformat="csv"', "format"),
        (
            'run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\nreserve="mean"',
            "datasets.0.reserve",
        ),
        (
            'run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\n'
            '[[datasets]]\nname="a"\npath="y"',
            "unique",
        ),
        ('run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\nsamples=0', "samples"),
        (
            'run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\n'
            '[[datasets.variants]]\nname="v"\n[[datasets.variants]]\nname="v"',
            "variant names must be unique",
        ),
        (
            'run = "r"\ntokenizer = "t"\n[[datasets]]\nname="a"\npath="x"\n'
            '[[datasets.variants]]\nname="v"\nweight=0',
            "datasets.0.variants.0.weight",
        ),
    ],
)
def test_bad_run_files_name_the_file_and_the_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_run_file(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_missing_run_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such run file"):
        load_run_file(tmp_path / "nope.toml")


def test_flags_make_a_one_dataset_plan(tmp_path: Path) -> None:
    plan = plan_from_flags(
        tmp_path / "d.jsonl",
        run="r",
        dataset="d",
        tokenizer=tmp_path,
        budget="2M",
        budget_basis="total",
        sampling={"max_new_tokens": 10},
        template_kwargs=["thinking=false", "mode=fast"],
    )
    [d] = plan.datasets
    assert (d.budget_tokens, d.budget_basis) == (2_000_000, BudgetBasis.TOTAL)
    assert plan.chat_template_kwargs == {"thinking": False, "mode": "fast"}


def test_flags_without_run_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--run, --tokenizer"):
        plan_from_flags(tmp_path / "d.jsonl", run=None, dataset="d", tokenizer=None, sampling={})


def test_template_kwargs_need_a_name() -> None:
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_template_kwargs(["=1"])


def test_a_run_file_may_name_the_model_family_by_name_or_alias(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('family = "hermes"\n' + RUN_FILE)
    assert plan_from_run_file(load_run_file(path)).family == "qwen3"
    path.write_text(RUN_FILE)
    assert plan_from_run_file(load_run_file(path)).family is None  # detected at enqueue
    flags = plan_from_flags(
        tmp_path / "d.jsonl", run="r", dataset="d", tokenizer=tmp_path, sampling={}, family="glm45"
    )
    assert flags.family == "glm45"


def test_an_unknown_family_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('family = "llama"\n' + RUN_FILE)
    with pytest.raises(ValueError, match=r"family: .*unknown model family 'llama'.*qwen3"):
        load_run_file(path)


def test_the_plan_tells_whether_the_run_file_names_its_stop_ids(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(RUN_FILE.replace("temperature = 1.0", "stop_token_ids = [4]"))
    plan = plan_from_run_file(load_run_file(path))
    assert all(plan.names_stop_ids(d) for d in plan.datasets)
    assert plan.sampling_params(plan.datasets[0], [7, 8])["stop_token_ids"] == [4]
    path.write_text(RUN_FILE)
    plan = plan_from_run_file(load_run_file(path))
    assert not any(plan.names_stop_ids(d) for d in plan.datasets)


def test_turns_is_all_or_last_per_dataset_and_unset_by_default(tmp_path: Path) -> None:
    base = 'run = "r"\ntokenizer = "tok"\n[[datasets]]\nname = "a"\npath = "a.jsonl"\n'
    path = tmp_path / "run.toml"
    path.write_text(base + 'turns = "last"\n[[datasets]]\nname = "b"\npath = "b.jsonl"\n')
    plan = plan_from_run_file(load_run_file(path))
    # None: a new dataset answers all turns, one that exists keeps what it recorded.
    assert [d.turns for d in plan.datasets] == ["last", None]
    path.write_text(base + 'turns = "first"\n')
    with pytest.raises(ValueError, match="turns"):
        load_run_file(path)
    with pytest.raises(ValueError, match="turns must be 'all' or 'last'"):
        plan_from_flags(
            tmp_path / "d.jsonl",
            run="r",
            dataset="d",
            tokenizer=tmp_path,
            sampling={},
            turns="every",
        )


def test_samples_and_variants_are_read_and_a_variants_sampling_is_checked(
    tmp_path: Path,
) -> None:
    text = RUN_FILE.replace(
        'budget_tokens = "10M"',
        'budget_tokens = "10M"\nsamples = 4\n[[datasets.variants]]\nname = "think"\n'
        "weight = 3\nsampling = { temperature = 0.6 }\n[[datasets.variants]]\n"
        'name = "fast"\nchat_template_kwargs = { thinking = false }',
    )
    chat, tools = plan_from_run_file(load_run_file(write(tmp_path, text))).datasets
    assert chat.samples == 4 and tools.samples is None and tools.variants is None
    assert chat.variants is not None
    think, fast = chat.variants
    assert (think.name, think.weight, dict(think.sampling)) == ("think", 3.0, {"temperature": 0.6})
    assert (fast.weight, dict(fast.template)) == (1.0, {"thinking": False})
    bad = text.replace("temperature = 0.6", "n = 2")
    with pytest.raises(ValueError, match="dataset 'chat', variant 'think': sampling: 'n' cannot"):
        plan_from_run_file(load_run_file(write(tmp_path, bad)))
