"""Batches prepared in worker processes equal batches prepared in-process, in the same order."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from bench.procs import descendants
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from producer import enqueue
from producer.commands import run_enqueue
from producer.enqueue import batches
from producer.parallel import Preparer
from producer.plan import DatasetPlan, RunPlan
from producer.prepare import Prepared, prepare
from producer.readers import iter_rows
from producer.template import Templater
from tests.helpers import sample_rows, write_jsonl

BAD_ROWS: list[Any] = [
    "{broken json",
    [1, 2],
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "wizard", "content": "hi"}]},
]


def dataset(tmp_path: Path) -> Path:
    """The whole sample dataset (tools, multi-turn) with bad rows and repeats mixed in."""
    rows = sample_rows(300)
    mixed: list[Any] = [*rows[:100], *BAD_ROWS, *rows[100:], *rows[:20]]
    return write_jsonl(tmp_path / "d.jsonl", mixed)


def flat(prepared: list[Prepared]) -> list[tuple[Any, ...]]:
    """Everything a batch hands on, as plain comparable values."""
    out: list[tuple[Any, ...]] = []
    for p in prepared:
        out.extend(("job", *job) for job in p.jobs.rows())
        out.extend(("rejected", r.row_index, r.reason, r.excerpt) for r in p.rejections)
        out.append(("end of batch",))
    return out


def prepared_by(preparer: Preparer, path: Path, size: int) -> list[Prepared]:
    with preparer:
        # Undecoded rows, as the enqueue reads them: decoding happens where a batch goes.
        rows = iter_rows(path, decode=False)
        futures = [preparer.submit(b, 200, 64) for b in batches(rows, size)]
        return [preparer.result(f) for f in futures]


@pytest.mark.parametrize("template_kwargs", [{}, {"thinking": False}])
def test_pool_and_in_process_prepare_the_same_batches(
    tmp_path: Path, template_kwargs: dict[str, Any]
) -> None:
    path = dataset(tmp_path)
    templater = Templater(TOKENIZER_DIR, template_kwargs=template_kwargs)
    # The reference: the plain sequential stage, batch by batch.
    expected = [prepare(templater, b, 200, 64) for b in batches(iter_rows(path), 16)]
    in_process = prepared_by(Preparer(templater, 0), path, 16)
    pooled = prepared_by(Preparer(templater, 2), path, 16)
    assert flat(in_process) == flat(expected)
    assert flat(pooled) == flat(expected)
    reasons = {r.reason for p in expected for r in p.rejections}
    assert reasons == {"invalid_json", "not_an_object", "empty_prompt", "unknown_role", "too_long"}


def test_enqueue_with_workers_stores_what_in_process_stores(
    settings: Settings, repo: Repository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(enqueue, "BATCH_ROWS", 32)  # many batches, spread over the workers
    path = dataset(tmp_path)

    def run(name: str, workers: int) -> dict[str, Any]:
        plan = RunPlan(
            run=name,
            tokenizer=TOKENIZER_DIR,
            datasets=[DatasetPlan("d", path, sampling={"max_new_tokens": 64})],
            max_context_len=200,
        )
        report = run_enqueue(settings, settings.services(), plan, quiet=True, workers=workers)
        return report.as_dict()["datasets"]["d"]  # type: ignore[no-any-return]

    assert run("pooled", 2) == run("in-process", 0)
    jobs: dict[int, list[tuple[int, list[int], str]]] = {}
    for job_id in repo.job_ids():  # in id order: the order jobs were inserted
        job = repo.job(job_id)
        assert job is not None
        stored = (job["row_index"], job["input_ids"], json.dumps(job["messages"]))
        jobs.setdefault(job["dataset_id"], []).append(stored)
    pooled, in_process = sorted(jobs)  # the pooled run's dataset was created first
    assert jobs[pooled] == jobs[in_process] and len(jobs[pooled]) > 250
    assert repo.rejected_rows(pooled) == repo.rejected_rows(in_process) != []


# A main process with a template pool; with "server", a thread runs before the pool starts,
# so its workers come from a fork server instead of forking from the main process.
MAIN = textwrap.dedent("""
    import sys, threading, time
    from eaglegen.assets import TOKENIZER_DIR
    from producer.parallel import Preparer
    from producer.rows import RawRow
    from producer.template import Templater

    if __name__ == "__main__":
        if sys.argv[1] == "server":
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        preparer = Preparer(Templater(TOKENIZER_DIR), 2)
        batches = [[RawRow(i, {"prompt": f"hi {i}"})] for i in range(4)]
        for future in [preparer.submit(batch, None, 16) for batch in batches]:
            future.result()
        print("ready", "forked" if preparer.forked else "server", flush=True)
        sys.stdin.read()
""")


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start", ["forked", "server"])
def test_workers_leave_when_the_main_process_is_killed(tmp_path: Path, start: str) -> None:
    script = tmp_path / "main.py"
    script.write_text(MAIN)
    with subprocess.Popen(
        [sys.executable, str(script), start],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as main:
        try:
            assert main.stdout is not None and main.stdout.readline().split() == ["ready", start]
            helpers = descendants(main.pid)
            assert len(helpers) >= (2 if start == "forked" else 3)  # + the fork server
        finally:
            main.kill()  # no clean-up runs: the pool is never shut down
    deadline = time.monotonic() + 30
    while any(map(running, helpers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, helpers))


# What the installed `eaglegen` console script runs at its top level, then a template pool
# from the fork server (a running thread rules out forking from the main process), whose
# workers run the main script again.
CONSOLE_MAIN = textwrap.dedent("""
    import sys, threading, time
    from eaglegen.__main__ import main  # the console script's own import

    def modules() -> list[str]:
        return sorted(sys.modules)

    if __name__ == "__main__":
        from eaglegen.assets import TOKENIZER_DIR
        from producer.parallel import Preparer
        from producer.rows import RawRow
        from producer.template import Templater

        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        preparer = Preparer(Templater(TOKENIZER_DIR), 1)
        preparer.submit([RawRow(0, {"prompt": "hi"})], None, 16).result()
        assert not preparer.forked
        here = "eaglegen.cli" in sys.modules
        worker = preparer._pool.submit(modules).result()
        print(here, "eaglegen.cli" in worker, "pydantic" in worker)
        preparer.close()
""")


def test_template_workers_do_not_import_the_cli(tmp_path: Path) -> None:
    # multiprocessing runs the main script again in each worker: a console script that
    # imported the CLI at its top level cost every worker ~30 MB it never used.
    script = tmp_path / "console.py"
    script.write_text(CONSOLE_MAIN)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["False", "False", "False"]
