"""The simulator's fault knobs over real HTTP: every error branch a worker must survive."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from typer.testing import CliRunner

import eaglegen.sim
from eaglegen import assets
from eaglegen.cli import app
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from eaglegen.sim.faults import MALFORMED_BODY, choose
from eaglegen.sim.metrics import parse
from tests.integration.test_sim_http import tool_calls_over_http
from tests.unit.test_sim_tools import parse_tool_calls

IDS = assets.special_ids(assets.TOKENIZER_DIR)
FAST = SimConfig(context_length=4096, decode_step_ms=0.5, decode_ms_per_request=0.005)
REQUESTS_TOTAL = 'sglang:num_requests_total{model_name="eaglegen/sim-reasoner"}'
PROMPT_TOKENS_TOTAL = 'sglang:prompt_tokens_total{model_name="eaglegen/sim-reasoner"}'


def payload(i: int = 0, max_new: int = 16, **extra: Any) -> dict[str, Any]:
    """A small /generate call with every sampling value explicit."""
    ids = [IDS.bos, *(100 + (i * 7919 + k * 31) % 3900 for k in range(20)), IDS.think_start]
    params = {"max_new_tokens": max_new, "temperature": 0.6, "top_p": 0.95}
    return {"input_ids": ids, "sampling_params": params, "rid": f"job-{i}", **extra}


def events_until_silent(url: str, body: dict[str, Any], read_s: float) -> list[bytes]:
    """The events a streamed call sends before it goes silent for read_s (a ReadTimeout)."""
    events: list[bytes] = []
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(10, read=read_s)) as c,
        c.stream("POST", "/generate", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        with pytest.raises(httpx.ReadTimeout):
            for line in response.iter_lines():
                if line:
                    events.append(line.encode())
    return events


def running(client: httpx.Client) -> float:
    """sglang:num_running_reqs now."""
    gauge = 'sglang:num_running_reqs{engine_type="unified",model_name="eaglegen/sim-reasoner",'
    return parse(client.get("/metrics").text)[gauge + 'tp_rank="0"}']


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """One healthy simulator for the module; tests switch its faults at runtime."""
    with SimServer(FAST) as server:
        yield server


@pytest.fixture
def client(sim: SimServer) -> Iterator[httpx.Client]:
    """A client bound to the simulator; the faults are off again after each test."""
    with httpx.Client(base_url=sim.url, timeout=10) as c:
        yield c
        assert c.post("/sim/faults", json={}).status_code == 200


def set_faults(client: httpx.Client, **faults: Any) -> dict[str, Any]:
    """Replace the active faults; returns what the server now reports."""
    response = client.post("/sim/faults", json=faults)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def injected(client: httpx.Client) -> dict[str, Any]:
    """The `injected` part of /sim/stats."""
    stats: dict[str, Any] = client.get("/sim/stats").json()["injected"]
    return stats


def totals(client: httpx.Client) -> tuple[float, float]:
    """(requests, prompt tokens) the scheduler has processed, from /metrics."""
    samples = parse(client.get("/metrics").text)
    return samples[REQUESTS_TOTAL], samples[PROMPT_TOKENS_TOTAL]


@pytest.mark.parametrize("status", [400, 429, 500, 502, 503, 504])
def test_each_error_status_at_rate_one_gets_its_sglang_body(
    client: httpx.Client, status: int
) -> None:
    set_faults(client, error_rates={str(status): 1.0})
    before = totals(client)
    response = client.post("/generate", json=payload())
    assert response.status_code == status
    body = response.json()
    if status == 400:
        assert set(body) == {"error"} and body["error"]["message"]
    else:
        assert body["object"] == "error" and body["code"] == status
        assert body["type"] == str(status) and body["message"]
    if status == 503:
        assert body["message"] == "The request queue is full."
    assert totals(client) == before  # decided before scheduling: no KV work was done


def test_rates_are_honoured_and_reproducible_for_a_seed(client: httpx.Client) -> None:
    faults = set_faults(client, error_rates={"503": 0.3}, seed=2024)
    codes = [client.post("/generate", json=payload(i, max_new=1)).status_code for i in range(300)]
    assert codes.count(503) == 91  # the count seed 2024 gives; about 0.3 of 300
    assert codes.count(200) == 209
    # Sequential calls see the server's seeded draws in order: the exact sequence is known.
    rng = random.Random(2024)
    config = FaultConfig.from_json(faults)
    expected = [503 if choose(config, rng.random()) else 200 for _ in range(300)]
    assert codes == expected


async def _all_in_their_delay(url: str, n: int, delayed_before: int) -> dict[str, Any]:
    """Send n delayed /generate calls at once; once the server has begun every delay, note
    how many had answered and ask /health; then collect the answers."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        answered: list[int] = []

        async def generate(i: int) -> None:
            answered.append((await c.post("/generate", json=payload(i))).status_code)

        calls = [asyncio.create_task(generate(i)) for i in range(n)]
        while (await c.get("/sim/stats")).json()["injected"]["delayed"] < delayed_before + n:
            await asyncio.sleep(0.02)
        seen = {"answered_when_all_delayed": len(answered)}
        seen["health"] = (await c.get("/health")).status_code
        seen["answered_when_health_answered"] = len(answered)
        await asyncio.gather(*calls)
        seen["codes"] = answered
        return seen


