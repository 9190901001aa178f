#!/usr/bin/env bash
# Serve the target with the EAGLE-3 drafter trained on eaglegen's data. The algorithm must
# be EAGLE3: with EAGLE (EAGLE-2) SGLang loads an EAGLE-3 checkpoint without complaint and
# accepts almost no draft token. Tune steps/topk/draft tokens on the real traffic.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to the target checkpoint}
DRAFT_PATH=${DRAFT_PATH:?set DRAFT_PATH to the trained EAGLE-3 drafter}

exec python3 -m sglang.launch_server \
  --model-path "$MODEL_PATH" --tp "${TP:-8}" --trust-remote-code \
  --host "${SGLANG_HOST:-0.0.0.0}" --port "${SGLANG_PORT:-30000}" \
  --mem-fraction-static "${MEM_FRACTION_STATIC:-0.85}" \
  --speculative-algorithm EAGLE3 \
  --speculative-draft-model-path "$DRAFT_PATH" \
  --speculative-num-steps "${SPEC_STEPS:-3}" \
  --speculative-eagle-topk "${SPEC_TOPK:-1}" \
  --speculative-num-draft-tokens "${SPEC_DRAFT_TOKENS:-4}" \
  --enable-metrics "$@"
