"""Pure logic of the SGLang simulator: generation, finish rules, protocol, metrics, faults (the
scheduler and the radix cache are in test_sim_scheduler.py)."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
from typing import Any

import pytest

from eaglegen.sim.config import FaultConfig, SimConfig, parse_error_rate
from eaglegen.sim.engine import (
    DEFAULT_MAX_NEW_TOKENS,
    Completion,
    Finish,
    OutputShape,
    Sampling,
    ThroughputMeter,
    ToolCaller,
    ToolCallTokens,
    Vocab,
    decode_seconds,
    generate,
    has_tool_call,
    prefill_seconds,
    stream_due,
    validate_lengths,
)
from eaglegen.sim.faults import MALFORMED_BODY, Fault, FaultInjector, choose, error_body
from eaglegen.sim.metrics import QUEUE_TIME_BUCKETS, Histogram, Snapshot, parse, render
from eaglegen.sim.protocol import (
    Limits,
    RequestError,
    ids_for_text,
    leak,
    parse_generate,
    response_body,
    strip_special,
    stripped,
)
from eaglegen.sim.streaming import IncrementalText
from eaglegen.sim.vocab import load_vocab, longest_free_run

VOCAB = Vocab(
    think_end=10,
    im_end=4,
    tool_section_begin=11,
    tool_section_end=12,
    tool_call_begin=13,
    tool_call_argument_begin=14,
    tool_call_end=15,
    vocab_size=4096,
    ordinary_lo=16,
    ordinary_hi=4096,
)
SHAPE = OutputShape()
SPECIALS = {4, 10, 11, 12, 13, 14, 15}
UNLIMITED = Sampling(max_new_tokens=100_000)


def prompt(i: int, n: int = 40) -> list[int]:
    """A distinct prompt of n ordinary tokens."""
    return [16 + (i * 7919 + k * 31) % 4000 for k in range(n)]


def natural(p: list[int], seed: int = 0) -> Completion:
    """The model's unconstrained answer to p."""
    return generate(p, Sampling(max_new_tokens=100_000, seed=seed), VOCAB, SHAPE)


# --- generation -----------------------------------------------------------------------------


def test_generation_is_deterministic_per_prompt_and_seed() -> None:
    assert natural(prompt(1)) == natural(prompt(1))
    assert natural(prompt(1)).output_ids != natural(prompt(2)).output_ids
    assert natural(prompt(1), seed=1).output_ids != natural(prompt(1), seed=2).output_ids


def test_natural_output_is_reasoning_think_end_answer_then_stop() -> None:
    for i in range(50):
        out = natural(prompt(i))
        ids = out.output_ids
        assert out.finish == Finish("stop", matched=VOCAB.im_end)
        assert ids[-1] == VOCAB.im_end and ids.count(VOCAB.im_end) == 1
        think = ids.index(VOCAB.think_end)
        assert think >= 1 and ids.count(VOCAB.think_end) == 1
        assert all(t not in SPECIALS for t in ids[:think])
        assert ids[think + 1] not in SPECIALS  # a non-empty answer follows
        assert all(0 <= t < VOCAB.vocab_size for t in ids)


def fixed_calls(count: int = 1, broken: bool = False) -> ToolCaller:
    """A ToolCaller writing count calls of ordinary tokens drawn from the generation's rng."""

    def calls(rng: random.Random) -> list[ToolCallTokens]:
        return [
            ToolCallTokens((20, 21 + i), tuple(rng.choices(range(30, 40), k=6)), broken)
            for i in range(count)
        ]

    return calls


def test_without_declared_tools_no_output_calls_one() -> None:
    # A model offered no tools never calls one, whatever the prompt's digest says.
    for i in range(200):
        ids = natural(prompt(i)).output_ids
        assert VOCAB.tool_section_begin not in ids and VOCAB.tool_call_begin not in ids


