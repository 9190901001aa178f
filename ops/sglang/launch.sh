#!/usr/bin/env bash
# SGLang for eaglegen's data generation: one TP-8 server of a Kimi-K2.5-class model on an
# 8-GPU host with two NUMA nodes. Why each flag: ops/sglang/README.md.
#
#   MODEL_PATH=/models/Kimi-K2.5 ops/sglang/launch.sh           # then: eaglegen doctor
#
# Everything is an environment variable with the real run's value as the default.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to the checkpoint (a Hub id or a folder)}
SGLANG_HOST=${SGLANG_HOST:-0.0.0.0}
SGLANG_PORT=${SGLANG_PORT:-30000}
TP=${TP:-8}
# 0.88 left room for activations and CUDA graphs; 0.93 ran out of memory.
MEM_FRACTION_STATIC=${MEM_FRACTION_STATIC:-0.88}
# Host RAM per rank (GB) that the hierarchical cache spills KV entries to.
HICACHE_SIZE=${HICACHE_SIZE:-48}
MAX_RUNNING_REQUESTS=${MAX_RUNNING_REQUESTS:-}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-}

args=(
  --model-path "$MODEL_PATH"
  --host "$SGLANG_HOST" --port "$SGLANG_PORT"
  --tp "$TP"
  --trust-remote-code
  --mem-fraction-static "$MEM_FRACTION_STATIC"
  # bf16 KV: fp8 would fit twice the tokens but changes what the model generates, and the
  # drafter must learn the model served in production.
  --kv-cache-dtype auto
  --enable-hierarchical-cache --hicache-size "$HICACHE_SIZE"
  # /metrics: eaglegen doctor checks it, the concurrency controller reads it.
  --enable-metrics
  # Each streamed chunk carries only its new ids (SGLang's default repeats all so far): a
  # worker then streams by default, so a request that stops making progress fails after
  # EAGLEGEN_STALL_TIMEOUT_S instead of the hour-long request timeout. A chunk every 16
  # tokens keeps the per-chunk cost small.
  --incremental-streaming-output --stream-interval "${STREAM_INTERVAL:-16}"
  # No --reasoning-parser and no --tool-call-parser: they strip the think and tool-call
  # tokens from output_ids, and the training data must be the exact tokens.
)
[[ -n "$MAX_RUNNING_REQUESTS" ]] && args+=(--max-running-requests "$MAX_RUNNING_REQUESTS")
[[ -n "$CONTEXT_LENGTH" ]] && args+=(--context-length "$CONTEXT_LENGTH")

exec python3 -m sglang.launch_server "${args[@]}" "$@"
