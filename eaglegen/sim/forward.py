"""One forward pass as SGLang's event loop picks it, priced on the engine's clock; what a
retraction costs.

SGLang runs one batch per iteration (sgl-project/sglang, `python/sglang/srt/managers/
scheduler.py`, `get_next_batch_to_run`): a prefill batch whenever `get_new_batch_prefill` forms
one ("Run prefill first if possible"), else one decode step of the running batch
(`update_running_batch`). Without `--enable-mixed-chunk` (off by default) the two never share a
pass, so a prefill pass is time in which no running request gets a token. A pass costs
`StepCosts`: a decode step `decode_step_ms + decode_ms_per_request * batch`, a prefill pass
`prefill_step_ms + tokens / prefill_tokens_per_ms` (the fixed part is what any forward pass pays
whatever its size: weights read, collectives, launches).

The cost of a retraction, as SGLang pays it:

- What is dropped. `ScheduleBatch.retract_decode` (`managers/schedule_batch.py`) takes the
  requests with the fewest output tokens (then the longest prompt) first, one at a time until the
  next decode step fits; `release_req` frees each one's KV without inserting it into the radix
  tree (`release_kv_cache(req, tree_cache, is_insert=False)`), then evicts up to
  `SGLANG_RETRACT_DECODE_STEPS` (20) slots per remaining request from the tree, which usually
  takes the request's own prompt with it (cached by `cache_unfinished_req` after its prefill,
  unlocked by the release). `Req.reset_for_retract` clears its prefix; its `output_ids`
  stay. Decode work is never redone.
- The re-prefill. The request goes to the back of the waiting queue
  (`_add_request_to_queue(req, is_retracted=True)`; its queue clock restarts) and is admitted
  like any other by `PrefillAdder.add_one_req` (`managers/schedule_policy.py`): charged its
  `extend_input_len` plus its remaining `max_new_tokens` clipped at 4096.
  `Req.init_next_round_input` sets `fill_ids = origin_input_ids + output_ids` and matches them
  against the tree, so the pass computes the prompt and the output so far, less what the tree
  still holds, at prefill speed (in chunks past `chunked_prefill_size`).
- The stall. That prefill pass replaces a decode step: the whole running batch waits for it.
  `ForwardPass.reprefill_seconds` is its share of the pass.
- The latency. The request waits in the queue a second time, behind every request that arrived
  before its retraction; its e2e latency (`Job.latency` here; SGLang's
  `e2e_request_latency_seconds`, which `TokenizerManager` takes from the request's creation to
  its finish) spans both waits, both prefills, its decode steps and the other requests'
  prefills that stalled it; `queue_time_seconds` is observed at each admission.
- Admission afterwards. `retract_decode` returns the new-token ratio estimated from the requests
  that stay (`(decoded + 20 * n) / (sum of max_new_tokens + 1)`), and `update_running_batch`
  takes it; it decays again by `(init - min) / 600` per step without retraction
  (`eaglegen.sim.scheduler`). Admission keeps `ratio * min(remaining, 4096)` slots in reserve
  for each running request: at SGLang's floor ratio, a few hundred decode steps of growth, while
  in a full pool requests finish and return their slots far more often than that. So the
  reserve rarely runs out, retractions are rare, and each takes the youngest request, whose
  re-prefill is mostly its prompt (pull request sgl-project/sglang#708, "Auto adjust new
  ratio": "Retract decode is bad", hence the decay and the 20 steps left after a retraction).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglegen.sim.engine import decode_seconds, prefill_seconds
from eaglegen.sim.scheduler import DecodePlan, Job, PrefillBatch, Scheduler


@dataclass(frozen=True)
class StepCosts:
    """What a forward pass costs on the engine's clock."""

    decode_step_ms: float
    decode_ms_per_request: float
    prefill_tokens_per_ms: float
    # Fixed part of a prefill pass; 0 prices a prefill by its tokens alone.
    prefill_step_ms: float = 0.0

    def prefill(self, tokens: int) -> float:
        """Seconds of a prefill pass computing this many tokens."""
        return prefill_seconds(tokens, self.prefill_tokens_per_ms, self.prefill_step_ms)

    def decode(self, batch: int) -> float:
        """Seconds of a decode step of this many requests."""
        return decode_seconds(batch, self.decode_step_ms, self.decode_ms_per_request)


@dataclass(frozen=True)
class ForwardPass:
    """One pass: a prefill batch, or a decode step (maybe after retractions), or nothing."""

    seconds: float = 0.0
    prefill: PrefillBatch | None = None
    decode: DecodePlan | None = None

    @property
    def retracted(self) -> tuple[Job, ...]:
        """The jobs retracted to make room for this decode step."""
        return () if self.decode is None else self.decode.retracted

    @property
    def decoded(self) -> int:
        """Requests that get a token from this decode step."""
        return 0 if self.decode is None else self.decode.batch

    @property
    def reprefill_seconds(self) -> float:
        """The share of a prefill pass spent on work retracted jobs had done once already."""
        batch = self.prefill
        if batch is None or not batch.extend_tokens:
            return 0.0
        return self.seconds * batch.reprefill_tokens / batch.extend_tokens


def begin_pass(scheduler: Scheduler, costs: StepCosts) -> ForwardPass:
    """get_next_batch_to_run: a prefill batch if one forms, else the decode step (retracting if
    the pool is short); its cost. Nothing is produced until `end_pass`."""
    batch = scheduler.admit()
    if batch is not None:
        return ForwardPass(costs.prefill(batch.extend_tokens), prefill=batch)
    plan = scheduler.prepare_decode()
    seconds = costs.decode(plan.batch) if plan.batch else 0.0
    return ForwardPass(seconds, decode=plan)


def end_pass(scheduler: Scheduler, forward: ForwardPass) -> list[Job]:
    """The pass ran: its tokens are out; returns the jobs it finished."""
    if forward.prefill is not None:
        return scheduler.finish_prefill(forward.prefill)
    if forward.decoded:
        return scheduler.decode_step()
    return []


@dataclass
class EngineTime:
    """The engine's clock, split by what the passes did."""

    total: float = 0.0
    prefill: float = 0.0
    reprefill: float = 0.0
    passes: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    def add(self, forward: ForwardPass) -> None:
        """Count one pass."""
        self.total += forward.seconds
        if forward.prefill is not None:
            self.prefill += forward.seconds
            self.reprefill += forward.reprefill_seconds
            self.passes["prefill"] += 1
        elif forward.decoded:
            self.passes["decode"] += 1