def test_about_one_in_two_outputs_call_a_declared_tool_in_a_well_formed_section() -> None:
    with_tools = 0
    for i in range(400):
        p = prompt(i)
        count = 1 + i % 2
        out = generate(p, UNLIMITED, VOCAB, SHAPE, fixed_calls(count))
        ids = out.output_ids
        tool = VOCAB.tool_section_begin in ids
        assert tool == has_tool_call(p, 0) and not out.broken_tool_args
        if not tool:
            continue
        with_tools += 1
        start, end = ids.index(VOCAB.tool_section_begin), ids.index(VOCAB.tool_section_end)
        assert ids.index(VOCAB.think_end) < start < end == len(ids) - 2
        assert ids[-1] == VOCAB.im_end and out.finish.type == "stop"
        calls, rest = [], ids[start + 1 : end]
        while rest:
            assert rest[0] == VOCAB.tool_call_begin
            close = rest.index(VOCAB.tool_call_end)
            calls.append(rest[1:close])
            rest = rest[close + 1 :]
        assert len(calls) == count
        for n, call in enumerate(calls):
            split = call.index(VOCAB.tool_call_argument_begin)
            assert call[:split] == [20, 21 + n] and len(call[split + 1 :]) == 6
    assert 160 <= with_tools <= 240


def test_outputs_with_a_tool_call_keep_the_length_bound() -> None:
    shape = OutputShape(mean_tokens=300, max_tokens=64)
    for i in range(100):
        out = generate(prompt(i), UNLIMITED, VOCAB, shape, fixed_calls(2))
        assert len(out.output_ids) <= 64
    # A section longer than the longest output is not written at all.
    for i in range(20):
        out = generate(prompt(i), UNLIMITED, VOCAB, OutputShape(max_tokens=16), fixed_calls(3))
        assert VOCAB.tool_section_begin not in out.output_ids


def test_a_broken_call_is_flagged_only_when_the_output_holds_it() -> None:
    p = next(prompt(i) for i in range(100) if has_tool_call(prompt(i), 0))
    full = generate(p, UNLIMITED, VOCAB, SHAPE, fixed_calls(broken=True))
    assert full.broken_tool_args
    start = full.output_ids.index(VOCAB.tool_section_begin)
    before = generate(p, Sampling(max_new_tokens=start), VOCAB, SHAPE, fixed_calls(broken=True))
    assert not before.broken_tool_args
    inside = generate(p, Sampling(max_new_tokens=start + 1), VOCAB, SHAPE, fixed_calls(broken=True))
    assert inside.broken_tool_args


def test_lengths_vary_widely_with_a_bounded_long_tail() -> None:
    lengths = [len(natural(prompt(i)).output_ids) for i in range(1000)]
    assert 200 <= statistics.mean(lengths) <= 400
    assert min(lengths) < 60
    assert max(lengths) > 1200
    assert max(lengths) <= SHAPE.max_tokens


def test_max_new_tokens_cuts_exactly_with_length_finish() -> None:
    full = natural(prompt(3)).output_ids
    cut = generate(prompt(3), Sampling(max_new_tokens=7), VOCAB, SHAPE)
    assert cut.output_ids == full[:7]
    assert cut.finish.to_json() == {"type": "length", "length": 7}


def test_stop_token_landing_on_the_limit_reports_length_like_sglang() -> None:
    full = natural(prompt(4)).output_ids
    out = generate(prompt(4), Sampling(max_new_tokens=len(full)), VOCAB, SHAPE)
    assert out.output_ids == full
    assert out.finish == Finish("length", length=len(full))


def test_zero_max_new_tokens_generates_nothing() -> None:
    out = generate(prompt(5), Sampling(max_new_tokens=0), VOCAB, SHAPE)
    assert out.output_ids == [] and out.finish.to_json() == {"type": "length", "length": 0}


