"""Prometheus text exposition with SGLang's metric names and labels.

Names, help texts and the queue-time buckets are those of SGLang's `metrics/collector.py`
(`SchedulerMetricsCollector`: the scheduler gauges, `num_retracted_reqs`, the
`num_retracted_{requests,input_tokens,output_tokens}_total` counters, `new_token_ratio`,
`queue_time_seconds`; `TokenizerMetricsCollector`: the token and request counters and
`e2e_request_latency_seconds`). Every value is read from the scheduler's counters when
/metrics is scraped: nothing is recomputed over the requests, so a scrape costs the same
whatever the load.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# SGLang's default buckets for sglang:e2e_request_latency_seconds.
E2E_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
)  # fmt: skip
# SGLang's buckets for sglang:queue_time_seconds.
QUEUE_TIME_BUCKETS: tuple[float, ...] = (
    0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    70.0, 80.0, 90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0,
    1200.0, 1400.0, 1600.0, 1800.0, 2000.0, 2500.0, 3000.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    """A cumulative Prometheus histogram."""

    buckets: tuple[float, ...] = E2E_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        """One counter per bucket plus +Inf."""
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass(frozen=True)
class Snapshot:
    """Everything /metrics reports, read from the scheduler at one moment."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    max_total_num_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens_total: int
    num_requests_total: int
    num_retracted_reqs: int = 0
    num_retracted_requests_total: int = 0
    num_retracted_input_tokens_total: int = 0
    num_retracted_output_tokens_total: int = 0
    new_token_ratio: float = 0.0


_GAUGES = (
    ("num_running_reqs", "The number of running requests."),
    ("num_used_tokens", "The number of used tokens."),
    ("token_usage", "The token usage."),
    ("gen_throughput", "The generation throughput (token/s)."),
    ("num_queue_reqs", "The number of requests in the waiting queue."),
    ("cache_hit_rate", "The prefix cache hit rate."),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("num_retracted_reqs", "The number of retracted requests."),
    ("new_token_ratio", "The new token ratio."),
)
_SCHEDULER_COUNTERS = (
    ("num_retracted_requests_total", "Total number of retracted requests."),
    ("num_retracted_input_tokens_total", "Total number of retracted input tokens."),
    ("num_retracted_output_tokens_total", "Total number of retracted output tokens."),
)
_COUNTERS = (
    ("prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens_total", "Number of generation tokens processed."),
    ("cached_tokens_total", "Number of cached prompt tokens."),
    ("num_requests_total", "Number of requests processed."),
)


def render(
    snapshot: Snapshot, e2e: Histogram, model_name: str, queue_time: Histogram | None = None
) -> str:
    """The /metrics body: scheduler gauges and counters, tokenizer counters, the e2e latency
    and queue time histograms."""
    name = _escape(model_name)
    scheduler_labels = f'engine_type="unified",model_name="{name}",tp_rank="0"'
    tokenizer_labels = f'model_name="{name}"'
    lines: list[str] = []
    for key, doc in _GAUGES:
        _sample(lines, key, doc, "gauge", scheduler_labels, getattr(snapshot, key))
    for key, doc in _SCHEDULER_COUNTERS:
        _sample(lines, key, doc, "counter", scheduler_labels, getattr(snapshot, key))
    for key, doc in _COUNTERS:
        _sample(lines, key, doc, "counter", tokenizer_labels, getattr(snapshot, key))
    _histogram(lines, e2e, tokenizer_labels, _E2E)
    if queue_time is not None:
        _histogram(lines, queue_time, scheduler_labels, _QUEUE_TIME)
    return "\n".join(lines) + "\n"


def _sample(lines: list[str], key: str, doc: str, kind: str, labels: str, value: float) -> None:
    """One single-sample metric family."""
    metric = f"sglang:{key}"
    lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} {kind}"]
    lines.append(f"{metric}{{{labels}}} {_number(value)}")


_E2E = ("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds")
_QUEUE_TIME = ("sglang:queue_time_seconds", "Histogram of queueing time in seconds.")


def _histogram(lines: list[str], hist: Histogram, labels: str, name: tuple[str, str]) -> None:
    """One histogram in cumulative-bucket form."""
    metric, doc = name
    lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} histogram"]
    cumulative = 0
    for bound, count in zip((*hist.buckets, math.inf), hist.counts, strict=True):
        cumulative += count
        lines.append(f'{metric}_bucket{{{labels},le="{_number(bound)}"}} {_number(cumulative)}')
    lines.append(f"{metric}_count{{{labels}}} {_number(hist.count)}")
    lines.append(f"{metric}_sum{{{labels}}} {_number(hist.total)}")


def _number(value: float) -> str:
    """Format a sample value the way prometheus_client does (always a float)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    """Escape a label value."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, for tests and quick checks of any /metrics body."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
