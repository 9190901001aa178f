"""The SGLang simulator over real HTTP: wire format, errors, metrics, capacity and caching."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eaglegen import assets
from eaglegen.sim import SimConfig, SimServer
from eaglegen.sim.metrics import parse
from tests.unit.test_sim_tools import matches_schema, parse_tool_calls, render_ids, tool_rows

IDS = assets.special_ids(assets.TOKENIZER_DIR)
MODEL = "eaglegen/sim-reasoner"
GAUGE = f'{{engine_type="unified",model_name="{MODEL}",tp_rank="0"}}'
COUNTER = f'{{model_name="{MODEL}"}}'
# Fast steps keep the suite short; capacity behaviour does not depend on the step length.
FAST = SimConfig(context_length=4096, decode_step_ms=0.5, decode_ms_per_request=0.005)
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "weight_version",
    "total_retractions",
}


def prompt(i: int, n: int = 60) -> list[int]:
    """A distinct chat-like prompt ending in the think-start token."""
    return [IDS.bos, *(100 + (i * 7919 + k * 31) % 3900 for k in range(n)), IDS.think_start]


def sampling(max_new: int = 256, **extra: Any) -> dict[str, Any]:
    """Sampling values sent explicitly, as the worker does."""
    return {
        "max_new_tokens": max_new,
        "temperature": 0.6,
        "top_p": 0.95,
        "skip_special_tokens": False,
        **extra,
    }


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """One simulator for the module."""
    with SimServer(FAST) as server:
        yield server


@pytest.fixture
def client(sim: SimServer) -> Iterator[httpx.Client]:
    """A client bound to the simulator."""
    with httpx.Client(base_url=sim.url, timeout=30) as c:
        yield c


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Parsed /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def check_invariants(body: dict[str, Any], input_ids: list[int]) -> None:
    """What the worker checks on every response."""
    meta = body["meta_info"]
    assert set(meta) >= META_KEYS
    assert len(body["output_ids"]) == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(input_ids)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["e2e_latency"] > 0


def test_single_request_speaks_sglangs_format(client: httpx.Client) -> None:
    ids = prompt(1)
    response = client.post(
        "/generate", json={"input_ids": ids, "sampling_params": sampling(4000), "rid": "42"}
    )
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    check_invariants(body, ids)
    meta, out = body["meta_info"], body["output_ids"]
    assert meta["id"] == "42"
    assert meta["finish_reason"] == {"type": "stop", "matched": IDS.im_end}
    assert out[-1] == IDS.im_end and IDS.think_end in out
    assert "</think>" in body["text"] and not body["text"].endswith("<|im_end|>")


def test_output_is_deterministic_and_seeded(client: httpx.Client) -> None:
    def ids_for(params: dict[str, Any]) -> list[int]:
        response = client.post(
            "/generate", json={"input_ids": prompt(2), "sampling_params": params}
        )
        return list(response.json()["output_ids"])

    assert ids_for(sampling()) == ids_for(sampling())
    assert ids_for(sampling(sampling_seed=1)) != ids_for(sampling(sampling_seed=2))


def test_length_cut_and_generated_rid(client: httpx.Client) -> None:
    ids = prompt(3)
    body = client.post("/generate", json={"input_ids": ids, "sampling_params": sampling(5)}).json()
    check_invariants(body, ids)
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(body["output_ids"]) == 5 and len(body["meta_info"]["id"]) == 32


def test_batch_returns_a_list_in_order(client: httpx.Client) -> None:
    prompts = [prompt(10 + i) for i in range(3)]
    payload = {"input_ids": prompts, "sampling_params": sampling(64), "rid": ["a", "b", "c"]}
    response = client.post("/generate", json=payload)
    assert response.status_code == 200
    bodies = response.json()
    assert [b["meta_info"]["id"] for b in bodies] == ["a", "b", "c"]
    for body, ids in zip(bodies, prompts, strict=True):
        check_invariants(body, ids)
        single = client.post("/generate", json={"input_ids": ids, "sampling_params": sampling(64)})
        assert single.json()["output_ids"] == body["output_ids"]


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"input_ids": [1, 2], "bogus": True}, "Unknown field"),
        ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 5}}, "Unexpected keyword"),
        ({"text": "hello"}, "input_ids"),
        ({"input_ids": list(range(4096))}, "is longer than the model's context length (4096"),
        ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 4000}}, "Requested token"),
    ],
)
def test_invalid_requests_get_sglangs_400(
    client: httpx.Client, payload: dict[str, Any], fragment: str
) -> None:
    response = client.post("/generate", json=payload)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_malformed_bodies_get_the_validation_error_shape(client: httpx.Client) -> None:
    for content in (b"{not json", b'{"input_ids": ["a"]}'):
        response = client.post(
            "/generate", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        body = response.json()
        assert body["object"] == "error" and body["code"] == 400 and body["message"]


def test_info_and_health_endpoints(sim: SimServer, client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    model = client.get("/get_model_info").json()
    assert model["model_path"] == MODEL and model["is_generation"] is True
    assert model["tokenizer_path"] == str(assets.TOKENIZER_DIR)
    server = client.get("/get_server_info").json()
    assert server["max_total_num_tokens"] == FAST.kv_tokens
    assert server["context_length"] == 4096
    assert server["port"] == int(sim.url.rsplit(":", 1)[1])
    assert isinstance(server["internal_states"], list) and server["version"]


def test_repeated_prompt_reports_cached_tokens_until_flushed(client: httpx.Client) -> None:
    ids = prompt(20, n=200)
    payload = {"input_ids": ids, "sampling_params": sampling(8)}
    client.post("/generate", json=payload)
    again = client.post("/generate", json=payload).json()
    assert again["meta_info"]["cached_tokens"] >= 192
    assert client.post("/flush_cache").status_code == 200
    flushed = client.post("/generate", json=payload).json()
    assert flushed["meta_info"]["cached_tokens"] == 0


async def _fire(url: str, payloads: list[dict[str, Any]]) -> list[httpx.Response]:
    """Send every payload at once from one asyncio client."""
    limits = httpx.Limits(max_connections=len(payloads), max_keepalive_connections=len(payloads))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(client.post("/generate", json=p) for p in payloads))


def test_200_concurrent_requests_complete_with_exact_accounting(
    sim: SimServer, client: httpx.Client
) -> None:
    before = metric_values(client)
    prompts = [prompt(1000 + i, n=20 + i % 50) for i in range(200)]
    payloads = [
        {"input_ids": p, "sampling_params": sampling(128), "rid": f"job-{i}"}
        for i, p in enumerate(prompts)
    ]
    responses = asyncio.run(_fire(sim.url, payloads))
    after = metric_values(client)
    assert all(r.status_code == 200 for r in responses)
    bodies = [r.json() for r in responses]
    for i, (body, ids) in enumerate(zip(bodies, prompts, strict=True)):
        check_invariants(body, ids)
        assert body["meta_info"]["id"] == f"job-{i}"
    generated = sum(b["meta_info"]["completion_tokens"] for b in bodies)
    key = f"sglang:generation_tokens_total{COUNTER}"
    assert after[key] - before[key] == generated
    key = f"sglang:prompt_tokens_total{COUNTER}"
    assert after[key] - before[key] == sum(len(p) for p in prompts)
    key = f"sglang:num_requests_total{COUNTER}"
    assert after[key] - before[key] == 200
    assert after[f"sglang:num_running_reqs{GAUGE}"] == 0
    assert after[f"sglang:token_usage{GAUGE}"] == 0
    # No throughput check here: the gauge covers the last 2 s, and on a loaded machine the
    # last responses arrive later than that (it read 0); it is checked under load below.


def _poll_metrics(url: str, stop: float) -> list[dict[str, float]]:
    """Sample /metrics until the deadline."""
    seen = []
    with httpx.Client(base_url=url, timeout=10) as c:
        while time.monotonic() < stop:
            seen.append(metric_values(c))
            time.sleep(0.02)
    return seen


async def _load_and_watch(url: str, payloads: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Fire payloads while sampling /metrics from a thread."""
    watch = asyncio.to_thread(_poll_metrics, url, time.monotonic() + 0.6)
    responses, seen = await asyncio.gather(_fire(url, payloads), watch)
    assert all(r.status_code == 200 for r in responses)
    return seen


