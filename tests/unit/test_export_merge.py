"""Conversations in the export, pure: the prefix check, the merged row and its mask, row ids,
the split by conversation, and the counts."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import orjson
import pytest

from core.onpolicy import BEYOND, departure
from exporter.columns import jsonl_line, record_batch
from exporter.layouts import CONVERSATIONS, JSONL
from exporter.manifest import Options, check_extends
from exporter.merge import (
    FILTERED,
    NOT_FROM_FIRST,
    PREFIX_DIFFERS,
    Plan,
    TurnIds,
    extends,
    first_break,
    mask,
    plan,
    spans,
)
from exporter.rows import NO_LOSS, TRUNCATED, Filters, TokenRow, merged_row, row_id, token_row
from exporter.split import TRAIN, VAL, conversation_key, split_key, split_of
from exporter.tally import Tally
from exporter.whole import MergedTokens, Outcome
from models.export import ExportedConversation, PromptedGeneration
from models.records import ExportedGeneration
from models.tokens import pack
from tests.unit.test_export_rows import RUN, generation, previous_export

# A conversation of three turns whose prompts extend each other: turn t+1's prompt is turn
# t's prompt + output, then the template's ids and the next user message.
P0, O0 = [1, 2, 3], [10, 11, 2]
P1 = P0 + O0 + [5, 6]
O1 = [12, 2]
P2 = P1 + O1 + [5, 7, 8]
O2 = [13, 14, 15, 2]


def turn(
    t: int,
    prompt: list[int],
    output: list[int],
    *,
    conversation: int | None = 40,
    finish: str = "stop",
    job_id: int | None = None,
) -> ExportedGeneration:
    return replace(
        generation(prompt, output, finish, 100 + t if job_id is None else job_id),
        cached_tokens=t,
        server=f"s{t}",
        reasoning_tokens=1,
        answer_tokens=len(output) - 1,
        conversation_id=conversation,
        turn=None if conversation is None else t,
    )


TURNS = [turn(0, P0, O0), turn(1, P1, O1), turn(2, P2, O2)]


def ids_of(gens: list[ExportedGeneration]) -> list[TurnIds]:
    return [TurnIds(g.turn or 0, g.prompt_packed, g.output_packed) for g in gens]


def whole(gens: list[ExportedGeneration], state: str = "done") -> ExportedConversation:
    return ExportedConversation(
        id=40,
        dataset="d",
        state=state,
        ended_reason=None,
        updated_at=datetime(2026, 1, 1, tzinfo=UTC),
        turns=[PromptedGeneration(g, None, False) for g in gens],
    )


def test_a_turn_extends_the_one_before_when_its_prompt_starts_with_its_prompt_and_output() -> None:
    a, b, c = ids_of(TURNS)
    assert extends(a, b) and extends(b, c) and first_break([a, b, c]) is None
    # The template rewrote the earlier answer (a dropped reasoning, another encoding).
    other = TurnIds(1, pack([*P0, 10, 99, 2, 5, 6]), pack(O1))
    assert not extends(a, other) and first_break([a, other, c]) == 1
    # A prompt that is the earlier prompt alone (the answer left out) does not extend it.
    assert not extends(a, TurnIds(1, pack(P0), pack(O1)))
    # Packed ids compare as ids: a byte-level prefix inside an id is no prefix.
    assert not extends(TurnIds(0, pack([1]), pack([256])), TurnIds(1, pack([1, 256 + 1]), b""))


@pytest.mark.parametrize(
    ("prompt", "before"),
    [
        ([*P0, *O0, 5, 6], (P0, O0)),  # extends
        ([*P0, *O0], (P0, O0)),  # extends, nothing after
        ([*P0, 10, 99, 2, 5], (P0, O0)),  # departs in the answer
        ([1, 9, 3, *O0], (P0, O0)),  # departs in the prompt
        ([*P0, 10], (P0, O0)),  # ends inside the answer
        ([], (P0, O0)),
    ],
)
def test_extends_is_the_stats_rule_on_packed_ids(
    prompt: list[int], before: tuple[list[int], list[int]]
) -> None:
    """The export's byte check says what core.onpolicy.departure says (stats' report of
    prefix consistency), without unpacking the ids."""
    a = TurnIds(0, pack(before[0]), pack(before[1]))
    b = TurnIds(1, pack(prompt), b"")
    assert extends(a, b) is (departure(prompt, *before)[0] == BEYOND)


def test_the_spans_are_each_turn_s_output_in_the_last_turn_s_ids() -> None:
    found = spans(ids_of(TURNS))
    assert found == [(3, 6), (8, 10), (13, 17)]
    ids = P2 + O2
    assert [ids[a:b] for a, b in found] == [O0, O1, O2]
    assert mask(found, len(ids)) == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert mask(found, 9) == [0, 0, 0, 1, 1, 1, 0, 0, 1]  # cut at 9 ids


def turns_of(found: Plan) -> tuple[list[int], list[int], str | None]:
    return [t.turn for t in found.merged], [t.turn for t in found.apart], found.reason


@pytest.mark.parametrize(
    ("kept", "merged", "apart", "reason"),
    [
        ([True, True, True], [0, 1, 2], [], None),
        ([True, True, False], [0, 1], [], None),  # the cut last turn left out
        ([True, False, True], [], [0, 2], FILTERED),
        ([False, True, True], [], [1, 2], FILTERED),
        ([False, False, False], [], [], None),
    ],
)
def test_the_plan_merges_the_kept_turns_from_the_first(
    kept: list[bool], merged: list[int], apart: list[int], reason: str | None
) -> None:
    assert turns_of(plan(ids_of(TURNS), kept)) == (merged, apart, reason)


def test_a_conversation_whose_prompt_does_not_extend_stays_one_row_per_turn() -> None:
    # The template wrote turn 1's answer otherwise in turn 2's history.
    rewritten = replace(TURNS[2], prompt_packed=pack([*P1, 12, 99, 2, 5, 7, 8]))
    found = plan(ids_of([*TURNS[:2], rewritten]), [True] * 3)
    assert turns_of(found) == ([], [0, 1, 2], PREFIX_DIFFERS)
    # Conversation rows are templated again by the trainer: no prefix needed.
    assert len(plan(ids_of([*TURNS[:2], rewritten]), [True] * 3, prefix=False).merged) == 3
    # Done turns that do not run from 0 (never made by the advancer) are not merged.
    assert plan(ids_of(TURNS[1:]), [True, True]).reason == NOT_FROM_FIRST


def test_the_merged_row_is_the_last_turn_trained_over_every_output() -> None:
    row = merged_row(TURNS, spans(ids_of(TURNS)))
    assert row.id == "40_turn0-2" and row.job_id == 102
    assert (row.conversation_id, row.turn, row.turns) == (40, 2, 3)
    assert row.ids() == P2 + O2
    assert row.loss_mask() == mask(spans(ids_of(TURNS)), len(P2 + O2))
    assert row.loss_tokens == len(O0) + len(O1) + len(O2) == row.completion_tokens
    assert row.prompt_len == len(P0)  # the mask is 0 before the first turn's output
    assert (row.cached_tokens, row.server, row.finish_reason) == (0 + 1 + 2, "s2", "stop")
    assert (row.reasoning_tokens, row.answer_tokens) == (3, len(O0) + len(O1) + len(O2) - 3)
    # Cut as trainers cut: the ids and the mask together.
    cut = merged_row(TURNS, spans(ids_of(TURNS)), max_len=9)
    assert cut.cut and cut.ids() == (P2 + O2)[:9]
    assert cut.loss_mask() == [0, 0, 0, 1, 1, 1, 0, 0, 1] and cut.loss_tokens == 4
    # The columnar and JSON Lines rows hold the same mask.
    batch = record_batch([row, cut, token_row(TURNS[0])])
    assert batch.column("loss_mask").to_pylist() == [
        row.loss_mask(),
        cut.loss_mask(),
        [0, 0, 0, 1, 1, 1],
    ]
    assert batch.column("id").to_pylist() == ["40_turn0-2", "40_turn0-2", "40_turn0"]
    assert batch.column("turns").to_pylist() == [3, 3, 1]
    line = orjson.loads(jsonl_line(row))
    assert (line["id"], line["loss_mask"]) == ("40_turn0-2", row.loss_mask())
    assert line["metadata"]["conversation_id"] == 40 and line["metadata"]["turn"] == 2


def test_row_ids_name_the_job_or_the_conversation_and_turn() -> None:
    assert row_id(turn(3, P0, O0, conversation=None, job_id=77)) == "77"
    assert row_id(TURNS[1]) == "40_turn1"
    assert token_row(TURNS[1]).id == "40_turn1"
    assert merged_row(TURNS[:1], spans(ids_of(TURNS[:1]))).id == "40_turn0"


def test_every_turn_of_a_conversation_goes_to_the_conversation_s_split() -> None:
    """Keyed by the conversation, whatever the job ids: a conversation is never split."""
    fraction = 0.5
    for conversation in range(200):
        turns = [
            turn(t, P0, O0, conversation=conversation, job_id=1000 * conversation + 7 * t)
            for t in range(4)
        ]
        splits = {split_of(split_key(g), 3, fraction) for g in turns}
        assert splits == {split_of(conversation_key(conversation), 3, fraction)}
    # Conversations go to both splits, about as often as the fraction says.
    found = [split_of(conversation_key(c), 3, fraction) for c in range(2000)]
    assert 0.45 < found.count(VAL) / len(found) < 0.55 and TRAIN in found
    # A plain job keeps its key (its id): an export puts it where it was.
    plain = turn(0, P0, O0, conversation=None, job_id=12)
    assert split_of(split_key(plain), 3, fraction) == split_of(12, 3, fraction)


def written(outcome: Outcome) -> list[tuple[str, int]]:
    """Each row's id and turns."""
    found = []
    for w in outcome.rows:
        assert isinstance(w.row, TokenRow)
        found.append((w.row.id, w.turns))
    return found


