"""Queries of `eaglegen stats`, `show` and `sample`: a run's figures, computed in Postgres
where SQL can (counts, sums, percentiles, histograms), and the rows the token-level checks
decode, streamed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

from core.tokenizer import stored_stop_ids
from models.schema import stored_prompt
from models.tokens import pack, unpack

# Percentiles every distribution reports, in this order.
PERCENTILES = (0.5, 0.9, 0.99)
# Rows per round trip of the streamed token-level read (see models/export.py).
_YIELD_ROWS = 512

# The done generations of a run, one row each, with what every figure needs. ``empty`` is
# an answer of no ids beyond the stop id: after think-end where the prompt opened
# reasoning, the whole output otherwise; a stop id is in output_ids when the finish matched
# one (the worker refuses a response where it is not the last id).
_IN_SCOPE = """
    SELECT d.name AS dataset, g.job_id, g.completion_tokens AS c, g.prompt_tokens AS p,
           g.cached_tokens AS cached, g.e2e_latency AS latency, g.finish_type AS finish,
           (d.sampling_params ->> 'max_new_tokens')::bigint AS max_new,
           j.opens_reasoning AS opens, g.think_end_present AS think_end,
           g.reasoning_tokens AS reasoning, g.answer_tokens AS answer,
           CASE WHEN j.opens_reasoning AND g.think_end_present
                    THEN g.answer_tokens - stop.n <= 0
                WHEN j.opens_reasoning THEN false
                ELSE g.completion_tokens - stop.n <= 0 END AS empty
    FROM generations g
    JOIN jobs j ON j.id = g.job_id
    JOIN datasets d ON d.id = j.dataset_id
    CROSS JOIN LATERAL (
        SELECT (g.finish_type = 'stop' AND jsonb_typeof(g.finish_matched) = 'number')::int AS n
    ) stop
    WHERE d.run_id = :run AND j.state = 'done' AND d.name = ANY(:names)
"""

_PCT = "percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY {})"

# Conversations (datasets.turns = 'all'): by state and end reason; done turns' completion
# lengths by turn index; and the later turns whose prompt starts with the turn before's
# prompt and output ids exactly (bytea compared in Postgres: nothing is shipped to count).
_CONVERSATION_STATES = """
    SELECT d.name AS dataset, c.state, c.ended_reason, count(*) AS n
    FROM conversations c JOIN datasets d ON d.id = c.dataset_id
    WHERE d.run_id = :run AND d.name = ANY(:names)
    GROUP BY 1, 2, 3
"""
_BY_TURN = """
    SELECT d.name AS dataset, j.turn, count(*) AS n,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY g.completion_tokens) AS p50,
           max(g.completion_tokens) AS top
    FROM generations g JOIN jobs j ON j.id = g.job_id JOIN datasets d ON d.id = j.dataset_id
    WHERE d.run_id = :run AND d.name = ANY(:names) AND j.conversation_id IS NOT NULL
    GROUP BY 1, 2
"""
_LATER_TURNS = """
    FROM jobs j JOIN datasets d ON d.id = j.dataset_id
    JOIN jobs pj ON pj.conversation_id = j.conversation_id AND pj.turn = j.turn - 1
    JOIN generations pg ON pg.job_id = pj.id
    WHERE d.run_id = :run AND d.name = ANY(:names) AND j.turn > 0
"""
_EXTENDS = (
    "substring(j.input_ids FROM 1 FOR length(pj.input_ids) + length(pg.output_ids))"
    " = pj.input_ids || pg.output_ids"
)
_EXTENSION = f"""
    SELECT d.name AS dataset, count(*) AS n, count(*) FILTER (WHERE {_EXTENDS}) AS extends
    {_LATER_TURNS}
    GROUP BY 1
"""
# Later turns that do not extend the turn before, a few per dataset, for where they depart.
_DEPARTING = f"""
    SELECT dataset, ids, prompt, output FROM (
        SELECT d.name AS dataset, j.input_ids AS ids, pj.input_ids AS prompt,
               pg.output_ids AS output,
               row_number() OVER (PARTITION BY d.name ORDER BY j.id) AS k
        {_LATER_TURNS} AND NOT ({_EXTENDS})
    ) AS departing
    WHERE k <= :per_dataset