def test_kv_pool_limits_running_requests_and_queues_the_rest() -> None:
    # Each request reserves 30 + 300 tokens: a 2000-token pool runs six at a time.
    config = SimConfig(kv_tokens=2000, decode_step_ms=2.0, decode_ms_per_request=0.0)
    with SimServer(config) as server:
        payloads = [
            {"input_ids": prompt(i, n=28), "sampling_params": sampling(300, ignore_eos=True)}
            for i in range(20)
        ]
        seen = asyncio.run(_load_and_watch(server.url, payloads))
    running = [m[f"sglang:num_running_reqs{GAUGE}"] for m in seen]
    queued = [m[f"sglang:num_queue_reqs{GAUGE}"] for m in seen]
    usage = [m[f"sglang:token_usage{GAUGE}"] for m in seen]
    assert max(running) == 6 and max(queued) > 0
    assert 0 < max(usage) <= 1
    assert max(m[f"sglang:gen_throughput{GAUGE}"] for m in seen) > 0


def test_queue_full_answers_503() -> None:
    config = SimConfig(max_running_requests=1, max_queued_requests=1, decode_step_ms=5.0)
    with SimServer(config) as server:
        payloads = [{"input_ids": prompt(i), "sampling_params": sampling(50)} for i in range(6)]
        responses = asyncio.run(_fire(server.url, payloads))
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 503
    rejected = next(r for r in responses if r.status_code == 503).json()
    assert rejected["message"] == "The request queue is full." and rejected["code"] == 503


