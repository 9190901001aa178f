"""Small helpers shared by integration and e2e tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from core.settings import Settings
from eaglegen.assets import CHAT_TEMPLATE, SAMPLE_DATASET, TOKENIZER_DIR
from eaglegen.stack import EmbeddedRedis
from models.repository import Repository
from models.schema import Dataset, Generation, Job, RejectedRow
from models.states import JobState
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan
from producer.rows import to_prompt
from producer.stats import DatasetStats


def sample_rows(n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of the bundled sample dataset."""
    with SAMPLE_DATASET.open() as handle:
        return [json.loads(line) for _, line in zip(range(n), handle, strict=False)]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows (objects or raw strings) as JSONL."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def enqueue_file(
    settings: Settings,
    path: Path,
    *,
    run: str = "run",
    dataset: str = "d",
    max_new_tokens: int = 256,
    tokenizer: Path = TOKENIZER_DIR,
    turns: str = "last",
    **plan: Any,
) -> DatasetStats:
    """Enqueue ``path`` (with the bundled tokenizer by default), as `eaglegen enqueue` does;
    one job per row unless ``turns="all"`` (the default of a run file's dataset)."""
    report = run_enqueue(
        settings,
        settings.services(),
        RunPlan(
            run=run,
            tokenizer=tokenizer,
            datasets=[
                DatasetPlan(dataset, path, sampling={"max_new_tokens": max_new_tokens}, turns=turns)
            ],
            **plan,
        ),
        quiet=True,
    )
    [stats] = report.datasets
    return stats


class PasswordRedis(EmbeddedRedis):
    """An embedded Redis that wants a password, given in its URL's query (``?password=``)."""

    def __init__(self, data_dir: Path, password: str, port: int | None = None) -> None:
        super().__init__(data_dir, port)
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?password={self.password}"

    def command(self) -> list[str]:
        return [*super().command(), "--requirepass", self.password]


TEMPLATES = Path(__file__).parent / "data" / "templates"
# The special tokens of the template families in TEMPLATES that the bundled vocabulary lacks.
FAMILY_TOKENS = [
    "<|im_start|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
]