"""

# One row per dataset and one (dataset NULL, total 1) for all of them together: percentiles
# of the whole run cannot be derived from the datasets' own.
_AGGREGATES = f"""
    WITH g AS ({_IN_SCOPE})
    SELECT dataset, grouping(dataset) AS total, count(*) AS n,
        sum(c) AS c_sum, {_PCT.format("c")} AS c_pct, max(c) AS c_max,
        sum(p) AS p_sum, {_PCT.format("p")} AS p_pct, max(p) AS p_max,
        count(*) FILTER (WHERE finish = 'length') AS length,
        count(*) FILTER (WHERE finish = 'length' AND c >= max_new) AS at_max_new,
        count(*) FILTER (WHERE opens) AS opens,
        count(*) FILTER (WHERE opens AND think_end IS NOT TRUE) AS no_think_end,
        count(*) FILTER (WHERE opens AND think_end IS NOT TRUE AND finish = 'length')
            AS no_think_end_cut,
        sum(reasoning) FILTER (WHERE opens) AS r_sum,
        {_PCT.format("reasoning")} FILTER (WHERE opens) AS r_pct,
        max(reasoning) FILTER (WHERE opens) AS r_max,
        sum(answer) FILTER (WHERE opens) AS a_sum,
        count(*) FILTER (WHERE empty) AS empty,
        sum(cached) AS cached_sum, count(*) FILTER (WHERE cached > 0) AS cache_hits,
        {_PCT.format("latency")} AS l_pct, max(latency) AS l_max, avg(latency) AS l_mean
    FROM g GROUP BY GROUPING SETS ((dataset), ())
"""

_FINISHES = f"""
    WITH g AS ({_IN_SCOPE})
    SELECT dataset, grouping(dataset) AS total, finish, count(*) AS n
    FROM g GROUP BY GROUPING SETS ((dataset, finish), (finish))
"""

# Completion lengths in bins of equal integer width from 0, per dataset and for the run;
# the widths come from the aggregates (one scan knows the maxima, the next bins by them).
_HISTOGRAMS = f"""
    WITH g AS ({_IN_SCOPE})
    SELECT g.dataset, false AS total, g.c / w.width AS bin, count(*) AS n
    FROM g JOIN unnest(CAST(:names AS text[]), CAST(:widths AS bigint[])) AS w(dataset, width)
        ON w.dataset = g.dataset
    GROUP BY 1, 3
    UNION ALL
    SELECT NULL, true, c / :run_width, count(*) FROM g GROUP BY 3
"""

# A seeded sample: the order of a hash of (id, seed) is random-looking, the same on every
# call with the same seed, and needs no state (random() with setseed is not stable across
# parallel plans).
_POINTS = f"""
    WITH g AS ({_IN_SCOPE})
    SELECT dataset, p, c FROM g ORDER BY hashint8extended(job_id, :seed), job_id LIMIT :n
"""


# Datasets of several samples or with variants: per dataset and variant, jobs, done ones,
# completion tokens and their percentiles, truncations and the reasoning share (of the
# completion tokens of jobs whose prompt opened reasoning).
_BY_VARIANT = f"""
    SELECT d.name AS dataset, j.variant, d.samples, count(*) AS jobs, count(g.job_id) AS done,
        sum(g.completion_tokens) AS c_sum, {_PCT.format("g.completion_tokens")} AS c_pct,
        count(*) FILTER (WHERE g.finish_type = 'length') AS truncated,
        sum(g.reasoning_tokens) FILTER (WHERE j.opens_reasoning) AS r_sum,
        sum(g.completion_tokens) FILTER (WHERE j.opens_reasoning) AS r_of
    FROM jobs j JOIN datasets d ON d.id = j.dataset_id
    LEFT JOIN generations g ON g.job_id = j.id AND j.state = 'done'
    WHERE d.run_id = :run AND d.name = ANY(:names)
      AND (d.samples > 1 OR jsonb_array_length(d.variants) > 0)
    GROUP BY d.name, j.variant, d.samples
    ORDER BY d.name, j.variant NULLS FIRST