def test_ignore_eos_runs_past_the_stop_token_to_max_new_tokens() -> None:
    full = natural(prompt(6)).output_ids
    out = generate(
        prompt(6), Sampling(max_new_tokens=len(full) + 50, ignore_eos=True), VOCAB, SHAPE
    )
    assert out.output_ids[: len(full)] == full
    assert len(out.output_ids) == len(full) + 50
    assert out.finish.type == "length"


def test_stop_token_ids_stop_at_the_first_one_generated() -> None:
    full = natural(prompt(7)).output_ids
    target = full[5]
    sampling = Sampling(max_new_tokens=100_000, stop_token_ids=frozenset({target, VOCAB.think_end}))
    out = generate(prompt(7), sampling, VOCAB, SHAPE)
    first = min(full.index(target), full.index(VOCAB.think_end))
    assert out.output_ids == full[: first + 1]
    assert out.finish.to_json() == {"type": "stop", "matched": full[first]}


def test_ignore_eos_also_ignores_stop_token_ids() -> None:
    sampling = Sampling(
        max_new_tokens=30, stop_token_ids=frozenset({VOCAB.think_end}), ignore_eos=True
    )
    out = generate(prompt(8), sampling, VOCAB, SHAPE)
    assert len(out.output_ids) == 30 and out.finish.type == "length"


def test_finish_reason_shapes_match_sglang() -> None:
    assert Finish("stop", matched=4).to_json() == {"type": "stop", "matched": 4}
    assert Finish("length", length=9).to_json() == {"type": "length", "length": 9}
    abort = Finish("abort", message="gone").to_json()
    assert abort["type"] == "abort" and abort["message"] == "gone"
    assert Finish("abort", message="full", status_code=503).to_json() == {
        "type": "abort",
        "message": "full",
        "status_code": 503,
        "err_type": None,
    }


def test_stream_due_follows_sglangs_interval_rule() -> None:
    assert [n for n in range(0, 8) if stream_due(n, 1)] == [1, 2, 3, 4, 5, 6, 7]
    assert [n for n in range(0, 12) if stream_due(n, 4)] == [1, 5, 9]
    assert [n for n in range(0, 8) if stream_due(n, 2)] == [1, 3, 5, 7]


def test_context_length_messages_are_sglangs() -> None:
    assert validate_lengths(10, 20, 100) is None
    too_long = validate_lengths(100, 1, 100)
    assert too_long == (
        "The input (100 tokens) is longer than the model's context length (100 tokens)."
    )
    total = validate_lengths(60, 40, 100)
    assert total is not None and total.startswith(
        "Requested token count exceeds the model's maximum context length of 100 tokens."
    )


def test_timing_formulas() -> None:
    assert prefill_seconds(5000, 50.0) == pytest.approx(0.1)
    assert decode_seconds(64, 4.0, 0.15) == pytest.approx(0.0136)


# --- throughput ----------------------------------------------------------------------------


def test_throughput_meter_over_a_window() -> None:
    meter = ThroughputMeter(window_s=2.0)
    for i in range(11):
        meter.record(i * 0.5, i * 100)
    assert meter.rate(5.0) == pytest.approx(200.0, rel=0.2)
    assert meter.rate(60.0) == 0.0


# --- protocol -------------------------------------------------------------------------------

LIMITS = Limits(vocab_size=4096, context_length=1000, kv_tokens=5000, default_seed=7)


def test_parse_single_request() -> None:
    req = parse_generate(
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 50}, "rid": "job-9"}, LIMITS
    )
    assert not req.is_batch and len(req.items) == 1
    item = req.items[0]
    assert item.rid == "job-9" and item.input_ids == [1, 2, 3]
    assert item.sampling == Sampling(max_new_tokens=50, seed=7)
    assert item.reserve == 53


def test_parse_defaults_like_sglang() -> None:
    item = parse_generate({"input_ids": [1, 2]}, LIMITS).items[0]
    assert item.sampling.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert len(item.rid) == 32  # uuid hex
    assert item.text_options.skip_special_tokens is True
    unlimited = parse_generate(
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": None}}, LIMITS
    )
    assert unlimited.items[0].sampling.max_new_tokens == 999 - 2 - 1


