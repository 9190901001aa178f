"""The next turn of an on-policy conversation: from the row and the model's answers so far
(their exact output ids) to the next prompt's ids, or why the conversation ends there.

Each answer is read in the run's family from its output ids (``core.turns.decode_turn``:
reasoning, content, tool calls, as the family's template takes them back) and put in the
row's answer's place (``core.dialogue.next_prompt``); the messages are rendered by the run's
template with the run's kwargs and encoded as enqueue encodes (``RunTokenizer``). So turn
``t + 1``'s prompt is what a server in deployment gives the model after its own ``t``
answers, including a template that drops earlier reasoning. No I/O: the caller reads the
answers and stores the result (worker.advancer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from core.dialogue import TOO_LONG, TRUNCATED, next_prompt
from core.tokenizer import RunTokenizer
from core.turns import Prompt, decode_turn

# The next prompt does not render: the run's template refuses the model's answer as a
# message (e.g. arguments it cannot iterate). Counted like the other ends.
TEMPLATE_ERROR = "template_error"


@dataclass(frozen=True)
class Answer:
    """One settled turn's generation: its exact output ids, whether its prompt opened a
    reasoning block, and how it finished (SGLang's ``finish_reason.type``)."""

    output_ids: Sequence[int]
    opens_reasoning: bool
    finish_type: str


@dataclass(frozen=True)
class Step:
    """What comes after the answers: the next turn's prompt (``input_ids``, ``messages``
    as a job stores them, JSON text), or the end (``ended``: the reason), or ``done``."""

    input_ids: list[int] | None = None
    messages: str | None = None
    opens_reasoning: bool = False
    ended: str | None = None
    done: bool = False


def next_turn(
    tokenizer: RunTokenizer,
    row: Prompt,
    answers: Sequence[Answer],
    stops: Sequence[int],
    *,
    points: int,
    max_new_tokens: int,
    max_context_len: int | None,
) -> Step:
    """The step after ``answers`` (at least one) to the first answer points of ``row``
    (``points`` of them in all); ``stops``: the dataset's stop ids."""
    if len(answers) >= points:
        return Step(done=True)
    if answers[-1].finish_type == "length":
        return Step(ended=TRUNCATED)  # a cut answer is not what the model would have said
    markers = tokenizer.markers(stops)
    declared = row.declared()
    messages = [
        decode_turn(
            answer.output_ids,
            markers,
            tokenizer.decode,
            opens_reasoning=answer.opens_reasoning,
            declared=declared,
            family=tokenizer.family,
        )[1].message()
        for answer in answers
    ]
    found = next_prompt(row.messages, messages)
    if found.done:
        return Step(done=True)
    if found.ended is not None:
        return Step(ended=found.ended)
    try:
        text = tokenizer.render_chat(found.messages, row.tools, add_generation_prompt=True)
    except Exception:  # jinja raises many types; any of them ends the conversation
        return Step(ended=TEMPLATE_ERROR)
    input_ids = tokenizer.encode(text)
    if max_context_len is not None and len(input_ids) + max_new_tokens > max_context_len:
        return Step(ended=TOO_LONG)
    stored = json.dumps({"messages": found.messages, "tools": row.tools}, ensure_ascii=False)
    return Step(input_ids, stored, tokenizer.opens_reasoning(input_ids))


# Where a later turn's prompt first departs from the turn before it (its prompt, then its
# output): "prompt" or "answer" (and the offset into that part), or "beyond" when the
# whole of both is its prefix (it extends the turn before).
PROMPT, ANSWER, BEYOND = "prompt", "answer", "beyond"


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter's length when one is the
    other's prefix), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def departure(
    ids: Sequence[int], previous_prompt: Sequence[int], previous_output: Sequence[int]
) -> tuple[str, int]:
    """Where ``ids`` first differ from ``previous_prompt + previous_output``: the part and
    the offset into it (a template that re-renders an earlier answer its own way, e.g.
    without its reasoning, departs inside the answer)."""
    before = [*previous_prompt, *previous_output]
    at = first_difference(ids, before)
    if at is None or at >= len(before):
        return BEYOND, 0
    if at < len(previous_prompt):
        return PROMPT, at
    return ANSWER, at - len(previous_prompt)
