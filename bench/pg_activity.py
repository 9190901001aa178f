"""What Postgres's client sessions are doing, on average, while a benchmark runs beside it.

Samples `pg_stat_activity` every ``--interval-ms`` for ``--seconds`` (after ``--delay``
seconds, to skip a benchmark's set-up) and prints, per (state, wait event type, wait
event, the statement's first characters), the mean number of sessions found so: 0.8 sessions
"active / Lock / transactionid" on an UPDATE means that at any instant, on average, 0.8
sessions were waiting for another transaction's row lock there; "idle in transaction /
Client / ClientRead" means sessions inside a transaction waiting for their client to send
the next statement (any row lock they hold stays held meanwhile). Idle sessions and this
one are left out.

    python -m bench.pg_activity --delay 22 --seconds 12 &
    python -m bench.serving --requests 6000 --concurrency 64 --rounds 1 --modes plain \\
        --decode-step-ms 0 --decode-ms-per-request 0

The delay puts the window inside the pipeline's round (bench.serving runs bench_serving's
round first). Used for BENCHMARKS.md, "A server that costs nothing".
"""

from __future__ import annotations

import argparse
import collections
import time

import psycopg

from core.urls import libpq_url

_ACTIVITY = """
SELECT state, coalesce(wait_event_type, '-'), coalesce(wait_event, '-'), left(query, %(chars)s)
FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND state <> 'idle'
"""

Key = tuple[str, str, str, str]


def sample(url: str, seconds: float, interval_s: float, chars: int) -> tuple[int, dict[Key, int]]:
    """(samples taken, sessions seen per key over all of them)."""
    seen: collections.Counter[Key] = collections.Counter()
    samples = 0
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for state, kind, event, query in conn.execute(_ACTIVITY, {"chars": chars}):
                seen[(state, kind, event, " ".join(query.split()))] += 1
            samples += 1
            time.sleep(interval_s)
    return samples, dict(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait first")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--chars", type=int, default=40, help="of each statement shown")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    time.sleep(args.delay)
    samples, seen = sample(args.database_url, args.seconds, args.interval_ms / 1000, args.chars)
    print(f"{samples} samples of pg_stat_activity; mean sessions per state and statement:")
    for key, n in sorted(seen.items(), key=lambda item: -item[1])[: args.top]:
        print(f"  {n / max(1, samples):5.2f}  {' / '.join(key[:3])}: {key[3]}")


if __name__ == "__main__":
    main()