def test_added_latency_delays_every_answer_without_blocking(
    sim: SimServer, client: httpx.Client
) -> None:
    before = injected(client)["delayed"]
    set_faults(client, added_latency_ms=300)
    start = time.perf_counter()
    assert client.post("/generate", json=payload()).status_code == 200
    assert time.perf_counter() - start >= 0.3
    # Ten calls delayed 5 s each are all in their delay at once (asyncio.sleep, not a
    # blocking sleep), and /health answers meanwhile (only /generate is delayed).
    set_faults(client, added_latency_ms=5000, error_rates={"503": 1.0})
    seen = asyncio.run(_all_in_their_delay(sim.url, 10, before + 1))
    assert seen == {
        "answered_when_all_delayed": 0,
        "health": 200,
        "answered_when_health_answered": 0,
        "codes": [503] * 10,
    }
    assert injected(client)["delayed"] - before == 11


def test_drop_closes_the_connection_without_any_answer(
    sim: SimServer, client: httpx.Client
) -> None:
    before, counts = totals(client), injected(client)["dropped"]
    set_faults(client, drop_rate=1.0)
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        client.post("/generate", json=payload())
    # At the socket level: the whole request is sent, and the server closes without a byte.
    url = urlsplit(sim.url)
    body = json.dumps(payload()).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: sim\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        assert sock.recv(1024) == b""
    assert injected(client)["dropped"] - counts == 2
    assert totals(client) == before
    set_faults(client)
    assert client.post("/generate", json=payload()).status_code == 200


def test_async_clients_see_a_transport_error_too(sim: SimServer, client: httpx.Client) -> None:
    set_faults(client, drop_rate=1.0)

    async def call() -> None:
        async with httpx.AsyncClient(base_url=sim.url, timeout=5) as c:
            await c.post("/generate", json=payload())

    with pytest.raises(httpx.TransportError):
        asyncio.run(call())


def test_malformed_body_is_a_200_that_is_not_json(client: httpx.Client) -> None:
    set_faults(client, malformed_rate=1.0)
    response = client.post("/generate", json=payload())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    with pytest.raises(json.JSONDecodeError):
        response.json()
    assert injected(client)["malformed"] >= 1


