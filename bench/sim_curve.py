"""Throughput of each simulator preset against a fixed number of requests in flight.

    .venv/bin/python -m bench.sim_curve [--presets fast,kimi-k2,kv-rich] [--levels 8,16,...]

For each preset and level, a fresh simulator (scaled in time, see `--scale`) is kept at exactly
LEVEL requests in flight by a plain asyncio httpx client (a new request as soon as one answers);
after a warm-up, the throughput is read from the simulator's own clock (`/sim/stats`: tokens
decoded per simulated second), so a slow host stretches the run but not the figure. Also
sampled: the running batch and KV usage from /metrics, retractions and the prefill work they
cost again. Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from eaglegen import assets
from eaglegen.sim import SimServer, preset
from eaglegen.sim.metrics import parse

IDS = assets.special_ids(assets.TOKENIZER_DIR)
GAUGE = '{engine_type="unified",model_name="eaglegen/sim-reasoner",tp_rank="0"}'
# Per preset: time scale, warm-up and measured simulated seconds, prompt length, max_new_tokens.
PLANS: dict[str, tuple[float, float, float, int, int]] = {
    "fast": (0.5, 6.0, 24.0, 1000, 4096),
    "kimi-k2": (0.02, 200.0, 700.0, 1000, 16_384),
    "kv-rich": (0.02, 300.0, 700.0, 1000, 16_384),
}
SYSTEM = [100 + (k * 13) % 3900 for k in range(300)]  # a system prompt every request shares


def prompt(i: int, n: int) -> list[int]:
    """A chat-like prompt of n tokens: the shared system prompt, then a distinct question."""
    own = [100 + (i * 7919 + k * 31) % 3900 for k in range(n - len(SYSTEM) - 2)]
    return [IDS.bos, *SYSTEM, *own, IDS.think_start]


@dataclass
class Sample:
    """What one level measured."""

    tok_s: float
    running: float
    usage: float
    retractions: int
    reprefill_share: float
    wall_s: float
    samples: list[dict[str, float]] = field(default_factory=list)


async def _client(url: str, level: int, plen: int, max_new: int, stop: asyncio.Event) -> None:
    """Keep `level` requests in flight until stop is set."""
    limits = httpx.Limits(max_connections=level, max_keepalive_connections=level)
    counter = iter(range(10**9))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def loop() -> None:
            while not stop.is_set():
                body = {
                    "input_ids": prompt(next(counter), plen),
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.6},
                }
                with contextlib.suppress(httpx.HTTPError):
                    await client.post("/generate", json=body)

        tasks = [asyncio.create_task(loop()) for _ in range(level)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _watch(url: str, warm: float, measure: float) -> Sample:
    """Wait out the warm-up in simulated time, then measure over `measure` simulated seconds."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def stats() -> dict[str, Any]:
            scheduler: dict[str, Any] = (await client.get("/sim/stats")).json()["scheduler"]
            return scheduler

        while (await stats())["sim_seconds"] < warm:
            await asyncio.sleep(0.2)
        start, t0, gauges = await stats(), time.monotonic(), []
        while True:
            now = await stats()
            gauges.append(parse((await client.get("/metrics")).text))
            if now["sim_seconds"] - start["sim_seconds"] >= measure:
                break
            await asyncio.sleep(0.2)
    span = now["sim_seconds"] - start["sim_seconds"]
    decoded = now["tokens_generated"] - start["tokens_generated"]
    redo = now["reprefill_tokens"] - start["reprefill_tokens"]
    return Sample(
        tok_s=decoded / span,
        running=statistics.mean(g[f"sglang:num_running_reqs{GAUGE}"] for g in gauges),
        usage=statistics.mean(g[f"sglang:token_usage{GAUGE}"] for g in gauges),
        retractions=now["retracted_requests"] - start["retracted_requests"],
        reprefill_share=redo / decoded if decoded else 0.0,
        wall_s=time.monotonic() - t0,
    )


async def measure_level(name: str, level: int) -> Sample:
    """One preset at one fixed concurrency, on a fresh simulator."""
    scale, warm, span, plen, max_new = PLANS[name]
    with SimServer(preset(name, time_scale=scale)) as server:
        stop = asyncio.Event()
        client = asyncio.create_task(_client(server.url, level, plen, max_new, stop))
        try:
            return await _watch(server.url, warm, span)
        finally:
            stop.set()
            await client


def main() -> None:
    """Run the curve and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="fast,kimi-k2,kv-rich")
    parser.add_argument("--levels", default="8,16,32,64,128,256,512")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    print(
        "| preset | in flight | tok/s | running | KV usage | retractions | re-prefill / decoded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.presets.split(","):
        for level in levels:
            s = asyncio.run(measure_level(name, level))
            print(
                f"| {name} | {level} | {s.tok_s:,.0f} | {s.running:.0f} | {s.usage:.0%} | "
                f"{s.retractions} | {s.reprefill_share:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
