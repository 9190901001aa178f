"""`eaglegen stats` benchmark (issue 11): seconds and peak memory of the report on N done
generations.

A scratch database gets one run (the bundled tokenizer) of three datasets, `chat`, `fc`
(whose rows declare a tool, and whose outputs call it) and `B2`, and N done jobs with
generations, written by SQL alone (generate_series): each output is a filler of 16 to
1,039 ids (its reasoning) followed by one of a few tails made with the tokenizer: an answer,
a tool-call section (some with arguments that are not JSON, some calling an undeclared
function), a stop without think-end; and a share cut at max_new_tokens. Then the installed
`eaglegen stats` runs as a subprocess, as users run it, with `--json` and each extra flag
given, while its peak RSS (VmHWM) is sampled.

Usage: python -m bench.stats [--generations 1000000] [--sample 10000]
       [--database-url postgresql://postgres@127.0.0.1:5432/postgres] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from tokenizers import Tokenizer

from bench.common import scratch_database
from bench.procs import eaglegen_command, peak_rss_samples
from core.urls import libpq_url
from eaglegen.assets import TOKENIZER_DIR
from models.tokens import pack

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
RUN = "bench-stats"
MAX_NEW = 1024
# (dataset, share of the jobs); fc's rows declare get_weather.
DATASETS = (("chat", 0.5), ("fc", 0.3), ("B2", 0.2))
TOOLS = '[{"type": "function", "function": {"name": "get_weather"}}]'


def tails(tokenizer: Tokenizer) -> dict[str, list[tuple[bytes, str, bool]]]:
    """Per dataset, the output tails its rows cycle through: (ids, finish, think-end)."""

    def tid(token: str) -> int:
        found = tokenizer.token_to_id(token)
        assert found is not None, token
        return int(found)

    eos, think_end = tid("<|im_end|>"), tid("</think>")

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def section(name: str, arguments: str) -> list[int]:
        head = [tid("<|tool_call_begin|>"), *enc(f"functions.{name}:0")]
        call = [*head, tid("<|tool_call_argument_begin|>"), *enc(arguments)]
        body = [*call, tid("<|tool_call_end|>")]
        return [tid("<|tool_calls_section_begin|>"), *body, tid("<|tool_calls_section_end|>")]

    answer = [think_end, *enc("The answer, in a few plain words."), eos]
    stop = ("stop", True)
    chat = [(answer, *stop)] * 17 + [([eos], "stop", False), ([], "length", False)] * 1
    good = [think_end, *section("get_weather", '{"city": "Oslo"}'), eos]
    broken = [think_end, *section("get_weather", "{'city': 'Oslo'}"), eos]
    undeclared = [think_end, *section("launch", "{}"), eos]
    fc = [(good, *stop)] * 16 + [(broken, *stop), (undeclared, *stop), ([], "length", False)]
    b2 = [(answer, *stop)] * 3 + [([], "length", False)] * 2
    return {
        name: [(pack(ids), finish, te) for ids, finish, te in rows]
        for name, rows in (("chat", chat), ("fc", fc), ("B2", b2))
    }


_TAILS = "CREATE TABLE bench_tails (dataset text, k int, ids bytea, finish text, te boolean)"
_JOBS = """
    INSERT INTO jobs (dataset_id, row_index, prompt_sha256, input_ids, prompt_tokens, messages,
                      opens_reasoning, state, finished_at)
    SELECT %(dataset)s, i, sha256(int8send(i)), decode(repeat('05000000', 8 + i %% 500), 'hex'),
           8 + i %% 500, %(messages)s::json, true, 'done', now()
    FROM generate_series(1, %(n)s) i
"""
# A row's filler length comes from a hash of its id: spread, and the same on every run.
_GENERATIONS = """
    INSERT INTO generations (job_id, dataset_id, output_ids, finish_type, finish_matched,
        prompt_tokens, completion_tokens, cached_tokens, e2e_latency, server, think_end_present,
        reasoning_tokens, answer_tokens, meta_info)
    SELECT j.id, j.dataset_id, o.ids, t.finish,
           CASE WHEN t.finish = 'stop' THEN to_jsonb(%(eos)s) END,
           j.prompt_tokens, o.n, (j.prompt_tokens * (j.id %% 3)) / 4,
           0.5 + (j.id %% 1000) / 100.0, 'bench', t.te,
           CASE WHEN t.te THEN f.n + 1 ELSE o.n END,
           CASE WHEN t.te THEN o.n - f.n - 1 ELSE 0 END, '{}'::jsonb
    FROM jobs j
    JOIN bench_tails t ON t.dataset = %(name)s
        AND t.k = j.row_index %% (SELECT count(*) FROM bench_tails WHERE dataset = %(name)s)
    CROSS JOIN LATERAL (
        SELECT CASE WHEN t.finish = 'length' THEN %(max_new)s
                    ELSE 16 + abs(hashint8(j.id)) %% 1024 END AS n
    ) f
    CROSS JOIN LATERAL (
        SELECT decode(repeat('07000000', f.n), 'hex') || t.ids AS ids,
               f.n + length(t.ids) / 4 AS n
    ) o
    WHERE j.dataset_id = %(dataset)s