# Each family's structure tokens (tool calls, harmony's channels, chat markers, stops) that
# FAMILY_TOKENS and the bundled vocabulary lack, added by family_tokenizer(structure=True) as
# (special tokens, plain added tokens) the way the family's published tokenizer has them
# (the exact decoder keeps both kinds). The bundled vocabulary is Kimi-K2's already.
_Tokens = tuple[list[str], list[str]]
_QWEN3: _Tokens = (
    ["<|endoftext|>"],
    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
)
_DEEPSEEK: _Tokens = (
    [],
    [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    ],
)
_GLM45: _Tokens = (
    [
        "[gMASK]",
        "<sop>",
        "<|endoftext|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ],
    [],
)
_GPT_OSS: _Tokens = (
    [
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
        "<|endoftext|>",
    ],
    [],
)
STRUCTURE_TOKENS: dict[str, _Tokens] = {
    "kimi_k2": ([], []),
    "qwen3": _QWEN3,
    "qwen3_hybrid": _QWEN3,
    "qwen3_thinking": _QWEN3,
    "deepseek_v3": _DEEPSEEK,
    "deepseek_r1": _DEEPSEEK,
    "deepseek_v31": _DEEPSEEK,
    "glm45": _GLM45,
    "gpt_oss": _GPT_OSS,
}


def family_template(family: str) -> str:
    """``family``'s chat template: tests/data/templates, or the bundled one for Kimi-K2."""
    path = TEMPLATES / f"{family}.jinja"
    return (CHAT_TEMPLATE if family == "kimi_k2" and not path.exists() else path).read_text()


def family_tokenizer(folder: Path, family: str, *, structure: bool = False) -> Path:
    """The bundled tokenizer with ``family``'s chat template and special tokens, saved under
    ``folder/family`` (tests/data/templates/README.md says what each family is);
    ``structure`` adds the family's tool-call, channel and stop tokens (STRUCTURE_TOKENS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS})
    if structure:
        special, plain = STRUCTURE_TOKENS[family]
        tokenizer.add_tokens(special, special_tokens=True)
        tokenizer.add_tokens(plain)
    tokenizer.chat_template = family_template(family)
    out = folder / family
    tokenizer.save_pretrained(str(out))
    return out


def settled_states(repo: Repository) -> dict[str, int] | None:
    """Jobs by state over every run once none is queued or running and no conversation is
    under way (between a turn's record and the advancer's next turn, no job of it is open
    though the run is not done); None before."""
    states: dict[str, int] = {}
    runs = set()
    for counts in repo.counts():
        runs.add(counts.run)
        for state, n in counts.states.items():
            states[state] = states.get(state, 0) + n
    if not states or states.get("queued", 0) + states.get("running", 0):
        return None
    return None if any(repo.conversations_under_way(run) for run in runs) else states


def wait_settled(repo: Repository, timeout_s: float = 120.0) -> dict[str, int]:
    """Poll until the runs are settled (``settled_states``); the final counts by state."""
    deadline = time.monotonic() + timeout_s
    while (states := settled_states(repo)) is None:
        if time.monotonic() > deadline:
            now = [(c.dataset, c.states) for c in repo.counts()]
            raise TimeoutError(f"jobs or conversations not settled after {timeout_s} s: {now}")
        time.sleep(0.1)
    return states


def reference_ids(tokenizer: Any, row: dict[str, Any], **template_kwargs: Any) -> list[int]:
    """What transformers' apply_chat_template gives for the row: the ground truth."""
    prompt = to_prompt(row)
    ids = tokenizer.apply_chat_template(
        prompt.messages,
        tools=prompt.tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)


class InspectRepository(Repository):
    """The repository with the reads that only tests need (the product never looks a job up
    by id or lists rows this way)."""

    def job(self, job_id: int) -> dict[str, Any] | None:
        """One job's row as a dict."""
        with self.engine.connect() as conn:
            row = conn.execute(select(Job).where(Job.id == job_id)).mappings().one_or_none()
        return None if row is None else dict(row)

    def generation(self, job_id: int) -> dict[str, Any] | None:
        """One job's generation row as a dict, or None."""
        with self.engine.connect() as conn:
            row = (
                conn.execute(select(Generation).where(Generation.job_id == job_id))
                .mappings()
                .one_or_none()
            )
        return None if row is None else dict(row)

    def job_ids(self, dataset_id: int | None = None, state: JobState | None = None) -> list[int]:
        """Ids of jobs, optionally of one dataset and state, in id order."""
        stmt = select(Job.id).order_by(Job.id)
        if dataset_id is not None:
            stmt = stmt.where(Job.dataset_id == dataset_id)
        if state is not None:
            stmt = stmt.where(Job.state == state.value)
        with self.engine.connect() as conn:
            return [int(i) for i in conn.scalars(stmt)]

    def rejected_rows(self, dataset_id: int | None = None) -> list[tuple[int, str]]:
        """(row_index, reason) of rejected rows, in row order."""
        stmt = select(RejectedRow.row_index, RejectedRow.reason).order_by(RejectedRow.row_index)
        if dataset_id is not None:
            stmt = stmt.where(RejectedRow.dataset_id == dataset_id)
        with self.engine.connect() as conn:
            return [(int(r.row_index), str(r.reason)) for r in conn.execute(stmt)]

    def sampling_params(self, dataset_id: int) -> dict[str, Any]:
        """The sampling params every job of the dataset is sent with."""
        with self.engine.connect() as conn:
            params = conn.scalar(select(Dataset.sampling_params).where(Dataset.id == dataset_id))
        return dict(params or {})

    def generation_count(self, job_id: int | None = None) -> int:
        """How many generation rows exist (for one job, or in all)."""
        stmt = select(func.count()).select_from(Generation)
        if job_id is not None:
            stmt = stmt.where(Generation.job_id == job_id)
        with self.engine.connect() as conn:
            return int(conn.scalar(stmt) or 0)