"""

_STATES = """
    SELECT d.name AS dataset, j.state, count(j.id) AS n
    FROM datasets d LEFT JOIN jobs j ON j.dataset_id = d.id
    WHERE d.run_id = :run AND d.name = ANY(:names)
    GROUP BY d.name, j.state
"""

# A job's declared tools (json null when none). Its messages are json, kept as written, and
# Postgres refuses a document once it must unescape a string holding \u0000 (a decoded
# answer may hold NUL): such a document is read with that escape replaced, which changes no
# key and no tool. A sample that stores no prompt reads its holder's.
_MESSAGES = stored_prompt("messages", "j")
_TOOLS = (
    f"(CASE WHEN strpos({_MESSAGES}::text, '\\u0000') = 0 THEN {_MESSAGES}"
    f" ELSE replace({_MESSAGES}::text, '\\u0000', '\\ufffd')::json END) -> 'tools'"
)

# The rows whose ids hold a tool-call marker, for the token-level checks; a marker's 4
# bytes may also match across two ids, which dissecting the row rules out. ``tools`` is
# the json the row's template received (null when it declared none).
_TOOL_ROWS = f"""
    SELECT d.name AS dataset, g.job_id, g.output_ids AS output, j.opens_reasoning AS opens,
           g.finish_type AS finish, {_TOOLS} AS tools
    FROM generations g
    JOIN jobs j ON j.id = g.job_id
    JOIN datasets d ON d.id = j.dataset_id
    WHERE d.run_id = :run AND j.state = 'done' AND d.name = ANY(:names)
      AND EXISTS (SELECT 1 FROM unnest(CAST(:patterns AS bytea[])) m
                  WHERE position(m IN g.output_ids) > 0)
      {{sample}}
    ORDER BY g.job_id
"""
_IN_SAMPLE = "AND g.job_id IN (SELECT job_id FROM sampled)"
_SAMPLED = """
    sampled AS (
        SELECT g.job_id FROM generations g
        JOIN jobs j ON j.id = g.job_id JOIN datasets d ON d.id = j.dataset_id
        WHERE d.run_id = :run AND j.state = 'done' AND d.name = ANY(:names)
        ORDER BY hashint8extended(g.job_id, :seed), g.job_id LIMIT :n
    )
"""

# Generations the token-level checks looked at, per dataset, and those of them whose row
# declared tools.
_TOOL_SCOPE = f"""
    SELECT d.name AS dataset, count(*) AS n,
           count(*) FILTER (WHERE json_typeof({_TOOLS}) = 'array') AS declared
    FROM generations g
    JOIN jobs j ON j.id = g.job_id
    JOIN datasets d ON d.id = j.dataset_id
    WHERE d.run_id = :run AND j.state = 'done' AND d.name = ANY(:names) {{sample}}
    GROUP BY d.name
"""

_DETAIL = f"""
    SELECT j.id AS job_id, r.name AS run, d.name AS dataset, j.row_index, j.state,
           {stored_prompt("input_ids", "j")} AS input_ids, j.opens_reasoning AS opens,
           {_TOOLS} AS tools,
           d.sampling_params, g.output_ids, g.finish_type, g.finish_matched,
           g.completion_tokens, g.prompt_tokens, g.cached_tokens, g.e2e_latency, g.server,
           g.think_end_present, g.reasoning_tokens, g.answer_tokens,
           j.conversation_id, j.turn, j.sample, j.variant, j.sampling_seed
    FROM jobs j
    JOIN datasets d ON d.id = j.dataset_id
    JOIN runs r ON r.id = d.run_id
    LEFT JOIN generations g ON g.job_id = j.id
    WHERE j.id = :job
"""

# What `sample --where` picks: a cut at max_new_tokens, a reasoning block never closed, a
# tool-call marker in the ids.
WHERE = {
    "truncated": "g.finish_type = 'length'",
    "no-think-end": "j.opens_reasoning AND g.think_end_present IS NOT TRUE",
    "tool-calls": (
        "EXISTS (SELECT 1 FROM unnest(CAST(:patterns AS bytea[])) m"
        " WHERE position(m IN g.output_ids) > 0)"
    ),
}
_SAMPLE_IDS = """
    SELECT g.job_id FROM generations g
    JOIN jobs j ON j.id = g.job_id JOIN datasets d ON d.id = j.dataset_id
    WHERE d.run_id = :run AND d.name = :dataset AND j.state = 'done' {where}
    ORDER BY hashint8extended(g.job_id, :seed), g.job_id LIMIT :n
