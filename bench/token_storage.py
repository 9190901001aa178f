"""Token arrays in Postgres: packed int32 ``bytea`` vs ``integer[]``, side by side.

Usage: python -m bench.token_storage [--url postgresql://postgres@127.0.0.1/postgres]
       [--rows 2000] [--tokens 4000] [--rounds 3]
Creates a scratch database, writes and reads the same random token arrays both ways,
interleaving the two in every round so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import psycopg

from models.tokens import pack, unpack

DB = "eaglegen_bench_tokens"


def _scratch(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB}")
        conn.execute(f"CREATE DATABASE {DB}")
    head, sep, query = url.partition("?")
    return f"{head.rsplit('/', 1)[0]}/{DB}{sep}{query}"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(url: str, rows: int, tokens: int, rounds: int) -> None:
    """Print write/read seconds and on-disk bytes for both layouts."""
    rng = random.Random(0)
    data = [[rng.randrange(163_840) for _ in range(tokens)] for _ in range(rows)]
    with psycopg.connect(_scratch(url), autocommit=True) as conn:
        conn.execute("CREATE TABLE t_bytea (id int primary key, ids bytea)")
        conn.execute("CREATE TABLE t_array (id int primary key, ids integer[])")
        times: dict[str, list[float]] = {
            k: [] for k in ("w_bytea", "w_array", "r_bytea", "r_array")
        }
        for _ in range(rounds):
            for table in ("t_bytea", "t_array"):
                conn.execute(f"TRUNCATE {table}")
            times["w_bytea"].append(
                _timed(lambda: _write(conn, "t_bytea", [pack(d) for d in data]))
            )
            times["w_array"].append(_timed(lambda: _write(conn, "t_array", data)))
            times["r_bytea"].append(
                _timed(lambda: [unpack(r[0]) for r in conn.execute("SELECT ids FROM t_bytea")])
            )
            times["r_array"].append(
                _timed(lambda: [list(r[0]) for r in conn.execute("SELECT ids FROM t_array")])
            )
        sizes = {
            t: conn.execute(f"SELECT pg_total_relation_size('{t}')").fetchone()[0]  # type: ignore[index]
            for t in ("t_bytea", "t_array")
        }
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{rows} rows x {tokens} tokens, median of {rounds} interleaved rounds")
    print(
        f"write: bytea {med['w_bytea']:.3f} s, integer[] {med['w_array']:.3f} s, "
        f"integer[]/bytea = {med['w_array'] / med['w_bytea']:.2f}"
    )
    print(
        f"read:  bytea {med['r_bytea']:.3f} s, integer[] {med['r_array']:.3f} s, "
        f"integer[]/bytea = {med['r_array'] / med['r_bytea']:.2f}"
    )
    print(
        f"size:  bytea {sizes['t_bytea'] / 1e6:.1f} MB, integer[] {sizes['t_array'] / 1e6:.1f} MB"
    )


def _write(
    conn: psycopg.Connection[tuple[object, ...]], table: str, values: Sequence[object]
) -> None:
    with conn.cursor() as cur:
        cur.executemany(f"INSERT INTO {table} (id, ids) VALUES (%s, %s)", list(enumerate(values)))


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1/postgres")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run(args.url, args.rows, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