def test_parse_sampling_seed_and_stop_token_ids() -> None:
    params = {"sampling_seed": 3, "stop_token_ids": [10], "ignore_eos": False}
    item = parse_generate({"input_ids": [1], "sampling_params": params}, LIMITS).items[0]
    assert item.sampling.seed == 3 and item.sampling.stop_token_ids == frozenset({10})


def test_parse_batch_with_rid_list_prefix_and_per_item_params() -> None:
    body: dict[str, Any] = {
        "input_ids": [[1], [2, 3]],
        "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 6}],
        "rid": ["a", "b"],
    }
    req = parse_generate(body, LIMITS)
    assert req.is_batch and [i.rid for i in req.items] == ["a", "b"]
    assert [i.sampling.max_new_tokens for i in req.items] == [5, 6]
    body["rid"] = "p"
    assert [i.rid for i in parse_generate(body, LIMITS).items] == ["p_0", "p_1"]


@pytest.mark.parametrize(
    ("body", "fragment", "validation"),
    [
        ({"input_ids": [1], "foo": 1}, "Unknown field", False),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "Unexpected keyword", False),
        ({"text": "hi"}, "input_ids only", False),
        ({"input_ids": []}, "input_ids cannot be empty.", False),
        ({}, "Either text, input_ids or input_embeds", False),
        ({"input_ids": [1, "x"]}, "list of integers", True),
        ({"input_ids": [1, 5000]}, "outside the vocabulary", False),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "9"}}, "valid integer", True),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]", False),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "parallel sampling", False),
        ({"input_ids": [1], "stream": "maybe"}, "stream: Input should be a valid boolean", True),
        ({"input_ids": [1], "stream": None}, "stream: Input should be a valid boolean", True),
        ({"input_ids": [1], "sampling_params": {"stream_interval": -1}}, "stream_interval", False),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "Duplicate request IDs", False),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rids length mismatch", False),
        ({"input_ids": list(range(1000))}, "longer than the model's context length", False),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 999}}, "Requested token", False),
        ([1, 2], "valid dictionary", True),
    ],
)
def test_parse_rejects_like_sglang(body: object, fragment: str, validation: bool) -> None:
    with pytest.raises(RequestError) as info:
        parse_generate(body, LIMITS)
    assert fragment in info.value.message
    assert info.value.validation is validation
    error_body = info.value.body()
    if validation:
        assert error_body["object"] == "error" and error_body["code"] == 400
    else:
        assert error_body == {"error": {"message": info.value.message}}


def test_max_new_tokens_is_clamped_to_the_kv_pool() -> None:
    small_pool = Limits(vocab_size=4096, context_length=1000, kv_tokens=300, default_seed=0)
    item = parse_generate(
        {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 500}}, small_pool
    )
    assert item.items[0].sampling.max_new_tokens == 299 - 100 - 1


def test_text_ids_trim_the_matched_stop_token_unless_no_stop_trim() -> None:
    done = Completion([20, 21, 4], Finish("stop", matched=4))
    item = parse_generate({"input_ids": [1]}, LIMITS).items[0]
    assert ids_for_text(done, item.text_options) == [20, 21]
    keep = parse_generate({"input_ids": [1], "sampling_params": {"no_stop_trim": True}}, LIMITS)
    assert ids_for_text(done, keep.items[0].text_options) == [20, 21, 4]


# --- streaming ------------------------------------------------------------------------------


def test_incremental_text_adds_whole_characters_and_ends_with_the_full_text() -> None:
    from eaglegen import assets

    vocab, tokenizer = load_vocab(assets.TOKENIZER_DIR)
    for i in range(60):
        ids = generate(prompt(i), UNLIMITED, vocab, SHAPE).output_ids
        for skip in (True, False):

            def decode(part: list[int], skip: bool = skip) -> str:
                return str(tokenizer.decode(part, skip_special_tokens=skip))

            text = IncrementalText(decode)
            deltas = []
            for end in range(1, len(ids), 1 + i % 3):
                deltas.append(text.advance(ids, end))
                assert decode(ids[:end]).startswith(text.text)
                assert not text.text.endswith("\ufffd")
            deltas.append(text.finish(decode(ids)))
            assert "".join(deltas) == text.text == decode(ids)


