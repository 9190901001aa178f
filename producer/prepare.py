"""The CPU-bound stage of enqueueing: validate, render and tokenize a batch. Pure: no I/O.

Kept apart from `producer.enqueue` so worker processes import only what they run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from core.dialogue import answer_points
from models.records import JobBatch, NewConversation, Rejection, prompt_sha256
from models.tokens import pack
from producer.rows import Prompt, RawRow, RowError, to_prompt
from producer.template import Templater


@dataclass(frozen=True)
class Prepared:
    """A batch after validation and templating."""

    jobs: JobBatch
    rejections: list[Rejection]
    # Multi-turn rows of a ``turns = "all"`` dataset: each a conversation and its first turn.
    conversations: list[NewConversation] = field(default_factory=list)


@dataclass(frozen=True)
class Rendered:
    """A batch after validation and rendering: the texts still to tokenize, each with the
    whole row it is the first turn of when the row is a conversation (`first_turn`)."""

    rows: Sequence[tuple[RawRow, Prompt, str, Prompt | None]]
    rejections: list[Rejection]


def prepare(
    templater: Templater,
    batch: list[RawRow],
    max_context_len: int | None,
    max_new_tokens: int,
    turns: str = "last",
) -> Prepared:
    """Validate, render and tokenize a batch; every bad row becomes a Rejection.
    ``turns``: the dataset's (datasets.turns); with "all", a multi-turn row's prompt is
    its first turn's (`first_turn`)."""
    return tokenize(templater, render(templater, batch, turns), max_context_len, max_new_tokens)


def first_turn(prompt: Prompt) -> tuple[Prompt, Prompt | None]:
    """The prompt of a row's first answer point and the row, when the row has several
    (core.dialogue.answer_points; the row's trailing answer, which ``to_prompt`` dropped,
    is never needed); else the prompt itself and None."""
    points = answer_points(prompt.messages)
    if len(points) < 2:
        return prompt, None
    return Prompt(prompt.messages[: points[0].start], prompt.tools), prompt


def render(templater: Templater, batch: list[RawRow], turns: str = "last") -> Rendered:
    """Validate and render a batch (Python work: it holds the GIL)."""
    rejections: list[Rejection] = []
    valid: list[tuple[RawRow, Prompt, Prompt | None]] = []
    for raw in map(RawRow.decoded, batch):
        try:
            if raw.error is not None:
                raise raw.error
            prompt = to_prompt(raw.value)
            valid.append((raw, *first_turn(prompt)) if turns == "all" else (raw, prompt, None))
        except RowError as err:
            rejections.append(Rejection(raw.index, err.reason, excerpt(raw, err)))
    rendered: list[tuple[RawRow, Prompt, str, Prompt | None]] = []
    for (raw, prompt, row), text in zip(
        valid, templater.render_many([p for _, p, _ in valid]), strict=True
    ):
        if isinstance(text, RowError):
            rejections.append(Rejection(raw.index, text.reason, excerpt(raw, text)))
        elif not text.isascii() and not _is_unicode(text):
            rejections.append(Rejection(raw.index, _SURROGATE.reason, excerpt(raw, _SURROGATE)))
        else:
            rendered.append((raw, prompt, text, row))
    return Rendered(rendered, rejections)


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate, which no tokenizer (nor UTF-8) takes.

    JSON can spell one ("\\ud800"); it would fail the whole batch's tokenization.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def tokenize(
    templater: Templater, rendered: Rendered, max_context_len: int | None, max_new_tokens: int
) -> Prepared:
    """Tokenize rendered prompts (the Rust tokenizer releases the GIL) and build the jobs."""
    encoded = templater.encode_batch([text for _, _, text, _ in rendered.rows])
    return build_jobs(rendered, encoded, max_context_len, max_new_tokens, templater.opens_reasoning)