"""


@dataclass(frozen=True)
class StatsDataset:
    """A dataset of the run and the sampling params its jobs were sent with."""

    name: str
    sampling_params: dict[str, Any]

    @property
    def max_new_tokens(self) -> int | None:
        """The cut of its generations, when its params name one."""
        value = self.sampling_params.get("max_new_tokens")
        return value if type(value) is int else None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end its generations (``core.tokenizer.stored_stop_ids``)."""
        return stored_stop_ids(self.sampling_params)


@dataclass(frozen=True)
class StatsRun:
    """What the report needs of the run itself."""

    id: int
    name: str
    tokenizer_path: str
    think_end_id: int | None
    vocab_size: int | None
    datasets: tuple[StatsDataset, ...]
    # Its model family (core.families); None: not recorded, detected from the tokenizer.
    family: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """A distribution's p50, p90, p99 and maximum (None without values)."""

    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class Aggregate:
    """The SQL figures of one dataset (``dataset`` None: of the whole selection)."""

    dataset: str | None
    generations: int
    completion_sum: int
    completion: Spread
    prompt_sum: int
    prompt: Spread
    length: int  # finished by length
    at_max_new: int  # of those, at the dataset's max_new_tokens
    opens_reasoning: int
    no_think_end: int
    no_think_end_cut: int  # of those, finished by length
    reasoning_sum: int
    reasoning: Spread
    answer_sum: int
    empty_answers: int
    cached_sum: int
    cache_hits: int  # generations with any cached prompt token
    latency: Spread
    latency_mean: float | None


@dataclass(frozen=True)
class Histogram:
    """Counts of completion lengths in bins ``[i * width, (i + 1) * width)``."""

    width: int
    counts: dict[int, int]


@dataclass(frozen=True)
class ToolRow:
    """A generation holding a tool-call marker, as the token-level checks read it."""

    dataset: str
    job_id: int
    output_ids: list[int]
    opens_reasoning: bool
    finish_type: str
    tools: Any  # the declared tools as the template received them, None when none


@dataclass(frozen=True)
class TurnLengths:
    """A dataset's done turns at one turn index: how many, their median and longest
    completion."""

    turn: int
    n: int
    p50: float
    top: int


@dataclass
class ConversationFigures:
    """A dataset's conversations: by state ("ended: REASON" for ended ones), completion
    lengths by turn index, and the later turns that extend the turn before exactly (the
    others: where they depart, ``core.onpolicy.departure``'s part, in a sample)."""

    dataset: str
    states: dict[str, int] = field(default_factory=dict)
    by_turn: list[TurnLengths] = field(default_factory=list)
    later_turns: int = 0
    extending: int = 0
    departing: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class VariantFigures:
    """A dataset's jobs of one variant (None: the dataset's own sampling), in a dataset of
    several samples or with variants."""

    dataset: str
    variant: str | None
    samples: int  # the dataset's samples per prompt
    jobs: int
    done: int
    completion_tokens: int
    completion_pct: tuple[float | None, ...]  # PERCENTILES of the done ones
    truncated: int
    reasoning_tokens: int | None  # of the done jobs whose prompt opened reasoning
    reasoning_of: int | None  # their completion tokens

    @property
    def reasoning_share(self) -> float | None:
        """Reasoning tokens over the completion tokens of jobs that opened reasoning."""
        if not self.reasoning_of or self.reasoning_tokens is None:
            return None
        return self.reasoning_tokens / self.reasoning_of