"""


def populate(url: str, n: int) -> None:
    """One run of N done generations in the database at ``url``."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    plain = libpq_url(url)
    with psycopg.connect(plain) as conn:
        run_id = conn.execute(
            "INSERT INTO runs (name, tokenizer_path, tokenizer_sha256, chat_template_sha256,"
            " model_name, think_end_id, vocab_size) VALUES (%s, %s, %s, %s, 'bench', %s, %s)"
            " RETURNING id",
            (RUN, str(TOKENIZER_DIR), "a" * 64, "b" * 64, tokenizer.token_to_id("</think>"),
             tokenizer.get_vocab_size()),
        ).fetchone()[0]  # type: ignore[index]  # fmt: skip
        conn.execute(_TAILS)
        for name, rows in tails(tokenizer).items():
            for k, (ids, finish, te) in enumerate(rows):
                conn.execute(
                    "INSERT INTO bench_tails VALUES (%s, %s, %s, %s, %s)",
                    (name, k, ids, finish, te),
                )
        params = json.dumps({"max_new_tokens": MAX_NEW, "stop_token_ids": [eos]})
        for name, part in DATASETS:
            dataset = conn.execute(
                "INSERT INTO datasets (run_id, name, source, sampling_params)"
                " VALUES (%s, %s, 'bench', %s) RETURNING id",
                (run_id, name, params),
            ).fetchone()[0]  # type: ignore[index]
            tools = TOOLS if name == "fc" else "null"
            messages = f'{{"messages": [], "tools": {tools}}}'
            count = int(n * part)
            conn.execute(_JOBS, {"dataset": dataset, "messages": messages, "n": count})
            args = {"dataset": dataset, "name": name, "eos": eos, "max_new": MAX_NEW}
            conn.execute(_GENERATIONS, args)
            conn.commit()
        conn.execute("DROP TABLE bench_tails")
        conn.commit()
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def measure(url: str, *flags: str) -> tuple[float, float, dict[str, object]]:
    """Run `eaglegen stats RUN --json FLAGS`: (seconds, peak RSS MB, its document)."""
    command = [*eaglegen_command(), "stats", RUN, "--json", *flags]
    env = {**os.environ, "EAGLEGEN_DATABASE_URL": url}
    with tempfile.TemporaryFile() as stdout:
        start = time.perf_counter()
        with subprocess.Popen(
            command, env=env, stdout=stdout, stderr=subprocess.DEVNULL
        ) as process:
            peak = max(peak_rss_samples(process), default=0.0)
        seconds = time.perf_counter() - start
        if process.returncode != 0:
            raise SystemExit(f"eaglegen stats failed ({process.returncode})")
        stdout.seek(0)
        return seconds, peak, json.loads(stdout.read())


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--generations", type=int, default=1_000_000)
    parser.add_argument("--sample", type=int, default=10_000)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--reuse", action="store_true", help="Keep the scratch data of a run")
    args = parser.parse_args()
    name = f"eaglegen_bench_stats_{args.generations}"
    url = args.database_url.rsplit("/", 1)[0] + f"/{name}"
    if not args.reuse:
        url = scratch_database(args.database_url, name)
        start = time.perf_counter()
        populate(url, args.generations)
        print(f"populated {args.generations:,} generations in {time.perf_counter() - start:.0f} s")
    out = Path(tempfile.mkdtemp(prefix="bench-stats-"))
    cases = {
        "stats --json": (),
        f"stats --json --sample {args.sample}": ("--sample", str(args.sample)),
        "stats --json --html --plots": ("--html", str(out / "r.html"), "--plots", str(out)),
    }
    for label, flags in cases.items():
        seconds, peak, doc = measure(url, *flags)
        total = doc["total"]
        assert isinstance(total, dict)
        checked = doc["token_checks"]
        assert isinstance(checked, dict)
        print(
            f"{label}: {seconds:.1f} s, peak RSS {peak:.0f} MB, "
            f"{total['generations']:,} generations, tool checks on {checked['generations']:,}"
        )


if __name__ == "__main__":
    main()
