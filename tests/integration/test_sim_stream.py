"""Streamed /generate (`"stream": true`) over real HTTP, as SGLang's http_server sends it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from eaglegen import assets
from eaglegen.sim import SimConfig, SimServer
from eaglegen.sim.metrics import parse

IDS = assets.special_ids(assets.TOKENIZER_DIR)
MODEL = "eaglegen/sim-reasoner"
GAUGE = f'{{engine_type="unified",model_name="{MODEL}",tp_rank="0"}}'
COUNTER = f'{{model_name="{MODEL}"}}'
FAST = SimConfig(context_length=4096, decode_step_ms=0.5, decode_ms_per_request=0.005)
DONE = b"data: [DONE]"


def prompt(i: int, n: int = 60) -> list[int]:
    """A distinct chat-like prompt ending in the think-start token."""
    return [IDS.bos, *(100 + (i * 7919 + k * 31) % 3900 for k in range(n)), IDS.think_start]


def payload(i: int, max_new: int = 256, stream: bool = True, **params: Any) -> dict[str, Any]:
    """A /generate call with every sampling value explicit."""
    sampling = {"max_new_tokens": max_new, "temperature": 0.6, "skip_special_tokens": False}
    return {"input_ids": prompt(i), "sampling_params": {**sampling, **params}, "stream": stream}


@dataclass
class Stream:
    """What a client read from one streamed call."""

    chunks: list[dict[str, Any]]
    content_type: str


def read_stream(client: httpx.Client, body: dict[str, Any]) -> Stream:
    """Read every event of a streamed call, checking the framing SGLang uses."""
    events: list[bytes] = []
    buffer = b""
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for piece in response.iter_bytes():
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append(event)
        content_type = response.headers["content-type"]
    assert buffer == b"" and events[-1] == DONE and DONE not in events[:-1]
    assert all(event.startswith(b"data: ") for event in events)
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    return Stream(chunks, content_type)


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Parsed /metrics."""
    return parse(client.get("/metrics").text)