@dataclass(frozen=True)
class Detail:
    """One job with its generation (``output_ids`` None when it has none), for `show`."""

    job_id: int
    run: str
    dataset: str
    row_index: int
    state: str
    input_ids: list[int]
    opens_reasoning: bool
    tools: Any
    stop_token_ids: tuple[int, ...]
    output_ids: list[int] | None
    finish_type: str | None
    finish_matched: Any
    completion_tokens: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    e2e_latency: float | None
    server: str | None
    think_end_present: bool | None
    # Its conversation and turn (``turns = "all"``); None for a job of its own.
    conversation_id: int | None = None
    turn: int | None = None
    # Its prompt's sample, its variant and the seed it is sent with (core.samples).
    sample: int = 0
    variant: str | None = None
    sampling_seed: int | None = None


class StatsQueries:
    """The reads of the data-quality report and of the sample views."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run_names(self) -> list[str]:
        """Every run's name, in name order."""
        with self.engine.connect() as conn:
            return [str(n) for n in conn.scalars(text("SELECT name FROM runs ORDER BY name"))]

    def stats_run(self, name: str) -> StatsRun | None:
        """The run named ``name`` with its datasets, or None."""
        with self.engine.connect() as conn:
            run = (
                conn.execute(
                    text(
                        "SELECT id, name, tokenizer_path, think_end_id, vocab_size, family,"
                        " chat_template_kwargs FROM runs WHERE name = :name"
                    ),
                    {"name": name},
                )
                .mappings()
                .one_or_none()
            )
            if run is None:
                return None
            rows = conn.execute(
                text(
                    "SELECT name, sampling_params FROM datasets WHERE run_id = :run ORDER BY name"
                ),
                {"run": run["id"]},
            )
            found = tuple(StatsDataset(str(d.name), dict(d.sampling_params or {})) for d in rows)
        return StatsRun(
            id=int(run["id"]),
            name=str(run["name"]),
            tokenizer_path=str(run["tokenizer_path"]),
            think_end_id=run["think_end_id"],
            vocab_size=run["vocab_size"],
            datasets=found,
            family=run["family"],
            chat_template_kwargs=dict(run["chat_template_kwargs"] or {}),
        )

    def job_states(self, run_id: int, names: Sequence[str]) -> dict[str, dict[str, int]]:
        """Jobs by state per dataset (each named dataset, {} when it has no job)."""
        out: dict[str, dict[str, int]] = {name: {} for name in names}
        with self.engine.connect() as conn:
            for row in conn.execute(text(_STATES), {"run": run_id, "names": list(names)}):
                if row.state is not None:
                    out[str(row.dataset)][str(row.state)] = int(row.n)
        return out

    def aggregates(self, run_id: int, names: Sequence[str]) -> list[Aggregate]:
        """The SQL figures per dataset that has generations, then one of them all (always)."""
        params = {"run": run_id, "names": list(names)}
        with self.engine.connect() as conn:
            rows = conn.execute(text(_AGGREGATES), params).mappings().all()
        return sorted(
            (_aggregate(r) for r in rows), key=lambda a: (a.dataset is None, a.dataset or "")
        )

    def finishes(self, run_id: int, names: Sequence[str]) -> dict[str | None, dict[str, int]]:
        """Generations by finish type per dataset, and under None for them all."""
        out: dict[str | None, dict[str, int]] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(text(_FINISHES), {"run": run_id, "names": list(names)}):
                key = None if row.total else str(row.dataset)
                out.setdefault(key, {})[str(row.finish)] = int(row.n)
        return out

    def histograms(
        self, run_id: int, widths: dict[str, int], run_width: int
    ) -> dict[str | None, Histogram]:
        """Completion-length histograms with each dataset's bin width, and the run's."""
        names = list(widths)
        params = {
            "run": run_id,
            "names": names,
            "widths": [widths[n] for n in names],
            "run_width": run_width,
        }
        counts: dict[str | None, dict[int, int]] = {name: {} for name in names}
        counts[None] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(text(_HISTOGRAMS), params):
                key = None if row.total else str(row.dataset)
                counts[key][int(row.bin)] = int(row.n)
        return {
            key: Histogram(run_width if key is None else widths[key], bins)
            for key, bins in counts.items()
        }

    def points(
        self, run_id: int, names: Sequence[str], n: int, seed: int
    ) -> list[tuple[str, int, int]]:
        """(dataset, prompt tokens, completion tokens) of a seeded sample of ``n``."""
        params = {"run": run_id, "names": list(names), "n": n, "seed": seed}
        with self.engine.connect() as conn:
            rows = conn.execute(text(_POINTS), params)
            return [(str(r.dataset), int(r.p), int(r.c)) for r in rows]

    def tool_scope(
        self, run_id: int, names: Sequence[str], sample: int | None, seed: int
    ) -> dict[str, tuple[int, int]]:
        """Per dataset: (generations the token-level checks cover, those declaring tools)."""
        sql, params = _with_sample(_TOOL_SCOPE, run_id, names, sample, seed)
        with self.engine.connect() as conn:
            return {
                str(r.dataset): (int(r.n), int(r.declared)) for r in conn.execute(text(sql), params)
            }

    @contextmanager
    def tool_rows(
        self,
        run_id: int,
        names: Sequence[str],
        markers: Sequence[int],
        sample: int | None,
        seed: int,
    ) -> Iterator[Iterator[ToolRow]]:
        """Stream the generations (of the seeded sample of ``sample``, when given) whose
        ids hold one of ``markers``, through a server-side cursor: memory stays constant."""
        sql, params = _with_sample(_TOOL_ROWS, run_id, names, sample, seed)
        params["patterns"] = [pack([m]) for m in markers]
        with self.engine.connect() as conn:
            result = conn.execute(
                text(sql),
                params,
                execution_options={"stream_results": True, "yield_per": _YIELD_ROWS},
            )
            try:
                yield (_tool_row(r) for r in result)
            finally:
                result.close()

    def conversations(
        self, run_id: int, names: Sequence[str], sample: int = 50
    ) -> dict[str, ConversationFigures]:
        """Per dataset with conversations, their figures (``sample``: departing turns read
        per dataset)."""
        params = {"run": run_id, "names": list(names), "per_dataset": sample}
        out: dict[str, ConversationFigures] = {}

        def of(name: str) -> ConversationFigures:
            return out.setdefault(name, ConversationFigures(name))

        with self.engine.connect() as conn:
            for r in conn.execute(text(_CONVERSATION_STATES), params):
                key = r.state if r.ended_reason is None else f"ended: {r.ended_reason}"
                of(r.dataset).states[key] = int(r.n)
            for r in conn.execute(text(_BY_TURN), params):
                of(r.dataset).by_turn.append(TurnLengths(int(r.turn), int(r.n), r.p50, r.top))
            for r in conn.execute(text(_EXTENSION), params):
                figures = of(r.dataset)
                figures.later_turns, figures.extending = int(r.n), int(r.extends)
            for r in conn.execute(text(_DEPARTING), params):
                of(r.dataset).departing.append((unpack(r.ids), unpack(r.prompt), unpack(r.output)))
        for figures in out.values():
            figures.by_turn.sort(key=lambda t: t.turn)
        return out

    def by_variant(self, run_id: int, names: Sequence[str]) -> list[VariantFigures]:
        """Per dataset of several samples or with variants, its figures by variant."""
        params = {"run": run_id, "names": list(names)}
        with self.engine.connect() as conn:
            return [
                VariantFigures(
                    str(r.dataset),
                    r.variant,
                    int(r.samples),
                    int(r.jobs),
                    int(r.done),
                    int(r.c_sum or 0),
                    tuple(r.c_pct or (None,) * len(PERCENTILES)),
                    int(r.truncated),
                    None if r.r_sum is None else int(r.r_sum),
                    None if r.r_of is None else int(r.r_of),
                )
                for r in conn.execute(text(_BY_VARIANT), params)
            ]

    def conversation_job_ids(self, job_id: int) -> list[int]:
        """The jobs of ``job_id``'s conversation in turn order (just it, when it has none)."""
        with self.engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT j.id FROM jobs j JOIN jobs me ON me.conversation_id = j.conversation_id"
                    " WHERE me.id = :job ORDER BY j.turn"
                ),
                {"job": job_id},
            ).scalars()
            return [int(i) for i in found] or [job_id]

    def detail(self, job_id: int) -> Detail | None:
        """The job ``job_id`` with its generation, or None when there is no such job."""
        with self.engine.connect() as conn:
            row = conn.execute(text(_DETAIL), {"job": job_id}).mappings().one_or_none()
        return None if row is None else _detail(row)

    def sample_ids(
        self,
        run_id: int,
        dataset: str,
        n: int,
        seed: int,
        where: str | None = None,
        markers: Sequence[int] = (),
    ) -> list[int]:
        """Ids of a seeded sample of ``n`` done jobs of the dataset matching ``where`` (a
        key of WHERE; ``markers``: the tool-call marker ids for "tool-calls")."""
        condition = "" if where is None else f"AND {WHERE[where]}"
        params: dict[str, Any] = {"run": run_id, "dataset": dataset, "n": n, "seed": seed}
        if where == "tool-calls":
            params["patterns"] = [pack([m]) for m in markers]
        with self.engine.connect() as conn:
            rows = conn.scalars(text(_SAMPLE_IDS.format(where=condition)), params)
            return [int(i) for i in rows]


