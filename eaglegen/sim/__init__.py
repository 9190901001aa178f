"""SGLang-compatible simulator: a real HTTP server for the demo, the tests and the benchmarks.

Public API: `SimConfig` (and `FaultConfig`), `create_app(config)`, `serve(config)` (blocking,
for `eaglegen sim`) and `SimServer(config)`, a context manager running the server on a free
loopback port in a background thread, exposing `.url`. `/generate` answers at once or, with
`"stream": true`, as server-sent events while the simulated model decodes; a prompt that declares
tools sometimes gets a tool call. It speaks the tokenizer folder it is given
(`SimConfig.tokenizer_dir`, the bundled one by default): ids below its vocabulary's size, and
the reasoning, tool calls and stop of its model family (`core.families`, `eaglegen.sim.voice`).
Faults (`FaultConfig`) are set at startup or at runtime through `GET/POST /sim/faults`;
`GET /sim/stats` counts what was injected and what the scheduler did. `preset(name,
**overrides)` builds the named configurations (`fast`, the default; `kimi-k2`, the real run's
server; `kv-rich`).
"""

from eaglegen.sim.config import FaultConfig, SimConfig
from eaglegen.sim.presets import PRESETS, preset
from eaglegen.sim.server import SimServer, create_app, serve

__all__ = ["PRESETS", "FaultConfig", "SimConfig", "SimServer", "create_app", "preset", "serve"]
