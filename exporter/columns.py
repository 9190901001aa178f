"""Rows as Arrow record batches (Parquet and `save_to_disk` shards) and as JSON Lines.

The ids cross as one buffer per batch: the packed bytes of all rows are joined and viewed as
int32, never turned into Python ints (a million rows of thousands of ids each would spend
minutes there).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from exporter.rows import TokenRow

_IDS = np.dtype("<i4")  # as stored (models.tokens), whatever this machine's byte order

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),  # exporter.rows: job, turn or merged
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("seq_len", pa.int32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("cached_tokens", pa.int32(), nullable=False),
        pa.field("e2e_latency", pa.float64(), nullable=False),
        pa.field("server", pa.string(), nullable=False),
        pa.field("think_end_present", pa.bool_()),
        pa.field("reasoning_tokens", pa.int32()),
        pa.field("answer_tokens", pa.int32()),
        pa.field("row_index", pa.int32(), nullable=False),
        pa.field("job_id", pa.int64(), nullable=False),
        pa.field("conversation_id", pa.int64()),
        pa.field("turn", pa.int32()),
        pa.field("turns", pa.int32(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("variant", pa.string()),
    ]
)
# The metadata of a JSON Lines row (its other keys are the ones trainers read).
_METADATA = (
    "prompt_len",
    "finish_reason",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "server",
    "think_end_present",
    "reasoning_tokens",
    "answer_tokens",
    "row_index",
    "job_id",
    "conversation_id",
    "turn",
    "turns",
    "sample",
    "variant",
)


def record_batch(rows: Sequence[TokenRow]) -> pa.RecordBatch:
    """``rows`` as one record batch of :data:`SCHEMA`."""
    lengths = [r.seq_len for r in rows]
    offsets = pa.array([0, *accumulate(lengths)], pa.int32())
    ids = np.frombuffer(b"".join(r.input_ids for r in rows), _IDS).astype(np.int32, copy=False)
    mask = np.zeros(len(ids), np.int8)
    for start, row in zip(offsets.to_pylist(), rows, strict=False):
        for a, b in row.loss_spans():
            mask[start + a : start + b] = 1
    columns: dict[str, Any] = {
        "id": pa.array([r.id for r in rows], pa.string()),
        "dataset": pa.array([r.dataset for r in rows], pa.string()),
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids, pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask, pa.int8())),
        "seq_len": pa.array(lengths, pa.int32()),
    }
    for name in _METADATA:
        columns[name] = pa.array([getattr(r, name) for r in rows], SCHEMA.field(name).type)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA)


def jsonl_line(row: TokenRow) -> bytes:
    """``row`` as one JSON Lines row in the shape SpecForge's `prompts_path` and
    speculators' pre-tokenized rows are read in: ``input_ids`` and ``loss_mask`` flat
    integer lists of one length; ``id``/``primary_id`` and ``metadata`` as speculators'
    regenerated rows carry them (the primary id names the source row)."""
    ids = np.frombuffer(row.input_ids, _IDS).astype(np.int32, copy=False)
    mask = np.zeros(row.seq_len, np.int8)
    for a, b in row.loss_spans():
        mask[a:b] = 1
    document = {
        "id": row.id,
        "primary_id": f"{row.dataset}/{row.row_index}",
        "dataset": row.dataset,
        "input_ids": ids,
        "loss_mask": mask,
        "seq_len": row.seq_len,
        "metadata": {name: getattr(row, name) for name in _METADATA},
    }
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