def _with_sample(
    sql: str, run_id: int, names: Sequence[str], sample: int | None, seed: int
) -> tuple[str, dict[str, Any]]:
    params: dict[str, Any] = {"run": run_id, "names": list(names)}
    if sample is None:
        return sql.format(sample=""), params
    params |= {"n": sample, "seed": seed}
    return f"WITH {_SAMPLED} {sql.format(sample=_IN_SAMPLE)}", params


def _spread(pct: list[float] | None, top: Any) -> Spread:
    p50, p90, p99 = pct if pct is not None else (None, None, None)
    return Spread(p50, p90, p99, None if top is None else float(top))


def _int(value: Any) -> int:
    return 0 if value is None else int(value)


def _aggregate(r: Any) -> Aggregate:
    return Aggregate(
        dataset=None if r["total"] else str(r["dataset"]),
        generations=int(r["n"]),
        completion_sum=_int(r["c_sum"]),
        completion=_spread(r["c_pct"], r["c_max"]),
        prompt_sum=_int(r["p_sum"]),
        prompt=_spread(r["p_pct"], r["p_max"]),
        length=int(r["length"]),
        at_max_new=int(r["at_max_new"]),
        opens_reasoning=int(r["opens"]),
        no_think_end=int(r["no_think_end"]),
        no_think_end_cut=int(r["no_think_end_cut"]),
        reasoning_sum=_int(r["r_sum"]),
        reasoning=_spread(r["r_pct"], r["r_max"]),
        answer_sum=_int(r["a_sum"]),
        empty_answers=int(r["empty"]),
        cached_sum=_int(r["cached_sum"]),
        cache_hits=int(r["cache_hits"]),
        latency=_spread(r["l_pct"], r["l_max"]),
        latency_mean=None if r["l_mean"] is None else float(r["l_mean"]),
    )