def test_leaked_prompt_tokens_have_the_real_bugs_shape(client: httpx.Client) -> None:
    call = payload(7, max_new=64)
    clean = client.post("/generate", json=call).json()
    before = injected(client)["leaked"]
    prompt, generated = call["input_ids"], clean["output_ids"]
    # The last N prompt tokens lead output_ids; N beyond the prompt leaks all of it.
    for n, lead in ((1, prompt[-1:]), (5, prompt[-5:]), (10_000, prompt)):
        set_faults(client, leak_prompt_tokens=n)
        leaked = client.post("/generate", json=call).json()
        meta = leaked["meta_info"]
        assert leaked["output_ids"] == [*lead, *generated]
        assert meta["completion_tokens"] == clean["meta_info"]["completion_tokens"]
        assert meta["completion_tokens"] == len(generated)
        assert len(leaked["output_ids"]) != meta["completion_tokens"]  # what the worker rejects
        assert meta["prompt_tokens"] == len(prompt) and leaked["text"] == clean["text"]
    assert injected(client)["leaked"] - before == 3
    # The older boolean form still works and means one token.
    set_faults(client, leak_prompt_tokens=True)
    assert client.get("/sim/faults").json()["leak_prompt_tokens"] == 1


def test_stripped_special_tokens_leave_only_the_final_stop_token(client: httpx.Client) -> None:
    call = payload(8, max_new=4000)
    call["sampling_params"]["skip_special_tokens"] = False
    clean = client.post("/generate", json=call).json()
    specials = {IDS.think_end, IDS.im_end, IDS.tool_calls_section_begin, IDS.tool_call_begin}
    assert IDS.think_end in clean["output_ids"] and clean["output_ids"][-1] == IDS.im_end
    set_faults(client, strip_special_tokens=True)
    before = injected(client)["stripped"]
    body = client.post("/generate", json=call).json()
    expected = [t for t in clean["output_ids"][:-1] if t not in specials] + [IDS.im_end]
    assert body["output_ids"] == expected
    assert body["meta_info"]["completion_tokens"] == len(expected)
    assert body["meta_info"]["finish_reason"] == clean["meta_info"]["finish_reason"]
    assert "</think>" not in body["text"] and "</think>" in clean["text"]
    streamed = {**call, "stream": True}
    with client.stream("POST", "/generate", json=streamed) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    assert chunks[-1]["output_ids"] == expected
    assert all(IDS.think_end not in c["output_ids"] for c in chunks)
    assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in chunks)
    assert injected(client)["stripped"] - before == 2


def test_a_stalled_stream_sends_its_first_chunks_then_holds_the_connection_silent(
    sim: SimServer, client: httpx.Client
) -> None:
    before, (requests_before, _) = injected(client)["stalled"], totals(client)
    set_faults(client, stall_rate=1.0, stall_after_chunks=2)
    # Long enough to outlast the client: only the stall stops the chunks.
    call = payload(1, max_new=3000, stream=True)
    call["sampling_params"]["ignore_eos"] = True
    events = events_until_silent(sim.url, call, read_s=0.5)
    counts = [
        json.loads(e.removeprefix(b"data: "))["meta_info"]["completion_tokens"] for e in events
    ]
    assert counts == [1, 2]
    # The client gave up: its request is aborted, not left to run out.
    deadline = time.monotonic() + 5
    while running(client) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running(client) == 0 and totals(client)[0] == requests_before
    # Zero chunks: the headers come, then nothing at all.
    set_faults(client, stall_rate=1.0, stall_after_chunks=0)
    call["sampling_params"]["max_new_tokens"] = 50
    assert events_until_silent(sim.url, call, read_s=0.3) == []
    assert injected(client)["stalled"] - before == 2
    # Only streams stall.
    assert client.post("/generate", json=payload()).status_code == 200


