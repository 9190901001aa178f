"""Named simulator configurations: the suite's fast server, the real run's server, a KV-rich one.

- `fast` (SimConfig's defaults): quick steps, a prefill priced by its tokens alone, and a ratio
  fixed at 1, so admission reserves the whole remaining output of every running request and
  never has to retract at the suite's loads; what every test and the demo run against.
- `kimi-k2`: the server of the case study (/work/shared/background/case-study.txt): Kimi-K2.5
  on 8 GPUs with bf16 KV, a pool of 159K tokens; prompts near 1K and outputs of 3-4K tokens, so
  about 50 requests fit. SGLang's own admission (ratio from 0.7 down to 0.098, clip at 4096),
  chunked prefill, retraction at the cost SGLang pays for it (`eaglegen.sim.forward`). Step
  costs are set so that the batch the pool holds decodes at the run's throughput
  (BENCHMARKS.md, "Simulator", checks it).
- `kv-rich`: the same model and step costs with four times the pool (fp8 KV or more GPUs):
  the knee moves right.

`time_scale` (or `--time-scale`) shrinks every step alike, so a benchmark of `kimi-k2` runs in
minutes with the same curve.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from eaglegen.sim.config import SimConfig

_SGLANG_ADMISSION: dict[str, Any] = {
    "init_new_token_ratio": 0.7,
    "min_new_token_ratio": 0.7 * 0.14,
    "new_token_ratio_decay_steps": 600,
    "clip_max_new_tokens": 4096,
    "retract_decode_steps": 20,
    "chunked_prefill_size": 8192,
    "max_prefill_tokens": 16_384,
}
# A trillion-parameter MoE on 8 GPUs: a fixed cost per forward pass (weights read, collectives),
# paid by a decode step and a prefill pass alike, plus a cost per request in a decode step
# (expert and attention work) or per token in a prefill, which runs at thousands of tokens/s.
_KIMI_STEPS: dict[str, Any] = {
    "decode_step_ms": 20.0,
    "decode_ms_per_request": 0.6,
    "prefill_step_ms": 20.0,
    "prefill_tokens_per_ms": 8.0,
    "mean_output_tokens": 3000,
    "output_length_sigma": 0.6,
    "max_output_tokens": 16_384,
    "context_length": 262_144,
}

PRESETS: dict[str, dict[str, Any]] = {
    "fast": {},
    "kimi-k2": {**_SGLANG_ADMISSION, **_KIMI_STEPS, "kv_tokens": 159_000},
    "kv-rich": {**_SGLANG_ADMISSION, **_KIMI_STEPS, "kv_tokens": 636_000},
}


def preset(name: str, **overrides: Any) -> SimConfig:
    """The named preset, with any field overridden; ValueError for an unknown name or field."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in fields(SimConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown simulator setting(s): {unknown}")
    return replace(SimConfig(), **{**PRESETS[name], "preset": name, **overrides})
