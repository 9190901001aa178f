"""What `eaglegen status` reads, as plain values: the snapshot and its parts, and a
dataset's counts. Apart from models.records, whose other records status never needs:
a dataclass costs its creation at import, and status runs often."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class DatasetCounts:
    """Jobs by state and token totals of one dataset."""

    run: str
    dataset: str
    states: dict[str, int]
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        """All jobs of the dataset, whatever their state."""
        return sum(self.states.values())


@dataclass(frozen=True)
class Window:
    """What was recorded within the last ``seconds``.

    ``covered_s``: the part of the window the work in it spans, from the start of its
    earliest generation (recorded minus its e2e latency) to now, at most ``seconds``; less
    in a run's first minutes or after a pause. None when the window holds no generation.
    """

    seconds: int
    completions: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    covered_s: float | None = None


@dataclass(frozen=True)
class DatasetStatus:
    """A dataset's counters, ledger and recent windows, as `eaglegen status` reads them."""

    run: str
    dataset: str
    states: dict[str, int]
    done_prompt_tokens: int
    done_completion_tokens: int
    budget_tokens: int | None
    budget_basis: str
    used_tokens: int
    reserved_tokens: int
    first_done_at: datetime | None
    last_done_at: datetime | None
    windows: tuple[Window, ...]
    # Its reserve policy, and the completion tokens its next claim reserves under it.
    reserve: str = "worst_case"
    reserve_tokens: int | None = None
    # What of a multi-turn row it answers (datasets.turns); its conversations by state, the
    # ended ones by reason ("ended: REASON"); and the turns its conversations under way
    # have still to come (jobs not created yet: each once the turn before it is done).
    turns: str = "last"
    conversations: dict[str, int] = field(default_factory=dict)
    turns_to_come: int = 0
    # Generations asked of each prompt, and its variants' names and weights (core.samples).
    samples: int = 1
    variants: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> int:
        """All jobs of the dataset, whatever their state."""
        return sum(self.states.values())


@dataclass(frozen=True)
class ServerStatus:
    """One server's recent windows and failed attempts by class (over the longest window)."""

    name: str
    windows: tuple[Window, ...]
    errors: dict[str, int]


@dataclass(frozen=True)
class StatusSnapshot:
    """Every figure of one `eaglegen status`, as of ``now`` (Postgres's clock)."""

    now: datetime
    windows_s: tuple[int, ...]
    datasets: list[DatasetStatus]
    servers: list[ServerStatus]
    # Failed attempts no server is to blame for (a lapsed lease), by class.
    unattributed_errors: dict[str, int]
    # Each run's publishing order seed (models.order).
    order_seeds: dict[str, int] = field(default_factory=dict)
    # Each run's model family (core.families); None: not recorded (a run before 0010).
    families: dict[str, str | None] = field(default_factory=dict)
    # Queued jobs (of the datasets shown) that have a message out: the window's Postgres side.
    published: int = 0