def test_incremental_text_holds_back_a_split_character() -> None:
    from eaglegen import assets

    _, tokenizer = load_vocab(assets.TOKENIZER_DIR)
    ids = tokenizer.encode("a日", add_special_tokens=False).ids
    assert len(ids) == 4  # "a", then one token per byte of the character
    text = IncrementalText(lambda part: str(tokenizer.decode(part)))
    assert [text.advance(ids, end) for end in range(1, 5)] == ["a", "", "", "日"]


# --- metrics, config, vocabulary ------------------------------------------------------------


def test_metrics_render_with_sglang_names_and_parse_back() -> None:
    snap = Snapshot(3, 2, 1500, 0.01, 123.5, 0.25, 159_000, 100, 200, 30, 4)
    hist = Histogram()
    hist.observe(0.15)
    hist.observe(3.0)
    samples = parse(render(snap, hist, "m"))
    gauge = '{engine_type="unified",model_name="m",tp_rank="0"}'
    assert samples[f"sglang:num_running_reqs{gauge}"] == 3
    assert samples[f"sglang:num_queue_reqs{gauge}"] == 2
    assert samples[f"sglang:token_usage{gauge}"] == 0.01
    assert samples[f"sglang:gen_throughput{gauge}"] == 123.5
    assert samples[f"sglang:cache_hit_rate{gauge}"] == 0.25
    assert samples['sglang:prompt_tokens_total{model_name="m"}'] == 100
    assert samples['sglang:generation_tokens_total{model_name="m"}'] == 200
    assert samples['sglang:e2e_request_latency_seconds_bucket{model_name="m",le="0.2"}'] == 1
    assert samples['sglang:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"}'] == 2
    assert samples['sglang:e2e_request_latency_seconds_count{model_name="m"}'] == 2


def test_metrics_render_retraction_counters_ratio_and_queue_time() -> None:
    snap = Snapshot(
        *(3, 2, 1500, 0.01, 123.5, 0.25, 159_000, 100, 200, 30, 4),
        num_retracted_reqs=2,
        num_retracted_requests_total=7,
        num_retracted_input_tokens_total=700,
        num_retracted_output_tokens_total=900,
        new_token_ratio=0.42,
    )
    queue = Histogram(QUEUE_TIME_BUCKETS)
    queue.observe(0.0)
    queue.observe(0.3)
    text = render(snap, Histogram(), "m", queue)
    samples = parse(text)
    gauge = '{engine_type="unified",model_name="m",tp_rank="0"}'
    assert samples[f"sglang:num_retracted_reqs{gauge}"] == 2
    assert samples[f"sglang:num_retracted_requests_total{gauge}"] == 7
    assert samples[f"sglang:num_retracted_input_tokens_total{gauge}"] == 700
    assert samples[f"sglang:num_retracted_output_tokens_total{gauge}"] == 900
    assert samples[f"sglang:new_token_ratio{gauge}"] == 0.42
    labels = 'engine_type="unified",model_name="m",tp_rank="0"'
    assert samples[f'sglang:queue_time_seconds_bucket{{{labels},le="0.0"}}'] == 1
    assert samples[f'sglang:queue_time_seconds_bucket{{{labels},le="0.5"}}'] == 2
    assert samples[f"sglang:queue_time_seconds_count{gauge}"] == 2
    assert "# TYPE sglang:num_retracted_requests_total counter" in text