def test_a_client_that_gives_up_frees_its_slot(sim: SimServer, client: httpx.Client) -> None:
    payload = {"input_ids": prompt(30), "sampling_params": sampling(3000, ignore_eos=True)}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=sim.url, timeout=0.2) as short:
        short.post("/generate", json=payload)
    deadline = time.monotonic() + 5
    while metric_values(client)[f"sglang:num_running_reqs{GAUGE}"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric_values(client)[f"sglang:num_running_reqs{GAUGE}"] == 0


def tool_calls_over_http(url: str, seeds: int) -> list[tuple[dict[str, Any], str]]:
    """(row, generated text) for each sample row that declares tools, per sampling seed."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(assets.TOKENIZER_DIR), local_files_only=True)
    rows = tool_rows()
    calls = [
        {
            "input_ids": render_ids(hf, row),
            "sampling_params": sampling(3000, sampling_seed=seed),
            "rid": f"tools-{i}-{seed}",
        }
        for i, row in enumerate(rows)
        for seed in range(seeds)
    ]
    responses = asyncio.run(_fire(url, calls))
    assert all(r.status_code == 200 for r in responses)
    by_rid = {r.json()["meta_info"]["id"]: r.json()["text"] for r in responses}
    return [
        (row, by_rid[f"tools-{i}-{seed}"]) for i, row in enumerate(rows) for seed in range(seeds)
    ]


def test_prompts_declaring_tools_get_calls_whose_arguments_fit_a_declared_schema(
    sim: SimServer,
) -> None:
    calls = 0
    for row, text in tool_calls_over_http(sim.url, seeds=4):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
        for call in parse_tool_calls(text):
            assert matches_schema(json.loads(call.arguments), schemas[call.name])
            calls += 1
    assert calls >= 30


def test_prompts_without_tools_get_no_tool_call(sim: SimServer) -> None:
    calls = [{"input_ids": prompt(300 + i), "sampling_params": sampling(3000)} for i in range(40)]
    for response in asyncio.run(_fire(sim.url, calls)):
        body = response.json()
        assert body["meta_info"]["finish_reason"]["type"] == "stop"
        assert IDS.tool_calls_section_begin not in body["output_ids"]


def test_startup_fails_fast_on_a_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), SimServer(SimConfig(tokenizer_dir=tmp_path)):
        pass