def build_jobs(
    rendered: Rendered,
    encoded: list[list[int]],
    max_context_len: int | None,
    max_new_tokens: int,
    opens_reasoning: Callable[[list[int]], bool],
) -> Prepared:
    """The jobs of tokenized prompts; too long ones are rejected, repeats kept once.

    ``opens_reasoning``: whether a prompt leaves the model inside a reasoning block
    (`Templater.opens_reasoning`), stored with its job.
    """
    rejections = list(rendered.rejections)
    jobs = JobBatch()
    conversations: list[NewConversation] = []
    seen: set[bytes] = set()
    for (raw, prompt, _, row), input_ids in zip(rendered.rows, encoded, strict=True):
        too_long = _too_long(len(input_ids), max_context_len, max_new_tokens)
        if too_long is not None:
            rejections.append(Rejection(raw.index, too_long.reason, excerpt(raw, too_long)))
            continue
        packed = pack(input_ids)
        try:
            messages = _messages_json(prompt)
            source = None if row is None else _messages_json(row)
        except RowError as err:
            rejections.append(Rejection(raw.index, err.reason, excerpt(raw, err)))
            continue
        if row is not None and source is not None:
            conversation = NewConversation(
                raw.index,
                source,
                len(answer_points(row.messages)),
                packed,
                len(input_ids),
                messages,
                opens_reasoning(input_ids),
            )
            # A row repeated inside one batch is one conversation, as a prompt is one job.
            if conversation.digest not in seen:
                seen.add(conversation.digest)
                conversations.append(conversation)
            continue
        sha256 = prompt_sha256(packed)
        # A prompt repeated inside one batch is one job; the database dedups across batches.
        if sha256 in seen:
            continue
        seen.add(sha256)
        jobs.add(raw.index, sha256, packed, len(input_ids), messages, opens_reasoning(input_ids))
    return Prepared(jobs, rejections, conversations)


_SURROGATE = RowError(
    "unsupported_content", "a lone surrogate (U+D800-U+DFFF) in the prompt: not valid Unicode"
)
_NAN = RowError(
    "unsupported_content", "a NaN or infinite number in the messages or tools, which JSON lacks"
)


def _too_long(prompt_tokens: int, max_context_len: int | None, max_new: int) -> RowError | None:
    if max_context_len is None or prompt_tokens + max_new <= max_context_len:
        return None
    return RowError(
        "too_long",
        f"{prompt_tokens} prompt tokens + max_new_tokens {max_new} "
        f"exceed the context length {max_context_len}",
    )


def _messages_json(prompt: Prompt) -> str:
    """What the job stores of its prompt: the messages and tools the template received.

    Raises RowError for what JSON cannot hold (NaN, infinities, a lone surrogate): one such
    row would fail its whole batch's insert.
    """
    document = {"messages": prompt.messages, "tools": prompt.tools}
    try:
        data = orjson.dumps(document)  # a tenth of json.dumps's CPU
    except TypeError:  # orjson refuses non-string keys, integers beyond 64 bits, surrogates
        data = None
    # orjson writes NaN and infinities as null; only json tells them from None. Without
    # tools, the one null is "tools"; messages rarely hold another.
    if data is not None and data.count(b"null") == (prompt.tools is None):
        text = data.decode()
    else:
        try:
            text = json.dumps(document, ensure_ascii=False, allow_nan=False)
        except ValueError:
            raise _NAN from None
        if not _is_unicode(text):
            raise _SURROGATE
    return text


def excerpt(raw: RawRow, err: RowError) -> str:
    """The reason's detail and the start of the row, for `rejected_rows`."""
    source = raw.excerpt or json.dumps(raw.value, ensure_ascii=False, default=str)
    # Postgres text cannot hold NUL, which a line of binary garbage may carry, nor a lone
    # surrogate (no UTF-8 for it): both are written as escapes.
    text = f"{err.detail} | {source[:300]}".replace("\x00", "\\x00")
    return text if _is_unicode(text) else text.encode("utf-8", "backslashreplace").decode()
