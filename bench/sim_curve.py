"""Throughput of each simulator preset against a fixed number of requests in flight: the knee.

    .venv/bin/python -m bench.sim_curve [--presets fast,kimi-k2,kv-rich]
        [--levels 16,32,64,128,256,512] [--seeds 0,1]

For each round (one per seed), preset and level, a fresh simulator (scaled in time, see `PLANS`;
its seed draws the round's output lengths) is kept at exactly LEVEL requests in flight by
a plain asyncio httpx client (a new request as soon as one answers). After a warm-up, everything
is read from the simulator's own clock (`/sim/stats`: the engine's seconds, the sum of its
forward passes' costs), so a slow host stretches the run but not the figures:

- tok/s: tokens decoded per engine second;
- running, KV usage, queue: means of /metrics samples (SGLang's gauges);
- retractions, and the engine time spent prefilling again what retracted requests had computed
  (`reprefill_seconds`: time in which no request decoded, `eaglegen.sim.forward`);
- e2e: the mean time a request spends in the server, by Little's law (LEVEL ÷ requests finished
  per engine second), since in a closed loop every slot is always taken. The server's own mean
  over the requests finished in the window is printed beside it; it runs low at high levels,
  whose window holds requests that arrived when the server was empty.

Prints a Markdown table per round (for BENCHMARKS.md), then per preset the knee: the smallest
level within 3% of the best tok/s, and each level's tok/s and e2e over the knee's, per round
(side by side in time), as min-max over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from eaglegen import assets
from eaglegen.sim import SimServer, preset
from eaglegen.sim.metrics import parse

IDS = assets.special_ids(assets.TOKENIZER_DIR)
GAUGE = '{engine_type="unified",model_name="eaglegen/sim-reasoner",tp_rank="0"}'
# Per preset: time scale, warm-up and measured engine seconds, prompt length, max_new_tokens.
PLANS: dict[str, tuple[float, float, float, int, int]] = {
    "fast": (0.5, 6.0, 24.0, 1000, 4096),
    "kimi-k2": (0.02, 200.0, 700.0, 1000, 16_384),
    "kv-rich": (0.02, 300.0, 700.0, 1000, 16_384),
}
SYSTEM = [100 + (k * 13) % 3900 for k in range(300)]  # a system prompt every request shares
# The knee: the smallest level within this share of the best throughput.
KNEE = 0.97


def prompt(i: int, n: int) -> list[int]:
    """A chat-like prompt of n tokens: the shared system prompt, then a distinct question."""
    own = [100 + (i * 7919 + k * 31) % 3900 for k in range(n - len(SYSTEM) - 2)]
    return [IDS.bos, *SYSTEM, *own, IDS.think_start]


@dataclass
class Sample:
    """What one level measured, on the engine's clock."""

    tok_s: float
    running: float
    usage: float
    queue: float
    retractions: int
    reprefill_share: float
    req_s: float
    e2e_server: float
    wall_s: float

    def e2e(self, level: int) -> float:
        """Mean seconds in the server by Little's law."""
        return level / self.req_s if self.req_s else float("inf")


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
    """Wait out the warm-up in engine time, then measure over `measure` engine seconds."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def get(path: str) -> httpx.Response:
            # A loaded host can drop a kept-alive connection under a poll: ask again.
            for attempt in range(3):
                try:
                    return await client.get(path)
                except httpx.TransportError:
                    if attempt == 2:
                        raise
                    await asyncio.sleep(0.5)
            raise AssertionError("unreachable")

        async def stats() -> dict[str, Any]:
            scheduler: dict[str, Any] = (await get("/sim/stats")).json()["scheduler"]
            return scheduler

        while (await stats())["sim_seconds"] < warm:
            await asyncio.sleep(0.2)
        start, t0, gauges = await stats(), time.monotonic(), []
        while True:
            now = await stats()
            gauges.append(parse((await get("/metrics")).text))
            if now["sim_seconds"] - start["sim_seconds"] >= measure:
                break
            await asyncio.sleep(0.2)

    def delta(key: str) -> float:
        return float(now[key] - start[key])

    span = delta("sim_seconds")
    finished = delta("e2e_count")
    return Sample(
        tok_s=delta("tokens_generated") / span,
        running=statistics.mean(g[f"sglang:num_running_reqs{GAUGE}"] for g in gauges),
        usage=statistics.mean(g[f"sglang:token_usage{GAUGE}"] for g in gauges),
        queue=statistics.mean(g[f"sglang:num_queue_reqs{GAUGE}"] for g in gauges),
        retractions=int(delta("retracted_requests")),
        reprefill_share=delta("reprefill_seconds") / span,
        req_s=finished / span,
        e2e_server=delta("e2e_seconds") / finished if finished else float("nan"),
        wall_s=time.monotonic() - t0,
    )


async def measure_level(name: str, level: int, seed: int = 0) -> Sample:
    """One preset at one fixed concurrency, on a fresh simulator."""
    scale, warm, span, plen, max_new = PLANS[name]
    with SimServer(preset(name, time_scale=scale, seed=seed)) as server:
        stop = asyncio.Event()
        client = asyncio.create_task(_client(server.url, level, plen, max_new, stop))
        try:
            return await _watch(server.url, warm, span)
        finally:
            stop.set()
            await client


def knee(curve: dict[int, Sample]) -> int:
    """The smallest level within KNEE of the best throughput."""
    best = max(s.tok_s for s in curve.values())
    return min(level for level, s in curve.items() if s.tok_s >= KNEE * best)


def _spread(values: list[float], digits: int = 3) -> str:
    """One value, or min-max over the rounds."""
    low, high = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return low if low == high else f"{low} to {high}"


def summarize(name: str, rounds: list[dict[int, Sample]]) -> list[str]:
    """The knee per round, and every level's tok/s and e2e over the knee's, min-max."""
    knees = [knee(curve) for curve in rounds]
    lines = [
        f"**{name}**: knee at {', '.join(str(k) for k in knees)} in flight (per round); "
        "tok/s and e2e over the knee's, min to max over rounds:",
        "",
        "| in flight | tok/s ÷ knee | e2e ÷ knee | retractions | re-prefill time |",
        "|---:|---:|---:|---:|---:|",
    ]
    for level in sorted(rounds[0]):
        ratios = [c[level].tok_s / c[k].tok_s for c, k in zip(rounds, knees, strict=True)]
        slower = [c[level].e2e(level) / c[k].e2e(k) for c, k in zip(rounds, knees, strict=True)]
        retractions = "/".join(str(c[level].retractions) for c in rounds)
        redo = _spread([100 * c[level].reprefill_share for c in rounds], 2)
        lines.append(
            f"| {level} | {_spread(ratios)} | {_spread(slower, 2)} | {retractions} | {redo}% |"
        )
    return lines


def main() -> None:
    """Run the curve and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="fast,kimi-k2,kv-rich")
    parser.add_argument("--levels", default="16,32,64,128,256,512")
    parser.add_argument("--seeds", default="0,1", help="one round per simulator seed")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    names = args.presets.split(",")
    curves: dict[str, list[dict[int, Sample]]] = {name: [] for name in names}
    for n, seed in enumerate(int(x) for x in args.seeds.split(",")):
        print(f"\nRound {n + 1} (seed {seed})\n")
        print(
            "| preset | in flight | tok/s | running | KV usage | queue | retractions "
            "| re-prefill time | e2e s (Little) | e2e s (finished) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in names:
            curve: dict[int, Sample] = {}
            for level in levels:
                s = curve[level] = asyncio.run(measure_level(name, level, seed))
                print(
                    f"| {name} | {level} | {s.tok_s:,.0f} | {s.running:.0f} | {s.usage:.0%} | "
                    f"{s.queue:.0f} | {s.retractions} | {s.reprefill_share:.2%} | "
                    f"{s.e2e(level):,.1f} | {s.e2e_server:,.1f} |",
                    flush=True,
                )
            curves[name].append(curve)
    for name in names:
        print("\n" + "\n".join(summarize(name, curves[name])), flush=True)


if __name__ == "__main__":
    main()
