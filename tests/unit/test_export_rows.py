"""The export's pure logic: rows, masks, the cut, the filters, the split, the tally."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pyarrow as pa
import pytest

from exporter.columns import jsonl_line, record_batch
from exporter.manifest import Options, Previous, check_extends
from exporter.rows import (
    EXTRA_SAMPLE,
    INVALID,
    NO_LOSS,
    NOT_EXACT,
    SHORT,
    TRUNCATED,
    Filters,
    TokenRow,
    select_row,
    token_row,
)
from exporter.split import TRAIN, VAL, check_fraction, split_of
from exporter.tally import Tally
from models.records import ExportedGeneration, ExportRun
from models.tokens import pack

PROMPT = [7, 8, 9, 10]
OUTPUT = [100, 101, 102, 2]  # the last one the stop token


def generation(
    prompt: list[int] = PROMPT,
    output: list[int] = OUTPUT,
    finish: str = "stop",
    job_id: int = 1,
) -> ExportedGeneration:
    return ExportedGeneration(
        job_id=job_id,
        dataset="d",
        row_index=3,
        prompt_packed=pack(prompt),
        output_packed=pack(output),
        finish_type=finish,
        completion_tokens=len(output),
        cached_tokens=0,
        e2e_latency=0.5,
        server="sim",
        think_end_present=True,
        reasoning_tokens=2,
        answer_tokens=2,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_a_row_is_the_prompt_then_the_output_with_the_mask_boundary_exact() -> None:
    row = token_row(generation())
    ids, mask = row.ids(), row.loss_mask()
    assert ids == PROMPT + OUTPUT
    assert len(mask) == len(ids) == row.seq_len == 8
    assert row.prompt_len == 4
    assert mask[row.prompt_len - 1] == 0  # the last prompt position
    assert mask[row.prompt_len] == 1  # the first generated one
    assert mask == [0, 0, 0, 0, 1, 1, 1, 1]  # the stop token is trained on too


def test_the_arrow_batch_and_the_jsonl_row_hold_the_same_ids_and_mask() -> None:
    rows = [token_row(generation()), token_row(generation([5], [6, 7, 8], job_id=2))]
    batch = record_batch(rows)
    assert batch.column("input_ids").to_pylist() == [r.ids() for r in rows]
    assert batch.column("loss_mask").to_pylist() == [r.loss_mask() for r in rows]
    assert batch.column("seq_len").to_pylist() == [8, 4]
    assert batch.schema.field("input_ids").type == pa.list_(pa.int32())
    line = orjson.loads(jsonl_line(rows[1]))
    assert (line["id"], line["primary_id"]) == ("2", "d/3")
    assert (line["input_ids"], line["loss_mask"]) == ([5, 6, 7, 8], [0, 1, 1, 1])
    assert line["metadata"]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("max_len", "ids", "mask"),
    [
        (6, PROMPT + OUTPUT[:2], [0, 0, 0, 0, 1, 1]),
        (5, PROMPT + OUTPUT[:1], [0, 0, 0, 0, 1]),
        (8, PROMPT + OUTPUT, [0, 0, 0, 0, 1, 1, 1, 1]),
        (100, PROMPT + OUTPUT, [0, 0, 0, 0, 1, 1, 1, 1]),
    ],
)
def test_max_len_cuts_ids_and_mask_together(max_len: int, ids: list[int], mask: list[int]) -> None:
    row = select_row(generation(), Filters(max_len=max_len))
    assert isinstance(row, TokenRow)
    assert (row.ids(), row.loss_mask()) == (ids, mask)
    assert row.cut is (max_len < 8)
    assert row.prompt_len == 4


@pytest.mark.parametrize("max_len", [1, 3, 4])
def test_a_cut_that_leaves_no_generated_token_drops_the_row(max_len: int) -> None:
    assert select_row(generation(), Filters(max_len=max_len)) == NO_LOSS


def test_filters_name_what_removed_a_row_first() -> None:
    truncated = generation(finish="length")
    assert select_row(truncated, Filters(exclude_truncated=True, min_completion_tokens=99)) == (
        TRUNCATED
    )
    assert isinstance(select_row(truncated, Filters()), TokenRow)
    assert select_row(generation(), Filters(min_completion_tokens=5)) == SHORT
    assert isinstance(select_row(generation(), Filters(min_completion_tokens=4)), TokenRow)


def test_filters_refuse_values_out_of_range() -> None:
    with pytest.raises(ValueError, match="--max-len"):
        Filters(max_len=0)
    with pytest.raises(ValueError, match="--min-completion-tokens"):
        Filters(min_completion_tokens=-1)
    with pytest.raises(ValueError, match="--val-fraction"):
        check_fraction(1.0)


def test_the_split_is_deterministic_by_seed_and_id_and_near_the_fraction() -> None:
    first = [split_of(i, 7, 0.1) for i in range(20_000)]
    assert first == [split_of(i, 7, 0.1) for i in range(20_000)]
    assert 0.09 < first.count(VAL) / len(first) < 0.11
    other_seed = [split_of(i, 8, 0.1) for i in range(20_000)]
    assert other_seed != first
    assert {split_of(i, 7, 0.0) for i in range(1000)} == {TRAIN}


def test_the_tally_counts_per_dataset_and_survives_the_manifest() -> None:
    tally = Tally()
    tally.exported("a", TRAIN, cut=True, length=12)
    tally.exported("a", VAL, cut=False, length=30)
    tally.removed("a", TRUNCATED)
    tally.removed("b", NO_LOSS)
    doc = tally.document({"c": 5})
    assert doc["a"] == {
        "read": 3,
        "exported": 2,
        "splits": {TRAIN: 1, VAL: 1},
        "removed": {
            TRUNCATED: 1,
            SHORT: 0,
            INVALID: 0,
            NO_LOSS: 0,
            NOT_EXACT: 0,
            EXTRA_SAMPLE: 0,
        },
        "cut_to_max_len": 1,
        "longest_row": 30,
    }
    assert doc["c"]["removed"] == {"datasets": 5}
    again = Tally.from_document(doc).merged(tally)
    assert again.of("a").exported == 4 and "c" not in again.datasets
    assert again.of("a").longest == 30
    assert again.document()["b"]["removed"][NO_LOSS] == 2


RUN = ExportRun(1, "r", "m", "/tok", "a" * 64, "b" * 64, {}, None, {"d": {}})


def previous_export(options: Options) -> Previous:
    """What a folder exported from RUN with ``options`` holds."""
    return Previous(
        document={
            "format": options.format,
            "run": {"name": "r", "tokenizer_sha256": "a" * 64},
            "options": options.document(),
        },
        shards=[],
        tally=Tally(),
        since=datetime(2026, 1, 1, tzinfo=UTC),
        seen={},
    )


def test_an_incremental_export_refuses_other_options_naming_the_flag() -> None:
    run = RUN
    first = Options("parquet", Filters(max_len=512))
    previous = previous_export(first)
    check_extends(previous, run, first)
    with pytest.raises(ValueError, match="--max-len was 512, now None"):
        check_extends(previous, run, Options("parquet"))
    with pytest.raises(ValueError, match="not of 'other'"):
        check_extends(previous, ExportRun(1, "other", "m", "/t", "a", "b", {}, None, {}), first)


def test_only_valid_asks_validity_after_the_cheap_filters() -> None:
    asked: list[int] = []

    def invalid() -> bool:
        asked.append(1)
        return False

    only_valid = Filters(exclude_truncated=True, only_valid=True)
    truncated = generation(finish="length")
    assert select_row(truncated, only_valid, invalid) == TRUNCATED and not asked
    assert select_row(generation(), only_valid, invalid) == INVALID and asked == [1]
    assert isinstance(select_row(generation(), only_valid, lambda: True), TokenRow)
    assert isinstance(select_row(generation(), Filters(), invalid), TokenRow)
