"""The simulator's SGLang scheduler over real HTTP: retraction under load, its metrics, presets."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx

from eaglegen import assets
from eaglegen.sim import SimConfig, SimServer, preset
from eaglegen.sim.metrics import parse

IDS = assets.special_ids(assets.TOKENIZER_DIR)
MODEL = "eaglegen/sim-reasoner"
GAUGE = f'{{engine_type="unified",model_name="{MODEL}",tp_rank="0"}}'
# A small pool with SGLang's admission (ratio 0.7 decaying to 0.098): it overcommits and
# retracts; fast steps keep the test short.
TIGHT = preset(
    "kimi-k2",
    kv_tokens=6000,
    context_length=4096,
    mean_output_tokens=300,
    max_output_tokens=4096,
    decode_step_ms=0.5,
    decode_ms_per_request=0.01,
    prefill_step_ms=0.5,
    prefill_tokens_per_ms=500.0,
    new_token_ratio_decay_steps=20,
)


def prompt(i: int, n: int = 200) -> list[int]:
    """A distinct prompt behind a shared 100-token system prompt."""
    system = [100 + (k * 13) % 3900 for k in range(100)]
    return [
        IDS.bos,
        *system,
        *(100 + (i * 7919 + k * 31) % 3900 for k in range(n)),
        IDS.think_start,
    ]


def call(i: int, stream: bool = False) -> dict[str, Any]:
    """A long generation (ignore_eos) with every sampling value explicit."""
    params = {"max_new_tokens": 1200, "temperature": 0.6, "ignore_eos": True}
    return {"input_ids": prompt(i), "sampling_params": params, "rid": f"r{i}", "stream": stream}


async def _fire(url: str, payloads: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(payloads))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/generate", json=p) for p in payloads))


def test_overcommitted_server_retracts_and_still_answers_every_request_exactly() -> None:
    payloads = [call(i) for i in range(24)]
    with SimServer(TIGHT) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        responses = asyncio.run(_fire(server.url, payloads))
        metrics = parse(client.get("/metrics").text)
        stats = client.get("/sim/stats").json()["scheduler"]
        info = client.get("/get_server_info").json()
    bodies = [r.json() for r in responses]
    assert all(r.status_code == 200 for r in responses)
    retracted = [b for b in bodies if b["meta_info"]["total_retractions"] > 0]
    assert retracted, "the tight pool never retracted"
    total = metrics[f"sglang:num_retracted_requests_total{GAUGE}"]
    assert (
        total
        == sum(b["meta_info"]["total_retractions"] for b in bodies)
        == stats["retracted_requests"]
    )
    assert metrics[f"sglang:num_retracted_output_tokens_total{GAUGE}"] > 0
    assert stats["reprefill_tokens"] >= metrics[f"sglang:num_retracted_output_tokens_total{GAUGE}"]
    # The re-prefills took engine time in which nothing decoded.
    assert 0 < stats["reprefill_seconds"] < stats["prefill_seconds"] < stats["sim_seconds"]
    # Passes counted: each prefills at least one request (first prefill or re-prefill; every
    # prompt here fits one chunk), so there are at most as many as prefills.
    assert 1 <= stats["prefill_passes"] <= 24 + stats["retracted_requests"]
    # Every request's e2e latency on the engine's clock, queue waits included.
    assert stats["e2e_count"] == 24 and 0 < stats["e2e_seconds"] <= 24 * stats["sim_seconds"]
    # Retraction changes when tokens come, never which: outputs match a roomy server's.
    with SimServer(replace(TIGHT, kv_tokens=200_000)) as roomy:
        clean = [r.json() for r in asyncio.run(_fire(roomy.url, [call(i) for i in range(3)]))]
    for body, ref in zip(bodies[:3], clean, strict=True):
        assert body["output_ids"] == ref["output_ids"] and len(body["output_ids"]) == 1200
    # Every request waited in the queue once per admission; the pool is drained.
    queue_count = metrics[f"sglang:queue_time_seconds_count{GAUGE}"]
    assert queue_count == 24 + total
    assert metrics[f"sglang:num_running_reqs{GAUGE}"] == 0
    assert metrics[f"sglang:token_usage{GAUGE}"] == 0
    assert metrics[f"sglang:new_token_ratio{GAUGE}"] == TIGHT.init_new_token_ratio  # idle reset
    # The shared system prompt (101 tokens with the BOS) was served from the radix cache to
    # every request but those prefilled together with the first.
    cached = [b["meta_info"]["cached_tokens"] for b in bodies]
    assert sum(c >= 101 for c in cached) >= 12 and max(cached) < len(prompt(0))
    assert info["chunked_prefill_size"] == 8192 and info["simulator"]["preset"] == "kimi-k2"


def test_a_stream_survives_its_retraction_with_every_token_once() -> None:
    with SimServer(TIGHT) as server:

        async def run() -> list[list[dict[str, Any]]]:
            limits = httpx.Limits(max_connections=30)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:

                async def one(i: int) -> list[dict[str, Any]]:
                    async with c.stream("POST", "/generate", json=call(i, stream=True)) as r:
                        lines = [line async for line in r.aiter_lines()]
                    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]

                return await asyncio.gather(*(one(i) for i in range(24)))

        streams = asyncio.run(run())
    hit = [s for s in streams if s[-1]["meta_info"]["total_retractions"] > 0]
    assert hit, "no stream was retracted"
    for chunks in streams:
        counts = [c["meta_info"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 1200
        assert len(chunks[-1]["output_ids"]) == 1200


def test_presets_report_their_pool_and_admission() -> None:
    for name, kv in (("kimi-k2", 159_000), ("kv-rich", 636_000)):
        config = preset(name, time_scale=0.01)
        with SimServer(config) as server, httpx.Client(base_url=server.url) as client:
            info = client.get("/get_server_info").json()
            metrics = parse(client.get("/metrics").text)
        assert info["max_total_num_tokens"] == kv and info["simulator"]["time_scale"] == 0.01
        assert metrics[f"sglang:max_total_num_tokens{GAUGE}"] == kv
        assert metrics[f"sglang:new_token_ratio{GAUGE}"] == 0.7
    assert SimConfig() == preset("fast")
