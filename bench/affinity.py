"""Turn affinity (issue 30): a conversation's next turn sent to the server that generated the
turn before it, against no preference, end to end as a user runs it.

    .venv/bin/python -m bench.affinity [--conversations 48] [--turns 4] [--document-words 2500]
        [--max-new-tokens 2048] [--rounds 2] [--sim-arg=--preset --sim-arg=kimi-k2 ...]

Two `eaglegen sim` servers (default: the `kimi-k2` preset at time scale 0.1 with answers of
300 tokens on average: its prefill and decode costs, its 159K-token pool and radix cache),
one `eaglegen worker` process with default settings but `EAGLEGEN_TURN_AFFINITY` on or off,
and a multi-turn dataset enqueued
with `turns = "all"`: each row opens with a long document of its own (so only the server
that answered a conversation's last turn has its history cached), then short questions.
Rounds alternate on and off against the same two servers, their caches flushed before each
run, each run a new run of the same rows.

Per run:

- cached share: of the prompt tokens of every turn after the first, the share the server
  served from its prefix cache (SGLang's ``meta_info.cached_tokens``, stored per generation);
- same server: turns after the first generated on the server of the turn before;
- wall: from the first request sent to the last finished (generations' times);
- turns/s: turns done over the wall.

Services: --database-url/--broker-url (default: this machine's Postgres and Redis; a scratch
database eaglegen_bench_affinity and Redis db 12, flushed before each run).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import text

from bench.common import WORDS, scratch_database, scratch_redis, wait_run_done
from bench.worker_stalls import _SPAN, sim_process
from bench.worker_throughput import eaglegen_worker, enqueue
from core.settings import Settings
from models.db import make_engine
from models.repository import Repository

PG = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
DATABASE = "eaglegen_bench_affinity"
REDIS_DB = 12
QUEUE = "bench-affinity"
# Answers short enough to finish (a cut answer ends its conversation) and to leave the
# prefill of a long history a visible part of each turn.
SIM_ARGS = ["--preset", "kimi-k2", "--time-scale", "0.1", "--mean-output-tokens", "300"]
# Turns after the first: their prompt and cached tokens, whether the server is the previous
# turn's, and the run's span.
_TURNS = text("""
SELECT sum(g.prompt_tokens), sum(g.cached_tokens),
       count(*) FILTER (WHERE g.server = p.server), count(*)
FROM jobs j JOIN generations g ON g.job_id = j.id
JOIN jobs pj ON pj.conversation_id = j.conversation_id AND pj.turn = j.turn - 1
JOIN generations p ON p.job_id = pj.id
JOIN datasets d ON d.id = j.dataset_id JOIN runs r ON r.id = d.run_id
WHERE r.name = :run AND j.turn > 0
""")


@dataclass(frozen=True)
class Run:
    affinity: bool
    turns: int
    cached_share: float
    same_server: float
    wall_s: float

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.wall_s if self.wall_s > 0 else 0.0


def write_conversations(path: Path, n: int, turns: int, words: int, seed: int = 0) -> Path:
    """``n`` rows: a document of ``words`` words of its own, then ``turns`` questions, each
    with the dataset's answer (replaced by the model's)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(n):
            document = " ".join(rng.choice(WORDS) for _ in range(words))
            messages = [{"role": "user", "content": f"Document {i}: {document}\nSummarise it."}]
            for t in range(turns - 1):
                messages += [
                    {"role": "assistant", "content": "(the dataset's answer)"},
                    {"role": "user", "content": f"Question {t + 1}: why {rng.choice(WORDS)}?"},
                ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


@contextmanager
def worker_process(
    settings: Settings, urls: list[str], affinity: bool, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`eaglegen worker` with default settings but the services, the two servers and turn
    affinity on or off."""
    servers = [{"name": f"sim{i}", "url": url} for i, url in enumerate(urls)]
    env = {"EAGLEGEN_TURN_AFFINITY": "true" if affinity else "false"}
    with eaglegen_worker(settings, servers, log, env) as process:
        yield process


def one_run(
    args: argparse.Namespace, database: str, urls: list[str], rows: Path, logs: Path, index: int
) -> Run:
    affinity = index % 2 == 0
    settings = Settings(
        database_url=database,
        broker_url=scratch_redis(args.broker_url, REDIS_DB),
        queue=QUEUE,
        data_dir=logs,
    )
    for url in urls:
        httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
    repo = Repository(make_engine(database, pool_size=2))
    run = f"r{index}-{'on' if affinity else 'off'}"
    with worker_process(settings, urls, affinity, logs / f"worker-{run}.log"):
        enqueue(settings, rows, run, args.max_new_tokens)
        under_way = repo.conversations_under_way
        wait_run_done(repo, run, args.timeout_s, every_s=0.5, also=lambda: not under_way(run))
    with repo.engine.connect() as conn:
        prompt, cached, same, later = conn.execute(_TURNS, {"run": run}).one()
        done, first, last = conn.execute(_SPAN, {"run": run}).one()
    repo.engine.dispose()
    return Run(
        affinity=affinity,
        turns=int(done),
        cached_share=float(cached or 0) / max(1, int(prompt or 0)),
        same_server=int(same or 0) / max(1, int(later or 0)),
        wall_s=float(last) - float(first) if done else float("nan"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--document-words", type=int, default=2500)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs: on, then off")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--sim-arg", action="append", default=None)
    parser.add_argument("--database-url", default=PG)
    parser.add_argument("--broker-url", default=REDIS)
    args = parser.parse_args()
    database = scratch_database(args.database_url, DATABASE)
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        rows = write_conversations(
            logs / "rows.jsonl", args.conversations, args.turns, args.document_words
        )
        sim_args = args.sim_arg or SIM_ARGS
        urls = [stack.enter_context(sim_process(sim_args, logs / f"sim{i}.log")) for i in range(2)]
        runs = [one_run(args, database, urls, rows, logs, i) for i in range(2 * args.rounds)]
    print(
        f"{'affinity':>8} {'turns':>6} {'cached share':>13} {'same server':>12} "
        f"{'wall s':>8} {'turns/s':>8}"
    )
    for r in runs:
        print(
            f"{'on' if r.affinity else 'off':>8} {r.turns:>6} {r.cached_share:>13.3f} "
            f"{r.same_server:>12.3f} {r.wall_s:>8.1f} {r.turns_per_s:>8.2f}"
        )
    on = [r for r in runs if r.affinity]
    off = [r for r in runs if not r.affinity]
    ratio = sum(r.turns_per_s for r in on) / max(1e-9, sum(r.turns_per_s for r in off))
    print(f"turns/s on ÷ off (summed over rounds): {ratio:.3f}")


if __name__ == "__main__":
    main()
