"""The queries of `eaglegen plan`: what a run's requests look like to a server's KV pool.

Counters and budgets come from `status` (models.status); this adds, per dataset, its
``max_new_tokens``, the (prompt, completion) lengths of a sample of its done generations, and
the mean prompt of a sample of the jobs it still has to run. Each sample is at most
SAMPLE_JOBS rows read through the jobs' (state, dataset) index, so a plan costs the same on a
run of a million jobs as on a thousand. A sample is not biased by the order it is read in:
the feeder publishes a dataset's jobs in a seeded random order (models.order), so its done
jobs are a uniform draw of its file whichever of them the index returns first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Select, func, select, true

from models.schema import Dataset, Generation, Job, Run
from models.states import JobState

# Enough rows for the mean KV footprint to be known to about a percent (its spread is that
# of the completion lengths), few enough to read in well under a second.
SAMPLE_JOBS = 5000
_PENDING = (JobState.QUEUED.value, JobState.RUNNING.value)


class AmbiguousRunError(ValueError):
    """No run was named and the database holds none or several."""


@dataclass(frozen=True)
class DatasetLengths:
    """What one dataset's requests are like, from its own rows."""

    dataset: str
    max_new_tokens: int
    # (prompt_tokens, completion_tokens) of up to SAMPLE_JOBS done generations.
    done: tuple[tuple[int, int], ...]
    # Mean prompt of up to SAMPLE_JOBS queued or running jobs; None when it has none.
    pending_prompt: float | None


class PlanQueries:
    """Mixin of the Repository: the lengths of a run's requests, per dataset."""

    engine: Engine

    def plan_run(self, run: str | None) -> str | None:
        """The run's name if it exists (None if not); with ``run`` None, the only run there
        is (AmbiguousRunError when there is none or several)."""
        with self.engine.connect() as conn:
            if run is not None:
                return conn.scalar(select(Run.name).where(Run.name == run))
            names = list(conn.scalars(select(Run.name).order_by(Run.name).limit(11)))
        if len(names) == 1:
            return names[0]
        if not names:
            raise AmbiguousRunError("the database holds no run yet: `eaglegen enqueue` makes one")
        listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise AmbiguousRunError(f"the database holds several runs: name one ({listed})")

    def plan_lengths(self, run: str) -> list[DatasetLengths]:
        """Every dataset of ``run`` with its sampled lengths, by name."""
        with self.engine.connect() as conn:
            datasets = conn.execute(_datasets(run)).all()
            done: dict[int, list[tuple[int, int]]] = {int(d.id): [] for d in datasets}
            for row in conn.execute(_done_sample(run)):
                done[int(row.id)].append((int(row.prompt_tokens), int(row.completion_tokens)))
            pending = {int(r.id): r.mean for r in conn.execute(_pending_sample(run))}
        return [_lengths(d, done[int(d.id)], pending.get(int(d.id))) for d in datasets]


def _datasets(run: str) -> Select[Any]:
    return (
        select(
            Dataset.id,
            Dataset.name,
            Dataset.sampling_params["max_new_tokens"].as_integer().label("max_new"),
        )
        .join(Run, Run.id == Dataset.run_id)
        .where(Run.name == run)
        .order_by(Dataset.name)
    )


def _of_run(run: str) -> Select[Any]:
    return select(Dataset.id).join(Run, Run.id == Dataset.run_id).where(Run.name == run)


def _done_sample(run: str) -> Select[Any]:
    """Up to SAMPLE_JOBS done generations' lengths per dataset of the run."""
    datasets = _of_run(run).subquery()
    sample = (
        select(Generation.prompt_tokens, Generation.completion_tokens)
        .join(Job, Job.id == Generation.job_id)
        .where(Job.state == JobState.DONE.value, Job.dataset_id == datasets.c.id)
        .limit(SAMPLE_JOBS)
        .lateral()
    )
    return select(datasets.c.id, sample.c.prompt_tokens, sample.c.completion_tokens).join(
        sample, true()
    )


def _pending_sample(run: str) -> Select[Any]:
    """The mean prompt of up to SAMPLE_JOBS jobs still to run, per dataset of the run."""
    datasets = _of_run(run).subquery()
    sample = (
        select(Job.prompt_tokens)
        .where(Job.state.in_(_PENDING), Job.dataset_id == datasets.c.id)
        .limit(SAMPLE_JOBS)
        .lateral()
    )
    return (
        select(datasets.c.id, func.avg(sample.c.prompt_tokens).label("mean"))
        .join(sample, true())
        .group_by(datasets.c.id)
    )


def _lengths(row: Any, done: list[tuple[int, int]], pending: Any) -> DatasetLengths:
    return DatasetLengths(
        dataset=row.name,
        # Every dataset's params are complete (core.sampling), so max_new_tokens is set.
        max_new_tokens=int(row.max_new or 0),
        done=tuple(done),
        pending_prompt=None if pending is None else float(pending),
    )
