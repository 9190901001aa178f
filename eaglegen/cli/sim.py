"""`eaglegen sim`: the SGLang-compatible simulator, for the demo, tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from eaglegen.cli.base import command, err

app = typer.Typer()


@command(app)
def sim(
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 = any free port)")] = 30000,
    kv_tokens: Annotated[int, typer.Option(help="KV pool size in tokens")] = 159_000,
    context_length: Annotated[int, typer.Option(help="Model context length")] = 32_768,
    max_running_requests: Annotated[int, typer.Option(help="Running batch cap")] = 1024,
    max_queued_requests: Annotated[
        int | None, typer.Option(help="Waiting-queue cap; beyond it requests get 503")
    ] = None,
    max_prefill_tokens: Annotated[int, typer.Option(help="Prefill tokens per batch")] = 16_384,
    max_output_tokens: Annotated[int, typer.Option(help="Longest natural output")] = 4096,
    model_path: Annotated[str, typer.Option(help="Model name reported")] = "eaglegen/sim-reasoner",
    seed: Annotated[int, typer.Option(help="Default sampling seed")] = 0,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder")] = None,
    decode_step_ms: Annotated[float, typer.Option(help="Decode step base time")] = 4.0,
    decode_ms_per_request: Annotated[float, typer.Option(help="Added per running request")] = 0.15,
    prefill_tokens_per_ms: Annotated[float, typer.Option(help="Prefill speed")] = 50.0,
    mean_output_tokens: Annotated[int, typer.Option(help="Mean natural output length")] = 300,
    stream_interval: Annotated[
        int, typer.Option(help="Tokens between the chunks of a streamed answer")
    ] = 1,
    incremental_streaming_output: Annotated[
        bool,
        typer.Option(
            "--incremental-streaming-output",
            help="Stream only the new text and output_ids in each chunk",
        ),
    ] = False,
    error_rate: Annotated[
        list[str] | None,
        typer.Option(metavar="STATUS=P", help="Answer STATUS with probability P (repeatable)"),
    ] = None,
    added_latency_ms: Annotated[float, typer.Option(help="Extra delay on each /generate")] = 0.0,
    drop_rate: Annotated[float, typer.Option(help="Probability of closing unanswered")] = 0.0,
    malformed_rate: Annotated[float, typer.Option(help="Probability of a non-JSON 200")] = 0.0,
    leak_prompt_tokens: Annotated[
        bool, typer.Option("--leak-prompt-tokens", help="Prepend the prompt to output_ids")
    ] = False,
    stall_rate: Annotated[
        float, typer.Option(help="Probability that a streamed answer goes silent, held open")
    ] = 0.0,
    stall_after_chunks: Annotated[
        int, typer.Option(help="Chunks a stalled stream sends before going silent")
    ] = 1,
    drip_rate: Annotated[
        float, typer.Option(help="Probability that a non-streamed body trickles out")
    ] = 0.0,
    drip_interval_ms: Annotated[float, typer.Option(help="Pause between dripped pieces")] = 50.0,
    drip_bytes: Annotated[int, typer.Option(help="Bytes per dripped piece")] = 16,
    broken_tool_args_rate: Annotated[
        float, typer.Option(help="Probability that a tool call's arguments are not JSON")
    ] = 0.0,
    fault_seed: Annotated[int, typer.Option(help="Seed of the per-request fault draws")] = 0,
) -> None:
    """Run the SGLang-compatible simulator (speaks /generate, /metrics, ...)."""
    from eaglegen.sim import FaultConfig, SimConfig, serve
    from eaglegen.sim.config import parse_error_rate

    faults = FaultConfig(
        error_rates=tuple(parse_error_rate(text) for text in error_rate or ()),
        added_latency_ms=added_latency_ms,
        drop_rate=drop_rate,
        malformed_rate=malformed_rate,
        leak_prompt_tokens=leak_prompt_tokens,
        stall_rate=stall_rate,
        stall_after_chunks=stall_after_chunks,
        drip_rate=drip_rate,
        drip_interval_ms=drip_interval_ms,
        drip_bytes=drip_bytes,
        broken_tool_args_rate=broken_tool_args_rate,
        seed=fault_seed,
    )
    config = SimConfig(
        host=host,
        port=port,
        kv_tokens=kv_tokens,
        context_length=context_length,
        max_running_requests=max_running_requests,
        max_queued_requests=max_queued_requests,
        max_prefill_tokens=max_prefill_tokens,
        max_output_tokens=max_output_tokens,
        model_path=model_path,
        seed=seed,
        tokenizer_dir=tokenizer,
        decode_step_ms=decode_step_ms,
        decode_ms_per_request=decode_ms_per_request,
        prefill_tokens_per_ms=prefill_tokens_per_ms,
        mean_output_tokens=mean_output_tokens,
        stream_interval=stream_interval,
        incremental_streaming_output=incremental_streaming_output,
        faults=faults,
    )
    if faults.any_enabled():
        err.print(f"injecting faults: {json.dumps(faults.to_json())}", highlight=False)
    serve(config, on_ready=lambda url: err.print(f"simulator listening on {url}"))
