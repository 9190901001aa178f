"""`eaglegen stats`, `show` and `sample` as a user runs them: a subprocess on real Postgres;
the HTML page opened in headless Chromium; errors as one line."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image, ImageStat
from selenium.webdriver.common.by import By

from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.records import RunSpec
from models.repository import Repository
from tests.browser import chromium
from tests.e2e.test_cli import eaglegen, service_env
from tests.e2e.test_export_cli import one_line_error
from tests.integration.test_stats import EDGES, record_edges, report

pytestmark = pytest.mark.e2e
# A dataset name that is HTML, rich markup and matplotlib mathtext at once.
HOSTILE = "<i>fc</i> & [b]x[/b] $y$"
PLOTS = {
    "completion_lengths.png",
    "finish_reasons.png",
    "reasoning_split.png",
    "prompt_vs_completion.png",
}


def spread(png: bytes) -> float:
    """The largest standard deviation of a channel: 0 for a blank image."""
    with Image.open(io.BytesIO(png)) as image:
        return max(ImageStat.Stat(image.convert("RGB")).stddev)


@pytest.fixture
def edges(repo: Repository) -> dict[str, list[int]]:
    """Run "edges": the EDGES in dataset "edge" and again in the HOSTILE one."""
    cut = len(EDGES[3][1])
    return {name: record_edges(repo, cut, dataset=name) for name in ("edge", HOSTILE)}


def test_stats_writes_json_html_and_plots_and_the_page_renders(
    settings: Settings, repo: Repository, edges: dict[str, list[int]], tmp_path: Path
) -> None:
    env = service_env(settings)
    html, plots = tmp_path / "report.html", tmp_path / "plots"
    done = eaglegen("stats", "--json", "--html", str(html), "--plots", str(plots), env=env)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document == report(repo.engine, "edges")
    assert [d["dataset"] for d in document["datasets"]] == sorted(edges)
    assert "warning: 2 generations of `edge` lack `</think>`" in done.stderr
    assert f"2 generations of `{HOSTILE}` lack" in done.stderr  # as it is, not as markup
    assert {p.name for p in plots.iterdir()} == PLOTS
    for png in plots.iterdir():
        assert spread(png.read_bytes()) > 10, png.name
    page = html.read_text()
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert "<i>fc</i>" not in page and "&lt;i&gt;fc&lt;/i&gt;" in page
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert {base64.b64decode(e) for e in embedded} == {p.read_bytes() for p in plots.iterdir()}


@pytest.mark.needs("browser")
def test_the_html_report_renders_in_chromium_with_names_as_text(
    settings: Settings, edges: dict[str, list[int]], tmp_path: Path
) -> None:
    html = tmp_path / "report.html"
    done = eaglegen("stats", "--html", str(html), env=service_env(settings))
    assert done.returncode == 0, done.stderr
    with chromium() as browser:
        browser.get(html.as_uri())
        text = browser.find_element(By.TAG_NAME, "body").text
        shot = browser.get_screenshot_as_png()
        images = browser.find_elements(By.TAG_NAME, "img")
        loaded = [browser.execute_script("return arguments[0].naturalWidth", i) for i in images]
        italics = browser.find_elements(By.TAG_NAME, "i")
        # In a narrow window the widest table scrolls inside its own box; the page does not.
        browser.set_window_size(600, 1000)
        page_overflow = browser.execute_script(
            "const root = document.documentElement; return root.scrollWidth - root.clientWidth"
        )
        boxes = browser.execute_script(
            "const right = document.documentElement.clientWidth;"
            "return [...document.querySelectorAll('div.scroll')].map(b => "
            "[b.scrollWidth > b.clientWidth, b.getBoundingClientRect().right <= right])"
        )
    (tmp_path / "report-screenshot.png").write_bytes(shot)
    assert page_overflow == 0
    assert len(boxes) == 4 and all(inside for _, inside in boxes)
    assert any(scrolls for scrolls, _ in boxes)  # the completion table is wider than 600 px
    assert spread(shot) > 10
    assert "edge" in text and HOSTILE in text and "lack `</think>`" in text
    assert len(images) == len(PLOTS) and all(w > 100 for w in loaded)
    assert italics == []  # the dataset's <i> is text, not markup


def test_the_terminal_report_shows_the_tables_and_the_warnings_first(
    settings: Settings, edges: dict[str, list[int]]
) -> None:
    done = eaglegen("stats", "edges", "--dataset", "edge", env=service_env(settings))
    assert done.returncode == 0, done.stderr
    for title in ("completion tokens", "reasoning and answers", "tool calls", "cache and latency"):
        assert title in done.stdout
    assert "run edges: 9 generations of 9 jobs" in done.stdout
    assert HOSTILE not in done.stdout  # --dataset left it out
    lines = done.stderr.splitlines()
    assert lines[0].startswith("warning: 11% of `edge` truncated at")
    assert any("1 of 5 tool calls of `edge` has arguments that are not JSON" in ln for ln in lines)


def test_show_decodes_each_part_with_the_special_tokens_visible(
    settings: Settings, edges: dict[str, list[int]]
) -> None:
    env = service_env(settings)
    broken = edges["edge"][5]  # "broken arguments"
    done = eaglegen("show", str(broken), "--json", env=env)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["job_id"], shown["dataset"], shown["finish_type"]) == (broken, "edge", "stop")
    assert (shown["reasoning"], shown["think_end_present"], shown["answer"]) == ("x", True, "")
    [call] = shown["tool_calls"]
    assert call == {
        "name": "get_weather",
        "index": 0,
        "arguments": "{'city': 1}",
        "arguments_json": False,
        "declared": True,
    }
    assert shown["stop"] == "<|im_end|>" and shown["sections_balanced"] is True
    assert shown["prompt_tail_tokens"] == 3

    text = eaglegen("show", str(broken), env=env)
    assert text.returncode == 0, text.stderr
    for part in (
        "reasoning",
        "</think>: present",
        "get_weather",
        "arguments NOT JSON",
        "<|im_end|>",
    ):
        assert part in text.stdout, part
    missing = eaglegen("show", str(edges["edge"][2]), env=env)  # "no think-end, stopped"
    assert "</think>: MISSING" in missing.stdout and "I keep thinking" in missing.stdout


def test_sample_picks_what_where_asks_for_the_same_way_every_time(
    settings: Settings, edges: dict[str, list[int]]
) -> None:
    env = service_env(settings)
    base = ("sample", "edges", "--dataset", "edge", "-n", "9", "--seed", "3", "--json")
    picks = {"no-think-end": [2, 3], "truncated": [3, 8], "tool-calls": [1, 5, 6, 7, 8]}
    for where, picked in picks.items():
        result = eaglegen(*base, "--where", where, env=env)
        assert result.returncode == 0, result.stderr
        samples = json.loads(result.stdout)["samples"]
        assert sorted(s["job_id"] for s in samples) == [edges["edge"][i] for i in picked], where
    # Without RUN: the only run there is.
    four = eaglegen("sample", "--dataset", "edge", "-n", "4", "--seed", "3", "--json", env=env)
    same = eaglegen("sample", "--dataset", "edge", "-n", "4", "--seed", "3", "--json", env=env)
    assert four.returncode == 0, four.stderr
    assert four.stdout == same.stdout
    assert len(json.loads(four.stdout)["samples"]) == 4


def test_errors_are_one_line_and_exit_2(
    settings: Settings, repo: Repository, edges: dict[str, list[int]], tmp_path: Path
) -> None:
    env = service_env(settings)
    cases = [
        (("stats", "nope"), "run 'nope' not found"),
        (("stats", "edges", "--dataset", "zz"), "run 'edges' has no dataset 'zz' (it has: "),
        (("show", "999999"), "no job 999999"),
        (("sample", "edges"), "--dataset is required"),
    ]
    for args, message in cases:
        result = eaglegen(*args, env=env)
        assert result.returncode == 2, (args, result.stderr)
        assert message in one_line_error(result.stderr), args
    repo.ensure_run(RunSpec("elsewhere", str(tmp_path / "gone"), "c" * 64, "d" * 64, "m"))
    several = eaglegen("stats", env=env)
    assert "the database holds 2 runs: name one (edges, elsewhere)" in one_line_error(
        several.stderr
    )
    gone = eaglegen("stats", "elsewhere", env=env)
    assert "is not on this machine: pass --tokenizer PATH" in one_line_error(gone.stderr)
    moved = eaglegen("stats", "elsewhere", "--tokenizer", str(TOKENIZER_DIR), "--json", env=env)
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["total"]["generations"] == 0