def test_merged_tokens_merge_a_consistent_conversation_and_keep_the_others_per_turn() -> None:
    outcome = MergedTokens(Filters())(whole(TURNS))
    assert written(outcome) == [("40_turn0-2", 3)] and outcome.removed == []
    # A cut last turn under --exclude-truncated: the turns before it merge.
    cut_last = [*TURNS[:2], replace(TURNS[2], finish_type="length")]
    outcome = MergedTokens(Filters(exclude_truncated=True))(whole(cut_last, "ended"))
    assert written(outcome) == [("40_turn0-1", 2)]
    assert outcome.removed == [(TRUNCATED, 1)]
    # A prompt that does not extend: every turn its own row.
    rewritten = replace(TURNS[1], prompt_packed=pack([*P0, 5, 6]))
    outcome = MergedTokens(Filters())(whole([TURNS[0], rewritten]))
    assert written(outcome) == [("40_turn0", 1), ("40_turn1", 1)]
    assert outcome.plan.reason == PREFIX_DIFFERS
    # A merged row cut to nothing but prompt is removed, each of its turns counted.
    outcome = MergedTokens(Filters(max_len=3))(whole(TURNS))
    assert outcome.rows == [] and outcome.removed == [(NO_LOSS, 3)]


def test_the_conversation_counts_survive_the_manifest() -> None:
    tally = Tally()
    tally.exported("d", TRAIN, cut=False, length=17, turns=3)
    tally.removed("d", TRUNCATED, 2)
    counts = tally.conversations("d")
    turns = ids_of(TURNS)
    counts.count(Plan(merged=tuple(turns)), written=True)
    counts.count(Plan(apart=tuple(turns[:2]), reason=PREFIX_DIFFERS), written=True)
    counts.count(Plan(merged=tuple(turns)), written=False)  # --max-len removed its row
    doc = tally.document()["d"]
    assert (doc["read"], doc["exported"], doc["removed"][TRUNCATED]) == (5, 1, 2)
    assert doc["conversations"] == {
        "read": 3,
        "merged": 1,
        "merged_turns": 3,
        "unmerged": {PREFIX_DIFFERS: 1},
        "unmerged_turns": {PREFIX_DIFFERS: 2},
    }
    again = Tally.from_document(tally.document()).merged(tally)
    assert again.document()["d"]["conversations"]["unmerged_turns"] == {PREFIX_DIFFERS: 4}
    assert "conversations" not in Tally().document() and Tally().of("x").conversations is None


def test_merge_turns_is_for_tokens_and_an_incremental_export_keeps_it() -> None:
    with pytest.raises(ValueError, match="--merge-turns merges token rows"):
        Options(JSONL, format=CONVERSATIONS, style="specforge", merge_turns=True)
    merged = Options("parquet", merge_turns=True)
    assert merged.whole_conversations and not Options("parquet").whole_conversations
    previous = previous_export(merged)
    check_extends(previous, RUN, merged)
    with pytest.raises(ValueError, match="--merge-turns was True, now False"):
        check_extends(previous, RUN, Options("parquet"))
