"""Shards of one split, in one of three shapes, each complete under its final name or absent.

A shard is written in the pass's private folder (``folder.Workspace``: files created
there, never through a link) and renamed into OUT when it reaches the size limit or the
export ends, so that a killed export never leaves a partial shard under a final name. Rows
are buffered into batches of a few MB and written as they fill: memory stays constant
whatever the shard size (a `save_to_disk` shard goes through a memory-mapped Arrow stream
file, not through memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from exporter.columns import SCHEMA, jsonl_line, record_batch
from exporter.files import sha256_of, size_of
from exporter.folder import SHARD, Workspace
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

    def __init__(self, handle: BinaryIO) -> None:
        self._file = handle
        self._writer = pq.ParquetWriter(handle, SCHEMA, compression="zstd")

    def write(self, rows: Sequence[Row]) -> None:
        self._writer.write_batch(record_batch(_token_rows(rows)), row_group_size=len(rows))

    def size(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._file.close()

    def discard(self) -> None:
        self.close()


class _JsonlSink:
    """A JSON Lines file."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle

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

    def __init__(self, folder: Workspace, name: str) -> None:
        self._folder = folder
        self._name = name
        self._stream = f"{name}.arrow"
        self._file = folder.create(self._stream)
        self._writer = pa.ipc.new_stream(self._file, SCHEMA)

    def write(self, rows: Sequence[Row]) -> None:
        self._writer.write_batch(record_batch(_token_rows(rows)))

    def size(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self.discard()
        try:
            # `datasets` opens by path: both inside the private folder (checked).
            _save_to_disk(self._folder.path(self._stream), self._folder.path(self._name))
        finally:
            self._folder.discard(self._stream)

    def discard(self) -> None:
        try:
            self._writer.close()
        finally:
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


def _open(kind: str, folder: Workspace, name: str) -> _Sink:
    if kind == PARQUET:
        return _ParquetSink(folder.create(name))
    if kind == JSONL:
        return _JsonlSink(folder.create(name))
    return _ArrowDirSink(folder, name)


def next_index(names: Iterable[str], split: str) -> int:
    """The number of the next shard of ``split`` among ``names`` (OUT's): one past every
    shard there, listed in the manifest or not (one renamed before an export was killed is
    never overwritten)."""
    found = [
        int(m["index"]) for name in names if (m := SHARD.fullmatch(name)) and m["split"] == split
    ]
    return max(found, default=-1) + 1


class SplitWriter:
    """The shards of one split: rows go in, complete shards come out under final names."""

    def __init__(self, folder: Workspace, split: str, kind: str, shard_bytes: int) -> None:
        self.folder = folder
        self.split = split
        self.kind = kind
        self.shard_bytes = shard_bytes
        self.batch_bytes = max(min(BATCH_BYTES, shard_bytes // 4), _MIN_BATCH_BYTES)
        self.shards: list[Shard] = []
        self._index = next_index(folder.names(), split)
        self._buffer: list[Row] = []
        self._buffered = 0
        self._sink: _Sink | None = None
        self._rows = 0

    def _name(self) -> str:
        return f"{self.split}-{self._index:05d}{SUFFIXES[self.kind]}"

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
            self._sink = _open(self.kind, self.folder, self._name())
        self._sink.write(self._buffer)
        self._rows += len(self._buffer)
        self._buffer, self._buffered = [], 0

    def _complete(self) -> None:
        assert self._sink is not None
        self._sink.close()
        self._sink = None
        name = self._name()
        written = self.folder.path(name)
        shard = Shard(name, self.split, self._rows, size_of(written), sha256_of(written))
        self.folder.publish(name)
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
        """Close the shard being written (the private folder, removed at the end of the
        pass, holds it; the complete ones stay, under final names)."""
        if self._sink is not None:
            # Already failing: the removal of the private folder is what matters.
            with contextlib.suppress(OSError, pa.ArrowException):
                self._sink.discard()
            self._sink = None
