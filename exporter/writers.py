"""Shards of one split, in one of three shapes, each complete under its final name or absent.

A shard is written under a temporary name (``files.temporary``) and renamed when it
reaches the size limit or the export ends, so that a killed export never leaves a partial
shard under a final name. Rows are buffered into batches of a few MB and written as they
fill: memory stays constant whatever the shard size (a `save_to_disk` shard goes through a
memory-mapped Arrow stream file, not through memory).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from exporter.columns import SCHEMA, jsonl_line, record_batch
from exporter.files import publish, sha256_of, size_of, temporary
from exporter.rows import TokenRow

PARQUET = "parquet"
JSONL = "jsonl"
HF_DATASET = "hf-dataset"
SUFFIXES = {PARQUET: ".parquet", JSONL: ".jsonl", HF_DATASET: ""}
# Rows buffered before a write: big enough for efficient Parquet row groups, small enough
# to keep memory flat (a quarter of the shard at most, so a shard ends near its limit).
BATCH_BYTES = 8 << 20
_MIN_BATCH_BYTES = 16 << 10


@dataclass(frozen=True)
class Line:
    """A row already encoded as one JSON Lines line (a conversation)."""

    data: bytes


Row = TokenRow | Line


def _token_rows(rows: Sequence[Row]) -> list[TokenRow]:
    """``rows`` as token rows: only those have a columnar shape."""
    tokens = [r for r in rows if isinstance(r, TokenRow)]
    if len(tokens) != len(rows):
        raise TypeError("only token rows are written as Parquet or Arrow")
    return tokens


@dataclass(frozen=True)
class Shard:
    """A complete shard, as the manifest lists it."""

    file: str
    split: str
    rows: int
    bytes: int
    sha256: str

    def document(self) -> dict[str, object]:
        """As the manifest writes it."""
        return {
            "file": self.file,
            "split": self.split,
            "rows": self.rows,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


class _Sink(Protocol):
    def write(self, rows: Sequence[Row]) -> None: ...
    def size(self) -> int: ...
    def close(self) -> None: ...
    def discard(self) -> None: ...


class _ParquetSink:
    """A Parquet file, one row group per batch (zstd: every reader of Parquet has it)."""

    def __init__(self, tmp: Path) -> None:
        self._file = pa.OSFile(str(tmp), "wb")
        self._writer = pq.ParquetWriter(self._file, SCHEMA, compression="zstd")

    def write(self, rows: Sequence[Row]) -> None:
        self._writer.write_batch(record_batch(_token_rows(rows)), row_group_size=len(rows))

    def size(self) -> int:
        return int(self._file.tell())

    def close(self) -> None:
        self._writer.close()
        self._file.close()

    def discard(self) -> None:
        self.close()


class _JsonlSink:
    """A JSON Lines file."""

    def __init__(self, tmp: Path) -> None:
        self._handle = tmp.open("wb")

    def write(self, rows: Sequence[Row]) -> None:
        self._handle.write(b"".join(r.data if isinstance(r, Line) else jsonl_line(r) for r in rows))

    def size(self) -> int:
        return self._handle.tell()

    def close(self) -> None:
        self._handle.close()

    def discard(self) -> None:
        self.close()


class _ArrowDirSink:
    """A `datasets` ``save_to_disk`` folder, built at close from an Arrow stream file that
    the batches were appended to (``Dataset.from_file`` maps it instead of reading it)."""

    def __init__(self, tmp: Path) -> None:
        self._tmp = tmp
        self._stream_path = tmp.with_name(tmp.name + ".arrow")
        self._file = pa.OSFile(str(self._stream_path), "wb")
        self._writer = pa.ipc.new_stream(self._file, SCHEMA)

    def write(self, rows: Sequence[Row]) -> None:
        self._writer.write_batch(record_batch(_token_rows(rows)))

    def size(self) -> int:
        return int(self._file.tell())

    def close(self) -> None:
        self.discard()
        try:
            _save_to_disk(self._stream_path, self._tmp)
        finally:
            self._stream_path.unlink(missing_ok=True)

    def discard(self) -> None:
        self._writer.close()
        self._file.close()


def _save_to_disk(stream_path: Path, folder: Path) -> None:
    """The Arrow stream file as a `save_to_disk` folder, without progress bars."""
    from datasets import Dataset
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        dataset = Dataset.from_file(str(stream_path))
        dataset.save_to_disk(str(folder))
        del dataset  # it maps the stream file, which is removed next
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


def _open(kind: str, tmp: Path) -> _Sink:
    if kind == PARQUET:
        return _ParquetSink(tmp)
    if kind == JSONL:
        return _JsonlSink(tmp)
    return _ArrowDirSink(tmp)


def next_index(out: Path, split: str) -> int:
    """The number of the next shard of ``split`` in ``out``: one past every shard there,
    listed in the manifest or not (one renamed before an export was killed is never
    overwritten)."""
    pattern = re.compile(rf"{re.escape(split)}-(\d{{5,}})(\.\w+)?")
    found = [int(m.group(1)) for p in out.iterdir() if (m := pattern.fullmatch(p.name))]
    return max(found, default=-1) + 1


class SplitWriter:
    """The shards of one split: rows go in, complete shards come out under final names."""

    def __init__(self, out: Path, split: str, kind: str, shard_bytes: int) -> None:
        self.out = out
        self.split = split
        self.kind = kind
        self.shard_bytes = shard_bytes
        self.batch_bytes = max(min(BATCH_BYTES, shard_bytes // 4), _MIN_BATCH_BYTES)
        self.shards: list[Shard] = []
        self._index = next_index(out, split)
        self._buffer: list[Row] = []
        self._buffered = 0
        self._sink: _Sink | None = None
        self._rows = 0

    def _final(self) -> Path:
        return self.out / f"{self.split}-{self._index:05d}{SUFFIXES[self.kind]}"

    def add(self, row: Row) -> None:
        """Buffer ``row``; write the buffer when it is full, end the shard at its size."""
        self._buffer.append(row)
        if isinstance(row, Line):
            self._buffered += len(row.data)
        else:
            self._buffered += len(row.input_ids) * 5 // 4 + 64  # ids, mask and the rest
        if self._buffered >= self.batch_bytes:
            self._flush()
            assert self._sink is not None
            if self._sink.size() >= self.shard_bytes:
                self._complete()

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._sink is None:
            self._sink = _open(self.kind, temporary(self._final()))
        self._sink.write(self._buffer)
        self._rows += len(self._buffer)
        self._buffer, self._buffered = [], 0

    def _complete(self) -> None:
        assert self._sink is not None
        self._sink.close()
        self._sink = None
        final, tmp = self._final(), temporary(self._final())
        shard = Shard(final.name, self.split, self._rows, size_of(tmp), sha256_of(tmp))
        publish(tmp, final)
        self.shards.append(shard)
        self._index += 1
        self._rows = 0

    def finish(self) -> list[Shard]:
        """Write what is buffered and end the last shard; every shard written."""
        self._flush()
        if self._sink is not None:
            self._complete()
        return self.shards

    def abort(self) -> None:
        """Remove the shard being written (the complete ones stay, under final names)."""
        if self._sink is not None:
            # Already failing: the removal below is what matters.
            with contextlib.suppress(OSError, pa.ArrowException):
                self._sink.discard()
            self._sink = None
        tmp = temporary(self._final())
        for leftover in (tmp, tmp.with_name(tmp.name + ".arrow")):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