def _tool_row(r: Any) -> ToolRow:
    return ToolRow(
        dataset=str(r.dataset),
        job_id=int(r.job_id),
        output_ids=unpack(bytes(r.output)),
        opens_reasoning=bool(r.opens),
        finish_type=str(r.finish),
        tools=r.tools,
    )


def _detail(r: Any) -> Detail:
    params = dict(r["sampling_params"] or {})
    output = r["output_ids"]
    return Detail(
        job_id=int(r["job_id"]),
        run=str(r["run"]),
        dataset=str(r["dataset"]),
        row_index=int(r["row_index"]),
        state=str(r["state"]),
        input_ids=unpack(bytes(r["input_ids"])),
        opens_reasoning=bool(r["opens"]),
        tools=r["tools"],
        stop_token_ids=stored_stop_ids(params),
        output_ids=None if output is None else unpack(bytes(output)),
        finish_type=r["finish_type"],
        finish_matched=r["finish_matched"],
        completion_tokens=r["completion_tokens"],
        prompt_tokens=r["prompt_tokens"],
        cached_tokens=r["cached_tokens"],
        e2e_latency=r["e2e_latency"],
        server=r["server"],
        think_end_present=r["think_end_present"],
        conversation_id=r.get("conversation_id"),
        turn=r.get("turn"),
        sample=int(r.get("sample") or 0),
        variant=r.get("variant"),
        sampling_seed=r.get("sampling_seed"),
    )
