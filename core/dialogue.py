"""A conversation regenerated on-policy: where in a dataset row the model answers, and the
messages of each answer's prompt once the model's earlier answers replace the row's.

A row's messages (OpenAI shape, as ``producer.rows`` normalises them) hold *answer points*:
each place where an assistant speaks after a user or tool message, and the end of a row
whose last message is a user's or a tool's. The model answers at every point in order.
Point ``k``'s prompt is the row's messages before it, each earlier point's assistant
messages (the row's answer) replaced by the model's own answer message: what the model sees
in deployment. (The chat template, applied to these messages, decides what of an earlier
answer the model sees again: some drop earlier reasoning.)

Tool results. A row's answer that called tools is followed by the tools' results. The
results fit the model's answer only when the model called the same functions, in order,
with arguments equal as JSON: then they follow it (each result's ``tool_call_id`` renamed to
the model's id of its call) and the conversation goes on; otherwise it ends after that
answer with ``TOOL_DIVERGENCE`` (the answer itself is kept: it answered an on-policy
prompt). Pure: no template, no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

# Why a conversation ended before its row's last answer point.
TOOL_DIVERGENCE = "tool_divergence"
TRUNCATED = "truncated"  # an answer cut at max_new_tokens
FAILED = "failed"  # an answer that failed for good
TOO_LONG = "too_long"  # the next prompt would not fit max_context_len
END_REASONS = (TOOL_DIVERGENCE, TRUNCATED, FAILED, TOO_LONG)

_ANSWERED = frozenset({"user", "tool"})


@dataclass(frozen=True)
class Point:
    """An answer point: the prompt is the row's ``messages[:start]`` (rewritten), and the
    row's own answer, replaced by the model's, is ``messages[start:end]`` (none at the end
    of a row that ends with a user or tool message)."""

    start: int
    end: int


def answer_points(messages: Sequence[Message]) -> list[Point]:
    """Every answer point of ``messages``, in order."""
    points = []
    i = 1
    while i <= len(messages):
        before = messages[i - 1].get("role")
        if before in _ANSWERED and (i == len(messages) or messages[i].get("role") == "assistant"):
            end = i
            while end < len(messages) and messages[end].get("role") == "assistant":
                end += 1
            points.append(Point(i, end))
            i = end + 1
        else:
            i += 1
    return points


@dataclass(frozen=True)
class Next:
    """The prompt of the next answer point, or why the conversation ended before it
    (``ended``; ``messages`` then empty). ``done``: the row has no point left."""

    messages: list[Message]
    ended: str | None = None
    done: bool = False


def next_prompt(messages: Sequence[Message], answers: Sequence[Message]) -> Next:
    """The messages of the prompt of answer point ``len(answers)``, the model's ``answers``
    to the points before it taking the place of the row's (the last answer's calls do not
    matter when it was the row's last point: the conversation is done)."""
    points = answer_points(messages)
    if len(answers) > len(points):
        raise ValueError(f"{len(answers)} answers to a row of {len(points)} answer points")
    if len(answers) == len(points):
        return Next([], done=True)
    prompt: list[Message] = []
    cursor = 0
    for point, answer in zip(points, answers, strict=False):
        prompt += messages[cursor : point.start]
        prompt.append(answer)
        cursor = point.end
        following = _results(messages, point.end)
        if not _same_calls(messages[point.start : point.end], answer, bool(following)):
            return Next([], ended=TOOL_DIVERGENCE)
        renamed = _renamed_ids(messages[point.start : point.end], answer)
        prompt += [_renamed(m, renamed) for m in following]
        cursor += len(following)
    prompt += messages[cursor : points[len(answers)].start]
    return Next(prompt)


def _results(messages: Sequence[Message], start: int) -> list[Message]:
    """The tool messages from ``start`` on (the results of the answer before them)."""
    end = start
    while end < len(messages) and messages[end].get("role") == "tool":
        end += 1
    return list(messages[start:end])


def _same_calls(row_answer: Sequence[Message], answer: Message, results: bool) -> bool:
    """Whether the row's tool results (``results``: it has some) fit the model's answer:
    no results and no calls, or the same calls."""
    theirs, ours = _calls(row_answer), _calls([answer])
    if not results:
        return not ours  # a call the row has no result for cannot go on
    return len(theirs) == len(ours) and all(
        _name(a) == _name(b) and _arguments(a) == _arguments(b)
        for a, b in zip(theirs, ours, strict=True)
    )


def _calls(answer: Sequence[Message]) -> list[Message]:
    return [c for m in answer for c in (m.get("tool_calls") or []) if isinstance(c, dict)]


def _function(call: Message) -> Message:
    inner = call.get("function")
    return inner if isinstance(inner, dict) else call


def _name(call: Message) -> Any:
    return _function(call).get("name")


def _arguments(call: Message) -> Any:
    """A call's arguments as JSON values (a string that is not JSON: as written)."""
    value = _function(call).get("arguments")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _renamed_ids(row_answer: Sequence[Message], answer: Message) -> dict[str, str]:
    """The row's call ids, each to the model's id of the same call."""
    pairs = zip(_calls(row_answer), _calls([answer]), strict=False)
    return {
        str(theirs["id"]): str(ours["id"])
        for theirs, ours in pairs
        if "id" in theirs and "id" in ours
    }


def _renamed(message: Message, ids: dict[str, str]) -> Message:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in ids:
        return message
    return {**message, "tool_call_id": ids[call_id]}