def wait_idle(client: httpx.Client, timeout_s: float = 5.0) -> dict[str, float]:
    """/metrics once nothing runs any more (or after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(client)
        if not values[f"sglang:num_running_reqs{GAUGE}"] or time.monotonic() > deadline:
            return values
        time.sleep(0.02)


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


def test_chunks_are_server_sent_events_growing_to_the_answer(client: httpx.Client) -> None:
    stream = read_stream(client, payload(1, max_new=4000))
    assert stream.content_type.startswith("text/event-stream")
    chunks = stream.chunks
    assert len(chunks) > 10
    for n, chunk in enumerate(chunks, start=1):
        assert set(chunk) == {"text", "output_ids", "meta_info"}
        meta = chunk["meta_info"]
        # SGLang's defaults: a chunk per token, output_ids and text everything so far.
        assert meta["completion_tokens"] == n == len(chunk["output_ids"])
        assert (
            meta["prompt_tokens"] == len(prompt(1)) and meta["id"] == chunks[0]["meta_info"]["id"]
        )
        last = n == len(chunks)
        assert (meta["finish_reason"] is None) is not last
        assert ("e2e_latency" in meta) is last
        if not last:
            following = chunks[n]
            assert following["output_ids"][: len(chunk["output_ids"])] == chunk["output_ids"]
            assert following["text"].startswith(chunk["text"])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": IDS.im_end}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_last_chunk_is_the_non_streamed_answer(client: httpx.Client, seed: int) -> None:
    for i, max_new in ((2, 4000), (3, 40)):
        call = payload(i, max_new=max_new, sampling_seed=seed)
        last = read_stream(client, call).chunks[-1]
        whole = client.post("/generate", json={**call, "stream": False}).json()
        assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
        for key in ("finish_reason", "completion_tokens", "prompt_tokens"):
            assert last["meta_info"][key] == whole["meta_info"][key]


def test_stream_interval_spaces_chunks_like_sglang(client: httpx.Client) -> None:
    chunks = read_stream(client, payload(4, max_new=30, ignore_eos=True, stream_interval=4)).chunks
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    # The first token, then every fourth after it, and the last.
    assert counts == [1, 5, 9, 13, 17, 21, 25, 29, 30]
    with (
        SimServer(SimConfig(decode_step_ms=0.5, stream_interval=10)) as server,
        httpx.Client(base_url=server.url, timeout=30) as other,
    ):
        chunks = read_stream(other, payload(4, max_new=30, ignore_eos=True)).chunks
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 11, 21, 30]
        # A request's own stream_interval wins; 0 means the server's.
        chunks = read_stream(other, payload(4, max_new=5, stream_interval=0)).chunks
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 5]


def test_incremental_streaming_output_sends_only_what_is_new() -> None:
    config = SimConfig(decode_step_ms=0.5, incremental_streaming_output=True)
    with SimServer(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        call = payload(5, max_new=4000)
        chunks = read_stream(c, call).chunks
        whole = c.post("/generate", json={**call, "stream": False}).json()
    assert all(len(chunk["output_ids"]) == 1 for chunk in chunks)
    assert [t for chunk in chunks for t in chunk["output_ids"]] == whole["output_ids"]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    counts = [chunk["meta_info"]["completion_tokens"] for chunk in chunks]
    assert counts == list(range(1, len(whole["output_ids"]) + 1))


def test_each_decoded_token_is_a_chunk_of_its_own() -> None:
    # One chunk per decode step (stream_interval 1), counting up. That chunks reach the client
    # while the request still decodes is the first check of the test below (a condition, not
    # a gap between arrivals: on a loaded machine any such gap can stretch).
    config = SimConfig(decode_step_ms=1.0, decode_ms_per_request=0.0)
    call = payload(6, max_new=150, ignore_eos=True)
    with SimServer(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        stream = read_stream(c, call)
    counts = [chunk["meta_info"]["completion_tokens"] for chunk in stream.chunks]
    assert counts == list(range(1, 151))


def test_a_client_leaving_mid_stream_frees_its_request() -> None:
    # Decoding slow enough that the request still runs when the client leaves, however
    # loaded the machine: 3,000 tokens at 10 ms a step, and the client leaves after one.
    with (
        SimServer(replace(FAST, decode_step_ms=10.0)) as sim,
        httpx.Client(base_url=sim.url, timeout=30) as client,
    ):
        before = metric_values(client)
        call = payload(7, max_new=3000, ignore_eos=True)
        with (
            httpx.Client(base_url=sim.url, timeout=30) as leaving,
            leaving.stream("POST", "/generate", json=call) as response,
        ):
            # The line iterator is held for the whole block: a temporary one would be closed
            # (and httpx would close the connection, leaving at once) as soon as the first
            # line is read, so the request would be gone before the check below could see it.
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            meta = json.loads(first.removeprefix("data: "))["meta_info"]
            assert meta["completion_tokens"] == 1
            # Counted running while its client is there (polled: the first chunk can reach
            # the client before a loaded machine's scheduler thread has run again).
            deadline = time.monotonic() + 5.0
            while metric_values(client)[f"sglang:num_running_reqs{GAUGE}"] != 1:
                assert time.monotonic() < deadline, "the streaming request is not running"
                time.sleep(0.05)
        after = wait_idle(client)
    assert after[f"sglang:num_running_reqs{GAUGE}"] == 0
    assert after[f"sglang:token_usage{GAUGE}"] == 0
    # Aborted, not finished: the request counts nowhere.
    key = f"sglang:num_requests_total{COUNTER}"
    assert after[key] == before[key]


def test_a_batch_streams_each_prompt_with_its_index(client: httpx.Client) -> None:
    prompts = [prompt(20 + i) for i in range(3)]
    sampling = {"max_new_tokens": 64, "skip_special_tokens": False}
    body = {"input_ids": prompts, "sampling_params": sampling, "rid": ["a", "b", "c"]}
    chunks = read_stream(client, {**body, "stream": True}).chunks
    whole = client.post("/generate", json=body).json()
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        assert set(chunk) == {"text", "output_ids", "meta_info", "index"}
        by_index.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_index) == [0, 1, 2]
    for index, own in by_index.items():
        assert {c["meta_info"]["id"] for c in own} == {"abc"[index]}
        assert [c["meta_info"]["finish_reason"] is None for c in own[:-1]] == [True] * (
            len(own) - 1
        )
        assert own[-1]["output_ids"] == whole[index]["output_ids"]
        assert own[-1]["text"] == whole[index]["text"]
    # Interleaved as the prompts decode, not one prompt after the other.
    assert [c["index"] for c in chunks[:3]] == [0, 1, 2]


def test_errors_after_the_stream_starts_are_data_events(client: httpx.Client) -> None:
    too_long = {**payload(8), "sampling_params": {"max_new_tokens": 5000}}
    with client.stream("POST", "/generate", json=too_long) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().split(b"\n\n")
    assert events[-2:] == [DONE, b""] and len(events) == 3
    error = json.loads(events[0].removeprefix(b"data: "))
    assert set(error) == {"error"}
    assert error["error"]["message"].startswith("Requested token count exceeds")
    # FastAPI rejects a malformed body before SGLang streams anything.
    for bad in ({**payload(8), "stream": "maybe"}, {**payload(8), "input_ids": ["x"]}):
        response = client.post("/generate", json=bad)
        assert response.status_code == 400 and response.json()["object"] == "error"


def test_a_full_queue_streams_an_abort_like_sglangs_scheduler() -> None:
    config = SimConfig(decode_step_ms=0.5, max_queued_requests=0)
    with SimServer(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        chunks = read_stream(c, payload(9)).chunks
        assert c.post("/generate", json={**payload(9), "stream": False}).status_code == 503
    [chunk] = chunks
    assert chunk["output_ids"] == [] and chunk["meta_info"]["completion_tokens"] == 0
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "The request queue is full.",
        "status_code": 503,
        "err_type": None,
    }


def test_streamed_requests_count_in_metrics(client: httpx.Client) -> None:
    before = metric_values(client)
    streams = [read_stream(client, payload(30 + i, max_new=100)) for i in range(5)]
    after = wait_idle(client)
    generated = sum(s.chunks[-1]["meta_info"]["completion_tokens"] for s in streams)
    for key, expected in (
        (f"sglang:num_requests_total{COUNTER}", 5),
        (f"sglang:generation_tokens_total{COUNTER}", generated),
        (f"sglang:prompt_tokens_total{COUNTER}", 5 * len(prompt(0))),
        (f"sglang:e2e_request_latency_seconds_count{COUNTER}", 5),
    ):
        assert after[key] - before[key] == expected, key


def test_server_info_reports_the_streaming_settings(client: httpx.Client) -> None:
    info = client.get("/get_server_info").json()
    assert info["stream_interval"] == 1 and info["incremental_streaming_output"] is False