def test_config_validates_and_keeps_faults_off_by_default() -> None:
    config = SimConfig()
    assert config.kv_tokens == 159_000 and config.context_length == 32_768 and config.port == 0
    # SGLang's defaults: a chunk per token, each with everything so far.
    assert config.stream_interval == 1 and not config.incremental_streaming_output
    with pytest.raises(ValueError):
        SimConfig(stream_interval=0)
    assert not config.faults.any_enabled()
    assert config.tokenizer_path == SimConfig(tokenizer_dir=None).tokenizer_path
    assert FaultConfig(drop_rate=0.1).any_enabled()
    with pytest.raises(ValueError):
        SimConfig(kv_tokens=0)
    with pytest.raises(ValueError):
        SimConfig(port=70_000)


def test_longest_free_run_avoids_reserved_ids() -> None:
    assert longest_free_run({0, 1, 2, 9}, 20) == (10, 20)
    assert longest_free_run({15, 16}, 20) == (0, 15)
    with pytest.raises(ValueError):
        longest_free_run({0}, 1)


def test_load_vocab_from_the_packaged_tokenizer() -> None:
    from eaglegen import assets

    vocab, tokenizer = load_vocab(assets.TOKENIZER_DIR)
    ids = assets.special_ids(assets.TOKENIZER_DIR)
    assert (vocab.think_end, vocab.im_end) == (ids.think_end, ids.im_end)
    assert vocab.tool_section_begin == ids.tool_calls_section_begin
    added = set(tokenizer.get_added_tokens_decoder())
    assert not added & set(range(vocab.ordinary_lo, vocab.ordinary_hi))
    assert vocab.ordinary_hi - vocab.ordinary_lo > 1000
    out = generate(prompt(1), UNLIMITED, vocab, SHAPE)
    text = tokenizer.decode(out.output_ids, skip_special_tokens=False)
    assert "</think>" in text and text.endswith("<|im_end|>")


# --- faults ---------------------------------------------------------------------------------

MIXED = FaultConfig(drop_rate=0.1, malformed_rate=0.1, error_rates=((503, 0.2), (429, 0.1)), seed=3)


def test_one_draw_picks_at_most_one_fault_from_tiled_rates() -> None:
    # The draw tiles [0, 1): drop, malformed, then statuses ascending (429 before 503).
    assert choose(MIXED, 0.0) == Fault("drop")
    assert choose(MIXED, 0.1) == Fault("malformed")
    assert choose(MIXED, 0.2) == Fault("error", 429)
    assert choose(MIXED, 0.35) == Fault("error", 503)
    assert choose(MIXED, 0.5) is None
    assert choose(FaultConfig(), 0.0) is None
    assert choose(FaultConfig(error_rates=((500, 1.0),)), 0.999999) == Fault("error", 500)


def test_stall_and_drip_share_one_slice_split_by_streaming() -> None:
    faults = FaultConfig(drop_rate=0.2, stall_rate=0.3, drip_rate=0.5)
    assert faults.total_rate() == pytest.approx(0.7)
    assert choose(faults, 0.1, stream=True) == choose(faults, 0.1) == Fault("drop")
    assert choose(faults, 0.3, stream=True) == Fault("stall")
    assert choose(faults, 0.6, stream=True) is None
    assert choose(faults, 0.3) == choose(faults, 0.6) == Fault("drip")
    assert choose(faults, 0.75) is None
    # They never hit the same call, so together they may exceed what the others leave.
    FaultConfig(error_rates=((503, 0.4),), stall_rate=0.6, drip_rate=0.6)
    with pytest.raises(ValueError):
        FaultConfig(error_rates=((503, 0.5),), stall_rate=0.6)