def test_a_dripping_body_trickles_in_a_few_bytes_at_a_time(client: httpx.Client) -> None:
    call = payload(3, max_new=48)
    clean = client.post("/generate", json=call).json()
    before = injected(client)["dripped"]
    set_faults(client, drip_rate=1.0, drip_bytes=8, drip_interval_ms=10)
    pieces: list[bytes] = []
    times: list[float] = []
    with client.stream("POST", "/generate", json=call) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        length = int(response.headers["content-length"])
        for piece in response.iter_raw():
            pieces.append(piece)
            times.append(time.monotonic())
    body = b"".join(pieces)
    assert len(body) == length and json.loads(body)["output_ids"] == clean["output_ids"]
    expected = -(-length // 8)
    assert len(pieces) >= expected // 2 and max(len(p) for p in pieces) <= 8 * 3
    assert times[-1] - times[0] >= 0.8 * (expected - 1) * 0.010
    assert injected(client)["dripped"] - before == 1
    # A stream is not dripped: it trickles by nature.
    with client.stream("POST", "/generate", json=payload(3, max_new=48, stream=True)) as response:
        assert response.read().endswith(b"data: [DONE]\n\n")
    assert injected(client)["dripped"] - before == 1


def test_stream_faults_keep_the_stream_framing(sim: SimServer, client: httpx.Client) -> None:
    streamed = payload(5, max_new=8, stream=True)
    set_faults(client, malformed_rate=1.0)
    with client.stream("POST", "/generate", json=streamed) as response:
        assert response.status_code == 200
        raw = response.read()
    # One event cut mid-JSON, and no [DONE].
    assert raw == b"data: " + MALFORMED_BODY + b"\n\n"
    set_faults(client, leak_prompt_tokens=10_000)
    before = injected(client)["leaked"]
    with client.stream("POST", "/generate", json=streamed) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    prompt = streamed["input_ids"]
    for n, chunk in enumerate(chunks, start=1):
        assert chunk["output_ids"][: len(prompt)] == prompt
        assert (
            len(chunk["output_ids"])
            == len(prompt) + n
            == len(prompt) + chunk["meta_info"]["completion_tokens"]
        )
    assert injected(client)["leaked"] - before == 1
    set_faults(client, error_rates={"503": 1.0})
    response = client.post("/generate", json=streamed)
    assert response.status_code == 503 and response.json()["code"] == 503


def test_broken_tool_args_are_not_json_and_are_counted(
    sim: SimServer, client: httpx.Client
) -> None:
    before = injected(client)["broken_tool_args"]
    set_faults(client, broken_tool_args_rate=1.0)
    outputs = tool_calls_over_http(sim.url, seeds=2)
    broken = 0
    for _, text in outputs:
        calls = parse_tool_calls(text)
        for call in calls:
            with pytest.raises(ValueError):
                json.loads(call.arguments)
        broken += bool(calls)
    assert broken >= 10
    assert injected(client)["broken_tool_args"] - before == broken


def test_faults_switch_at_runtime_and_back(client: httpx.Client) -> None:
    assert client.get("/sim/faults").json() == FaultConfig().to_json()
    assert client.post("/generate", json=payload()).status_code == 200
    active = set_faults(client, error_rates={"503": 1.0}, seed=9)
    assert client.get("/sim/faults").json() == active
    assert active["error_rates"] == {"503": 1.0} and active["seed"] == 9
    assert [client.post("/generate", json=payload()).status_code for _ in range(3)] == [503] * 3
    set_faults(client)
    assert client.post("/generate", json=payload()).status_code == 200


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"drop": 0.5}',
        b'{"drop_rate": 2}',
        b'{"drop_rate": 0.6, "malformed_rate": 0.6}',
        b'{"error_rates": {"200": 0.5}}',
        b'{"error_rates": [[503, 0.5]]}',
        b'{"stall_rate": 2}',
        b'{"drip_bytes": 0}',
        b'{"broken_tool_args_rate": -1}',
    ],
)
def test_invalid_fault_updates_are_refused_and_change_nothing(
    client: httpx.Client, content: bytes
) -> None:
    active = set_faults(client, added_latency_ms=1)
    response = client.post("/sim/faults", content=content)
    assert response.status_code == 400 and response.json()["error"]["message"]
    assert client.get("/sim/faults").json() == active


