"""The figures of `eaglegen status` as Prometheus metrics, read from Postgres per scrape.

One `eaglegen metrics` serves them for the whole cluster: per-dataset gauges summed over
workers would count each worker's view once. Workers serve their own request metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from eaglegen.report.status import status_document
from models.snapshot import StatusSnapshot

_DATASET = ["run", "dataset"]


class StatusCollector(Collector):
    """Collects one status snapshot per scrape (``snapshot()`` reads Postgres)."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """The metric families of one snapshot."""
        document = status_document(self._snapshot(), None)
        yield from _dataset_metrics(document["datasets"])
        yield from _run_metrics(document["runs"])
        yield from _server_metrics(document["servers"])


def _dataset_metrics(datasets: list[dict[str, Any]]) -> Iterator[Metric]:
    jobs = GaugeMetricFamily(
        "eaglegen_dataset_jobs", "Jobs of a dataset by state", labels=[*_DATASET, "state"]
    )
    prompt = CounterMetricFamily(
        "eaglegen_dataset_prompt_tokens", "Prompt tokens of done jobs", labels=_DATASET
    )
    completion = CounterMetricFamily(
        "eaglegen_dataset_completion_tokens", "Completion tokens of done jobs", labels=_DATASET
    )
    budget = GaugeMetricFamily(
        "eaglegen_dataset_budget_tokens",
        "Token budget and its ledger (kind: budget, used, reserved, left); no budget: none",
        labels=[*_DATASET, "kind"],
    )
    rate = GaugeMetricFamily(
        "eaglegen_dataset_completion_tokens_per_second",
        "Completion tokens a second over a window",
        labels=[*_DATASET, "window"],
    )
    eta = GaugeMetricFamily(
        "eaglegen_dataset_eta_seconds", "Seconds until the dataset is finished", labels=_DATASET
    )
    for d in datasets:
        key = [d["run"], d["dataset"]]
        for state, n in d["jobs"].items():
            if state != "total":
                jobs.add_metric([*key, state], n)
        prompt.add_metric(key, d["prompt_tokens"])
        completion.add_metric(key, d["completion_tokens"])
        if d["budget"]["tokens"] is not None:
            for kind in ("tokens", "used", "reserved", "left"):
                budget.add_metric([*key, "budget" if kind == "tokens" else kind], d["budget"][kind])
        for window, figures in d["rates"].items():
            rate.add_metric([*key, window], figures["completion_tok_s"])
        if d["eta_s"] is not None:
            eta.add_metric(key, d["eta_s"])
    yield from (jobs, prompt, completion, budget, rate, eta)


def _run_metrics(runs: list[dict[str, Any]]) -> Iterator[Metric]:
    eta = GaugeMetricFamily(
        "eaglegen_run_eta_seconds", "Seconds until every dataset of the run is finished",
        labels=["run"],
    )  # fmt: skip
    for run in runs:
        if run["eta_s"] is not None:
            eta.add_metric([run["run"]], run["eta_s"])
    yield eta


def _server_metrics(servers: list[dict[str, Any]]) -> Iterator[Metric]:
    rate = GaugeMetricFamily(
        "eaglegen_server_completion_tokens_per_second",
        "Completion tokens a second recorded from a server over the last minute",
        labels=["server"],
    )
    errors = GaugeMetricFamily(
        "eaglegen_server_failed_attempts",
        "Failed attempts on a server by class over the last 10 minutes",
        labels=["server", "kind"],
    )
    for server in servers:
        rate.add_metric([server["name"]], server["completion_tok_s_1m"])
        for kind, n in server["errors"].items():
            errors.add_metric([server["name"], kind], n)
    yield from (rate, errors)