def test_fault_config_validates_and_normalises() -> None:
    assert FaultConfig(error_rates=((503, 0.1), (429, 0.2))) == FaultConfig(
        error_rates=((429, 0.2), (503, 0.1))
    )
    assert not FaultConfig(seed=5).any_enabled()
    assert FaultConfig(unhealthy=True).any_enabled()
    assert MIXED.total_rate() == pytest.approx(0.5)
    for bad in (
        {"drop_rate": 1.5},
        {"malformed_rate": -0.1},
        {"error_rates": ((200, 0.1),)},
        {"error_rates": ((503, 0.1), (503, 0.2))},
        {"error_rates": ((503, 0.6),), "drop_rate": 0.5},
        {"added_latency_ms": -1.0},
        {"stall_rate": 1.5},
        {"drip_rate": -0.1},
        {"broken_tool_args_rate": 2.0},
        {"stall_after_chunks": -1},
        {"drip_bytes": 0},
        {"drip_interval_ms": -5.0},
    ):
        with pytest.raises(ValueError):
            FaultConfig(**bad)


def test_fault_config_json_round_trip_and_rejections() -> None:
    body = MIXED.to_json()
    assert body["error_rates"] == {"429": 0.1, "503": 0.2}
    assert FaultConfig.from_json(json.loads(json.dumps(body))) == MIXED
    assert FaultConfig.from_json({}) == FaultConfig()
    new_knobs = FaultConfig(
        stall_rate=0.2,
        stall_after_chunks=3,
        drip_rate=0.1,
        drip_interval_ms=5,
        drip_bytes=4,
        broken_tool_args_rate=0.25,
    )
    assert FaultConfig.from_json(json.loads(json.dumps(new_knobs.to_json()))) == new_knobs
    assert new_knobs.any_enabled()
    bad_bodies: list[object] = [
        [],
        {"drop": 0.1},
        {"error_rates": [[503, 0.1]]},
        {"error_rates": {"abc": 0.1}},
        {"error_rates": {"503": "0.1"}},
        {"drop_rate": True},
        {"seed": 1.5},
        {"unhealthy": 1},
        {"stall_after_chunks": 1.5},
        {"drip_bytes": "8"},
    ]
    for bad in bad_bodies:
        with pytest.raises(ValueError):
            FaultConfig.from_json(bad)


def test_parse_error_rate_from_the_command_line() -> None:
    assert parse_error_rate("503=0.2") == (503, 0.2)
    for bad in ("503", "=0.2", "503=x", "x=0.1"):
        with pytest.raises(ValueError, match="STATUS=PROBABILITY"):
            parse_error_rate(bad)


def test_injector_draws_are_seeded_and_restart_on_replace() -> None:
    def kinds(injector: FaultInjector, n: int) -> list[Fault | None]:
        return [injector.decide().fault for _ in range(n)]

    first = kinds(FaultInjector(MIXED), 200)
    assert first == kinds(FaultInjector(MIXED), 200)
    rng = random.Random(MIXED.seed)
    assert first == [choose(MIXED, rng.random()) for _ in range(200)]
    assert first != kinds(FaultInjector(replace(MIXED, seed=4)), 200)
    injector = FaultInjector(FaultConfig())
    assert kinds(injector, 5) == [None] * 5
    injector.replace(MIXED)
    assert kinds(injector, 200) == first


def test_injector_tallies_every_kind() -> None:
    faults = FaultConfig(error_rates=((503, 1.0),), added_latency_ms=5, leak_prompt_tokens=True)
    injector = FaultInjector(faults)
    decision = injector.decide()
    assert decision.fault == Fault("error", 503)
    assert decision.delay_s == pytest.approx(0.005) and decision.leak_prompt_tokens
    injector.replace(FaultConfig(drop_rate=0.5, malformed_rate=0.5, unhealthy=True))
    for _ in range(10):
        injector.decide()
    injector.replace(FaultConfig(stall_rate=1.0, drip_rate=1.0, unhealthy=True))
    assert injector.decide(stream=True).fault == Fault("stall")
    assert injector.decide().fault == Fault("drip")
    assert not injector.health_ok()
    stats = injector.stats.to_json()
    injected = stats["injected"]
    assert stats["generate_requests"] == 13 and injected["errors"] == {"503": 1}
    assert injected["stalled"] == injected["dripped"] == 1 and injected["broken_tool_args"] == 0
    assert injected["dropped"] + injected["malformed"] == 10 and injected["dropped"] > 0
    assert injected["delayed"] == 1 and injected["unhealthy_health_checks"] == 1
    injector.replace(FaultConfig())
    assert injector.health_ok()