def test_unhealthy_makes_both_health_endpoints_answer_503(client: httpx.Client) -> None:
    before = injected(client)["unhealthy_health_checks"]
    set_faults(client, unhealthy=True)
    assert client.get("/health").status_code == 503
    assert client.get("/health_generate").status_code == 503
    # Only the probes fail; combine with error_rates or drop_rate to fail /generate too.
    assert client.post("/generate", json=payload()).status_code == 200
    assert injected(client)["unhealthy_health_checks"] - before == 2
    set_faults(client)
    assert client.get("/health").status_code == 200


def test_stats_count_faults_per_kind(client: httpx.Client) -> None:
    before = client.get("/sim/stats").json()
    set_faults(client, error_rates={"502": 1.0})
    for _ in range(2):
        client.post("/generate", json=payload())
    set_faults(client, error_rates={"429": 1.0})
    client.post("/generate", json=payload())
    set_faults(client, malformed_rate=1.0)
    client.post("/generate", json=payload())
    after = client.get("/sim/stats").json()
    assert after["generate_requests"] - before["generate_requests"] == 4
    errors_before, errors_after = before["injected"]["errors"], after["injected"]["errors"]
    assert errors_after["502"] - errors_before.get("502", 0) == 2
    assert errors_after["429"] - errors_before.get("429", 0) == 1
    assert after["injected"]["malformed"] - before["injected"]["malformed"] == 1


def test_faults_set_at_startup_including_an_unhealthy_start() -> None:
    faults = FaultConfig(error_rates=((502, 1.0),), unhealthy=True, seed=5)
    with (
        SimServer(SimConfig(faults=faults)) as server,
        httpx.Client(base_url=server.url, timeout=10) as c,
    ):
        assert c.get("/health").status_code == 503
        assert c.post("/generate", json=payload()).status_code == 502
        assert c.get("/sim/faults").json() == faults.to_json()
        assert c.get("/get_server_info").json()["simulator"]["faults"] == faults.to_json()


def test_cli_flags_build_the_fault_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[SimConfig] = []
    monkeypatch.setattr(eaglegen.sim, "serve", lambda config, on_ready=None: seen.append(config))
    args = [
        "sim",
        "--error-rate",
        "503=0.2",
        "--error-rate",
        "429=0.05",
        "--added-latency-ms",
        "25",
        "--drop-rate",
        "0.1",
        "--malformed-rate",
        "0.05",
        "--leak-prompt-tokens",
        "3",
        "--strip-special-tokens",
        "--stall-rate",
        "0.1",
        "--stall-after-chunks",
        "3",
        "--drip-rate",
        "0.2",
        "--drip-interval-ms",
        "5",
        "--drip-bytes",
        "4",
        "--broken-tool-args-rate",
        "0.3",
        "--stream-interval",
        "2",
        "--incremental-streaming-output",
        "--fault-seed",
        "7",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen[0].faults == FaultConfig(
        error_rates=((429, 0.05), (503, 0.2)),
        added_latency_ms=25.0,
        drop_rate=0.1,
        malformed_rate=0.05,
        leak_prompt_tokens=3,
        strip_special_tokens=True,
        stall_rate=0.1,
        stall_after_chunks=3,
        drip_rate=0.2,
        drip_interval_ms=5.0,
        drip_bytes=4,
        broken_tool_args_rate=0.3,
        seed=7,
    )
    assert seen[0].stream_interval == 2 and seen[0].incremental_streaming_output
    assert seen[0].preset == "fast" and seen[0].port == 30000
    for bad in (["--error-rate", "503"], ["--drop-rate", "0.7", "--error-rate", "503=0.5"]):
        result = CliRunner().invoke(app, ["sim", *bad])
        assert result.exit_code == 2 and "error" in result.output
