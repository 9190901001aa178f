"""The pure figures of `eaglegen stats` (eaglegen/report/quality.py) and the page and views
built from them, on ids of the bundled tokenizer."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer

from core.anatomy import dissect, markers_from_vocab, parse_calls
from eaglegen.assets import TOKENIZER_DIR, special_ids
from eaglegen.report.html import page
from eaglegen.report.plots import label, plots
from eaglegen.report.quality import (
    Figures,
    Report,
    ToolTally,
    bin_width,
    dataset_warnings,
    declared_names,
    histogram_document,
    no_generations,
    percent,
    total_tools,
)
from eaglegen.report.samples import view
from eaglegen.report.stats import sparkline
from models.stats import Detail, Histogram, Spread

TOKENIZER = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
IDS = special_ids()
EOS, THINK_END = IDS.im_end, IDS.think_end
SB, SE = IDS.tool_calls_section_begin, IDS.tool_calls_section_end
CB, AB, CE = IDS.tool_call_begin, IDS.tool_call_argument_begin, IDS.tool_call_end
MARKERS = markers_from_vocab(TOKENIZER.get_vocab(), [EOS])


def enc(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def decode(ids: object) -> str:
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=False))  # type: ignore[call-overload]


def call(name: str, arguments: str) -> list[int]:
    return [CB, *enc(f"functions.{name}:0"), AB, *enc(arguments), CE]


def figures(name: str | None = "chat", **sql: int) -> Figures:
    agg = dataclasses.replace(no_generations(name), **sql)
    return Figures(name, {"done": agg.generations}, 100, agg, {}, Histogram(1, {}), None)


@pytest.mark.parametrize(
    ("largest", "width"), [(None, 1), (0, 1), (39, 1), (40, 2), (16_384, 410), (4.0, 1)]
)
def test_bin_width_fits_zero_to_the_largest_in_forty_bins(
    largest: float | None, width: int
) -> None:
    assert bin_width(largest) == width
    assert int(largest or 0) // width < 40


@pytest.mark.parametrize(
    ("share", "text"), [(0.23, "23%"), (0.023, "2.3%"), (0.0041, "0.41%"), (0.0, "0%"), (1, "100%")]
)
def test_percent_keeps_small_shares_visible(share: float, text: str) -> None:
    assert percent(share) == text


def test_declared_names_reads_openai_and_flat_tools_and_none_is_none() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}, {"name": "b"}, "junk", {"x": 1}]
    assert declared_names(tools) == {"a", "b"}
    assert declared_names(None) is None and declared_names([]) == frozenset()


def test_truncation_warns_from_one_percent_and_names_the_cut() -> None:
    assert dataset_warnings(figures(generations=1000, at_max_new=9, length=9), "</think>") == []
    [warning] = dataset_warnings(figures(generations=1000, at_max_new=230, length=230), "x")
    assert warning == "23% of `chat` truncated at 100 tokens (230 of 1,000 generations)"


def test_think_end_and_empty_answer_warnings_count_and_agree_in_number() -> None:
    found = dataset_warnings(
        figures(generations=50, opens_reasoning=50, no_think_end=41, no_think_end_cut=38,
                empty_answers=1),
        "</think>",
    )  # fmt: skip
    assert found == [
        "41 generations of `chat` lack `</think>` (38 cut by length, 3 stopped without it)",
        "1 generation of `chat` has an empty answer",
    ]


def test_the_tally_tells_broken_undeclared_unclosed_and_cut_calls_apart() -> None:
    outputs = [
        ([THINK_END, SB, *call("get", '{"a": 1}'), SE, EOS], "stop", ["get"]),
        ([THINK_END, SB, *call("get", "{'a': 1}"), SE, EOS], "stop", ["get"]),
        ([THINK_END, SB, *call("rm", "{}"), *call("get", "{}"), SE, EOS], "stop", ["get"]),
        ([THINK_END, SB, *call("get", "{}"), EOS], "stop", ["get"]),
        ([THINK_END, SB, CB, *enc("functions.ge")], "length", ["get"]),
        ([THINK_END, SB, *call("get", "{}"), SE, EOS], "stop", None),  # no tools declared
    ]
    tally = ToolTally()
    for job_id, (ids, finish, declared) in enumerate(outputs):
        anatomy = dissect(ids, MARKERS, opens_reasoning=True)
        calls = parse_calls(anatomy, decode, None if declared is None else set(declared))
        tally.add("fc", job_id, anatomy, calls, finish)
    fc = tally.figures("fc", (10, 5))
    assert (fc.checked, fc.declared, fc.with_calls, fc.calls) == (10, 5, 6, 7)
    assert (fc.invalid_arguments, fc.undeclared, fc.unbalanced, fc.cut_in_section) == (1, 2, 1, 1)
    assert fc.examples == {"invalid_arguments": [1], "undeclared": [2, 5], "unbalanced": [3]}
    total = total_tools([fc, None, tally.figures("other", (3, 0))])
    assert total is not None and (total.checked, total.calls, total.undeclared) == (13, 7, 2)
    assert total_tools([None]) is None


def test_histograms_are_dense_and_sparklines_scale_to_the_largest_bin() -> None:
    assert histogram_document(Histogram(5, {0: 2, 3: 1})) == {
        "bin_width": 5,
        "counts": [2, 0, 0, 1],
    }
    assert histogram_document(Histogram(5, {}))["counts"] == []
    line = sparkline([1, 0, 8, 4])
    assert len(line) == 4 and line[1] == " " and line[2] == "█"
    assert len(sparkline(list(range(100)), width=20)) == 20 and sparkline([0, 0]) == ""


HOSTILE = "<script>alert(1)</script> $x$ \x1b[31m"


def test_the_page_escapes_names_and_embeds_every_plot() -> None:
    spread = Spread(5, 9, 10, 10)
    agg = dataclasses.replace(
        no_generations(HOSTILE), generations=4, completion_sum=30, completion=spread,
        prompt_sum=8, prompt=spread, latency=spread,
    )  # fmt: skip
    histogram = Histogram(2, {0: 1, 4: 3})
    one = Figures(HOSTILE, {"done": 4}, 10, agg, {"stop": 4}, histogram, None)
    total = dataclasses.replace(one, name=None)
    report = Report("r", "</think>", (one,), total, None, ((HOSTILE, 3, 5), (HOSTILE, 4, 9)))
    pngs = plots(report)
    assert len(pngs) == 4 and all(p.startswith(b"\x89PNG") for p in pngs.values())
    html = page(report, pngs)
    assert "<script>" not in html and "&lt;script&gt;" in html and "\x1b" not in html
    assert html.count("data:image/png;base64,") == 4
    assert label("$x$") == r"\$x\$" and label(None) == "(run)"


def test_a_view_cuts_a_generation_into_its_decoded_parts() -> None:
    output = [*enc("Let me see"), THINK_END, *enc("Here."), SB, *call("get", "{'a'"), SE, EOS]
    tools = [{"type": "function", "function": {"name": "get"}}]
    detail = Detail(
        7, "r", "fc", 0, "done", enc("the prompt ends here"), True, tools, (EOS,), output,
        "stop", EOS, len(output), 5, 0, 0.1, "sim", True,
    )  # fmt: skip
    v = view(detail, decode, MARKERS, tail=2)
    assert v.reasoning == "Let me see" and v.think_end_present is True
    assert v.answer == "Here." and v.stop == "<|im_end|>" and v.prompt_tail_tokens == 2
    assert decode(enc("the prompt ends here")).endswith(v.prompt_tail)
    [c] = v.tool_calls
    assert (c.name, c.index, c.arguments, c.arguments_json, c.declared) == (
        "get", 0, "{'a'", False, True,
    )  # fmt: skip
    assert v.document()["tool_calls"][0]["name"] == "get"
    ungenerated = view(dataclasses.replace(detail, output_ids=None), decode, MARKERS)
    assert not ungenerated.generated and ungenerated.answer == ""