def test_error_bodies_have_sglangs_shapes() -> None:
    assert set(error_body(400)) == {"error"} and error_body(400)["error"]["message"]
    queue_full = error_body(503)
    assert queue_full["message"] == "The request queue is full."
    assert queue_full["object"] == "error" and queue_full["code"] == 503
    for status in (429, 500, 502, 504, 599):
        body = error_body(status)
        assert body["object"] == "error" and body["code"] == status
        assert body["type"] == str(status) and body["message"]
    with pytest.raises(ValueError):
        json.loads(MALFORMED_BODY)


def test_leaked_prompt_tokens_break_the_length_invariant_like_the_real_bug() -> None:
    item = parse_generate({"input_ids": [5, 6, 7]}, LIMITS).items[0]
    out = natural(prompt(3))
    body = response_body(item, out, text="", cached_tokens=0, e2e_latency=0.1)
    for n, lead in ((1, [7]), (2, [6, 7]), (3, [5, 6, 7]), (10, [5, 6, 7])):
        leaked = response_body(
            item, out, text="", cached_tokens=0, e2e_latency=0.1, leak_prompt_tokens=n
        )
        assert leaked["output_ids"] == [*lead, *body["output_ids"]]
        assert leaked["meta_info"] == body["meta_info"]
        assert leaked["meta_info"]["completion_tokens"] == len(out.output_ids)
    assert leak([1, 2], [5, 6, 7], 0) == [1, 2]


def test_leak_prompt_tokens_is_a_count_and_accepts_the_older_boolean() -> None:
    assert FaultConfig(leak_prompt_tokens=True).leak_prompt_tokens == 1
    assert FaultConfig.from_json({"leak_prompt_tokens": True}).leak_prompt_tokens == 1
    assert FaultConfig.from_json({"leak_prompt_tokens": 4}).leak_prompt_tokens == 4
    assert FaultConfig.from_json({"leak_prompt_tokens": False}) == FaultConfig()
    assert FaultConfig(leak_prompt_tokens=2).any_enabled()
    for bad in ({"leak_prompt_tokens": -1}, {"leak_prompt_tokens": 1.5}):
        with pytest.raises(ValueError):
            FaultConfig.from_json(bad)


def test_strip_special_tokens_drops_markers_but_keeps_the_final_stop_token() -> None:
    specials = VOCAB.special_ids()
    p = next(prompt(i) for i in range(100) if has_tool_call(prompt(i), 0))
    out = generate(p, UNLIMITED, VOCAB, SHAPE, fixed_calls(2))
    assert VOCAB.tool_call_begin in out.output_ids and VOCAB.think_end in out.output_ids
    shown = stripped(out, specials)
    assert shown.output_ids == [t for t in out.output_ids[:-1] if t not in specials] + [4]
    assert shown.finish == out.finish
    item = parse_generate({"input_ids": [5, 6, 7]}, LIMITS).items[0]
    body = response_body(item, shown, text="", cached_tokens=0, e2e_latency=0.1)
    assert (
        body["meta_info"]["completion_tokens"] == len(shown.output_ids) == len(body["output_ids"])
    )
    # A cut output has no final stop token to keep; an unfinished stream chunk neither.
    cut = generate(p, Sampling(max_new_tokens=len(out.output_ids)), VOCAB, SHAPE, fixed_calls(2))
    assert cut.finish.type == "length" and VOCAB.im_end not in stripped(cut, specials).output_ids
    assert strip_special([20, 10, 21, 4], specials, final_stop=False) == [20, 21]
    assert FaultConfig.from_json({"strip_special_tokens": True}).strip_special_tokens
