"""`eaglegen sim`: the SGLang-compatible simulator, for the demo, tests and benchmarks."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from eaglegen.cli.base import command, err
from eaglegen.report.text import inline

app = typer.Typer()

# Server flags left unset take the preset's value.
Opt = typer.Option


@command(app)
def sim(
    preset: Annotated[
        str, Opt(help="Named server: fast (default), kimi-k2 (the real run's), kv-rich")
    ] = "fast",
    host: Annotated[str, Opt(help="Bind address")] = "127.0.0.1",
    port: Annotated[int, Opt(help="Port (0 = any free port)")] = 30000,
    kv_tokens: Annotated[int | None, Opt(help="KV pool size in tokens")] = None,
    context_length: Annotated[int | None, Opt(help="Model context length")] = None,
    max_running_requests: Annotated[int | None, Opt(help="Running batch cap")] = None,
    max_queued_requests: Annotated[
        int | None, Opt(help="Waiting-queue cap; beyond it requests get 503")
    ] = None,
    max_prefill_tokens: Annotated[int | None, Opt(help="Prefill tokens per batch")] = None,
    chunked_prefill_size: Annotated[
        int | None, Opt(help="Prefill a longer prompt in chunks of this many tokens")
    ] = None,
    init_new_token_ratio: Annotated[
        float | None, Opt(help="Share of a running request's max_new_tokens reserved at first")
    ] = None,
    min_new_token_ratio: Annotated[float | None, Opt(help="Floor the share decays to")] = None,
    max_output_tokens: Annotated[int | None, Opt(help="Longest natural output")] = None,
    model_path: Annotated[str | None, Opt(help="Model name reported")] = None,
    seed: Annotated[int | None, Opt(help="Default sampling seed")] = None,
    tokenizer: Annotated[
        Path | None, Opt(help="Tokenizer folder (with tokenizer.json) whose ids to speak")
    ] = None,
    family: Annotated[
        str | None,
        Opt(help="Model family of the outputs' layout (default: detected from the tokenizer)"),
    ] = None,
    decode_step_ms: Annotated[float | None, Opt(help="Decode step base time")] = None,
    decode_ms_per_request: Annotated[float | None, Opt(help="Added per running request")] = None,
    prefill_tokens_per_ms: Annotated[float | None, Opt(help="Prefill speed")] = None,
    prefill_step_ms: Annotated[float | None, Opt(help="Prefill pass base time")] = None,
    mean_output_tokens: Annotated[int | None, Opt(help="Mean natural output length")] = None,
    time_scale: Annotated[
        float | None, Opt(help="Multiply every step's duration (0.05 = 20 times faster)")
    ] = None,
    stream_interval: Annotated[
        int | None, Opt(help="Tokens between the chunks of a streamed answer")
    ] = None,
    incremental_streaming_output: Annotated[
        bool,
        Opt(
            "--incremental-streaming-output",
            help="Stream only the new text and output_ids in each chunk",
        ),
    ] = False,
    error_rate: Annotated[
        list[str] | None,
        Opt(metavar="STATUS=P", help="Answer STATUS with probability P (repeatable)"),
    ] = None,
    added_latency_ms: Annotated[float, Opt(help="Extra delay on each /generate")] = 0.0,
    drop_rate: Annotated[float, Opt(help="Probability of closing unanswered")] = 0.0,
    malformed_rate: Annotated[float, Opt(help="Probability of a non-JSON 200")] = 0.0,
    leak_prompt_tokens: Annotated[
        int, Opt(metavar="N", help="Start output_ids with the last N prompt tokens")
    ] = 0,
    strip_special_tokens: Annotated[
        bool,
        Opt("--strip-special-tokens", help="Leave the added special tokens out of output_ids"),
    ] = False,
    stall_rate: Annotated[
        float, Opt(help="Probability that a streamed answer goes silent, held open")
    ] = 0.0,
    stall_after_chunks: Annotated[
        int, Opt(help="Chunks a stalled stream sends before going silent")
    ] = 1,
    drip_rate: Annotated[
        float, Opt(help="Probability that a non-streamed body trickles out")
    ] = 0.0,
    drip_interval_ms: Annotated[float, Opt(help="Pause between dripped pieces")] = 50.0,
    drip_bytes: Annotated[int, Opt(help="Bytes per dripped piece")] = 16,
    broken_tool_args_rate: Annotated[
        float, Opt(help="Probability that a tool call's arguments are not JSON")
    ] = 0.0,
    fault_seed: Annotated[int, Opt(help="Seed of the per-request fault draws")] = 0,
) -> None:
    """Run the SGLang-compatible simulator (speaks /generate, /metrics, ...)."""
    from eaglegen import sim as simulator
    from eaglegen.sim import FaultConfig
    from eaglegen.sim.config import parse_error_rate

    faults = FaultConfig(
        error_rates=tuple(parse_error_rate(text) for text in error_rate or ()),
        added_latency_ms=added_latency_ms,
        drop_rate=drop_rate,
        malformed_rate=malformed_rate,
        leak_prompt_tokens=leak_prompt_tokens,
        strip_special_tokens=strip_special_tokens,
        stall_rate=stall_rate,
        stall_after_chunks=stall_after_chunks,
        drip_rate=drip_rate,
        drip_interval_ms=drip_interval_ms,
        drip_bytes=drip_bytes,
        broken_tool_args_rate=broken_tool_args_rate,
        seed=fault_seed,
    )
    given: dict[str, Any] = {
        "kv_tokens": kv_tokens,
        "context_length": context_length,
        "max_running_requests": max_running_requests,
        "max_queued_requests": max_queued_requests,
        "max_prefill_tokens": max_prefill_tokens,
        "chunked_prefill_size": chunked_prefill_size,
        "init_new_token_ratio": init_new_token_ratio,
        "min_new_token_ratio": min_new_token_ratio,
        "max_output_tokens": max_output_tokens,
        "model_path": model_path,
        "seed": seed,
        "tokenizer_dir": tokenizer,
        "family": family,
        "decode_step_ms": decode_step_ms,
        "decode_ms_per_request": decode_ms_per_request,
        "prefill_tokens_per_ms": prefill_tokens_per_ms,
        "prefill_step_ms": prefill_step_ms,
        "mean_output_tokens": mean_output_tokens,
        "time_scale": time_scale,
        "stream_interval": stream_interval,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    if incremental_streaming_output:
        overrides["incremental_streaming_output"] = True
    config = simulator.preset(preset, host=host, port=port, faults=faults, **overrides)
    if faults.any_enabled():
        err.print(f"injecting faults: {json.dumps(faults.to_json())}", highlight=False)
    _warnings_as_lines()
    simulator.serve(config, on_ready=lambda url: err.print(f"simulator listening on {url}"))


class _WarningLine(logging.Handler):
    """The simulator's warnings (a tokenizer of no known family) as `warning: ...` lines."""

    def emit(self, record: logging.LogRecord) -> None:
        text = inline(record.getMessage())
        err.print(f"warning: {text}", highlight=False, soft_wrap=True)


def _warnings_as_lines() -> None:
    """Show the server module's startup warnings (once, however often the command runs)."""
    logger = logging.getLogger("eaglegen.sim.server")
    if not any(isinstance(handler, _WarningLine) for handler in logger.handlers):
        handler = _WarningLine()
        handler.addFilter(lambda record: record.levelno == logging.WARNING)
        logger.addHandler(handler)
