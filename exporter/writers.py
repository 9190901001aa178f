"""The files of one split, each complete under its final name or absent.

Sharded (``--for hf``): Parquet, JSON Lines or `save_to_disk` shards in the split's folder;
a shard is written in the pass's private folder (``folder.Workspace``: files created there,
never through a link) and renamed into place when it reaches the size limit or the export
ends, so that a killed export never leaves a partial shard under a final name. Whole
(``exporter.layouts``: one JSON Lines file, or one torch-format Dataset, per split): the
split's folder is built again in the private folder (the previous rows first, then the new
ones) and swapped in at the end. Rows are buffered into batches of a few MB and written as
they fill: memory stays constant whatever the size (a `save_to_disk` folder is built from a
memory-mapped Arrow stream file, not through memory).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from exporter.columns import SCHEMA, jsonl_line, record_batch
from exporter.files import sha256_of, sha256_of_files, size_of, size_of_files
from exporter.folder import SHARD, Workspace
from exporter.layouts import (
    HF_DATASET,
    JSONL,
    JSONL_FILE,
    PARQUET,
    TORCH_COLUMNS,
    TORCH_DATASET,
    WHOLE,
    whole_name,
)
from exporter.rows import TokenRow

SUFFIXES = {PARQUET: ".parquet", JSONL: ".jsonl", HF_DATASET: ""}
# Rows buffered before a write: big enough for efficient Parquet row groups, small enough
# to keep memory flat (a quarter of the shard at most, so a shard ends near its limit).
BATCH_BYTES = 8 << 20
_MIN_BATCH_BYTES = 16 << 10
_COPY_CHUNK = 1 << 20
_SAVED_DATA = re.compile(r"data-\d{5}-of-\d{5}\.arrow")  # as `datasets` names them


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
    the batches were appended to (``Dataset.from_file`` maps it instead of reading it).
    ``torch_seed``: a speculators Dataset, its rows shuffled by that seed (speculators holds
    out the folder's last rows for validation: they must be a sample) and saved in torch
    format."""

    def __init__(self, folder: Workspace, name: str, *, torch_seed: int | None = None) -> None:
        self._folder = folder
        self._name = name
        self._torch_seed = torch_seed
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
            target = self._folder.path(self._name)
            _save_to_disk(self._folder.path(self._stream), target, self._torch_seed)
            if self._torch_seed is not None:
                _in_torch_format(target)
        finally:
            self._folder.discard(self._stream)

    def discard(self) -> None:
        try:
            self._writer.close()
        finally:
            self._file.close()


def _save_to_disk(stream_path: Path, folder: Path, shuffle_seed: int | None = None) -> None:
    """The Arrow stream file as a `save_to_disk` folder (its rows shuffled by
    ``shuffle_seed``), without progress bars."""
    from datasets import Dataset
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        dataset = Dataset.from_file(str(stream_path))
        if shuffle_seed is not None:
            dataset = dataset.shuffle(seed=shuffle_seed)
        dataset.save_to_disk(str(folder))
        del dataset  # it maps the stream file, which is removed next
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


def _state(handle: BinaryIO) -> dict[str, Any]:
    """A saved Dataset's ``state.json``, its data files checked to be names it saves."""
    with handle:
        state: dict[str, Any] = json.loads(handle.read())
    for entry in state["_data_files"]:
        if not _SAVED_DATA.fullmatch(entry["filename"]):
            raise ValueError(f"a saved Dataset's state.json names {entry['filename']!r}")
    return state


def dataset_files(folder: Path) -> list[Path]:
    """The files of the saved Dataset at ``folder`` (what others keep there, such as
    speculators' hidden states, aside)."""
    state = _state((folder / "state.json").open("rb"))
    names = ["dataset_info.json", "state.json", *(e["filename"] for e in state["_data_files"])]
    return [folder / name for name in names]


def _in_torch_format(folder: Path) -> None:
    """Record in the saved Dataset's ``state.json`` the format ``set_format("torch",
    columns=TORCH_COLUMNS, output_all_columns=True)`` records: `datasets` refuses to set
    it where torch is not installed (eaglegen does not need torch), but only reads it back
    when the Dataset is used, on the trainer's machine."""
    path = folder / "state.json"
    state = json.loads(path.read_bytes())
    state |= {
        "_format_type": "torch",
        "_format_columns": list(TORCH_COLUMNS),
        "_format_kwargs": {},
        "_output_all_columns": True,
    }
    path.write_text(json.dumps(state, indent=2, sort_keys=True))


class _CopySink(_JsonlSink):
    """The split's one JSON Lines file: the previous export's rows copied first."""

    def __init__(self, handle: BinaryIO, before: BinaryIO | None) -> None:
        super().__init__(handle)
        if before is not None:
            with before:
                shutil.copyfileobj(before, handle, _COPY_CHUNK)


def next_index(names: Iterable[str], split: str) -> int:
    """The number of the next shard of ``split`` among ``names`` (its folder's): one past
    every shard there, listed in the manifest or not (one renamed before an export was
    killed is never overwritten)."""
    found = [
        int(m["index"]) for name in names if (m := SHARD.fullmatch(name)) and m["split"] == split
    ]
    return max(found, default=-1) + 1


class SplitWriter:
    """The files of one split: rows go in, complete files come out under final names.
    ``before``: the split's whole file or folder as the previous export listed it (whole
    layouts only: its rows are kept, ahead of the new ones)."""

    def __init__(
        self,
        folder: Workspace,
        split: str,
        kind: str,
        shard_bytes: int,
        before: Shard | None = None,
        seed: int = 0,
    ) -> None:
        self.folder = folder
        self.split = split
        self.kind = kind
        self.seed = seed
        self.whole = kind in WHOLE
        self.shard_bytes = shard_bytes
        self.batch_bytes = max(min(BATCH_BYTES, shard_bytes // 4), _MIN_BATCH_BYTES)
        self.shards: list[Shard] = []
        self._before = before
        self._index = 0 if self.whole else next_index(folder.names(split), split)
        self._buffer: list[Row] = []
        self._buffered = 0
        self._sink: _Sink | None = None
        self._rows = 0

    def _name(self) -> str:
        """The file's name in the private folder (a whole split: its path in OUT)."""
        if self.whole:
            return whole_name(self.kind, self.split)
        return f"{self.split}-{self._index:05d}{SUFFIXES[self.kind]}"

    def add(self, row: Row) -> None:
        """Buffer ``row``; write the buffer when it is full, end a shard at its size."""
        self._buffer.append(row)
        if isinstance(row, Line):
            self._buffered += len(row.data)
        else:
            self._buffered += len(row.input_ids) * 5 // 4 + 64  # ids, mask and the rest
        if self._buffered >= self.batch_bytes:
            self._flush()
            assert self._sink is not None
            if not self.whole and self._sink.size() >= self.shard_bytes:
                self._complete()

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._sink is None:
            self._sink = self._open()
        self._sink.write(self._buffer)
        self._rows += len(self._buffer)
        self._buffer, self._buffered = [], 0

    def _open(self) -> _Sink:
        folder, name = self.folder, self._name()
        if self.kind == PARQUET:
            return _ParquetSink(folder.create(name))
        if self.kind == JSONL:
            return _JsonlSink(folder.create(name))
        if self.kind == HF_DATASET:
            return _ArrowDirSink(folder, name)
        if self.kind == JSONL_FILE:
            folder.mkdir(self.split)
            kept = self._before is not None
            before = folder.read(self.split, f"{self.split}.jsonl") if kept else None
            return _CopySink(folder.create(name), before)
        assert self.kind == TORCH_DATASET
        return _ArrowDirSink(folder, name, torch_seed=self.seed)

    def _complete(self) -> None:
        assert self._sink is not None
        self._sink.close()
        self._sink = None
        name = self._name()
        rows = self._rows + (0 if self._before is None else self._before.rows)
        if self.kind == TORCH_DATASET:
            if self._before is not None:
                self._append_dataset()
            else:
                self.folder.install(self.split)
            files = dataset_files(self.folder.published(self.split))
            shard = Shard(name, self.split, rows, size_of_files(files), sha256_of_files(files))
        else:
            written = self.folder.path(name)
            file = name if self.whole else f"{self.split}/{name}"
            shard = Shard(file, self.split, rows, size_of(written), sha256_of(written))
            if self.whole:
                self.folder.install(self.split)
            else:
                self.folder.publish(name, self.split)
        self.shards.append(shard)
        self._index += 1
        self._rows = 0

    def _append_dataset(self) -> None:
        """Add the rows of this pass, saved as a Dataset in the private folder, to the
        split's Dataset in OUT: their Arrow file goes in beside the old ones, then a
        ``state.json`` listing it replaces the old (one rename: a reader sees the old rows
        or all of them). The old rows keep their places, and what speculators keeps in the
        folder (hidden states saved by row index) stays."""
        state = _state(self.folder.read(self.split, "state.json"))
        files = state["_data_files"]
        added = f"data-{len(files):05d}-of-{len(files) + 1:05d}.arrow"
        new = _state(self.folder.path(f"{self.split}/state.json").open("rb"))
        [saved] = new["_data_files"]
        self.folder.publish(f"{self.split}/{saved['filename']}", self.split, as_name=added)
        state["_data_files"] = [*files, {"filename": added}]
        state["_fingerprint"] = new["_fingerprint"]
        self.folder.write_in(self.split, "state.json", json.dumps(state, indent=2).encode())

    def finish(self) -> list[Shard]:
        """Write what is buffered and end the last file; every file written (none for a
        whole split this pass added no row to: it stays as it was)."""
        self._flush()
        if self._sink is not None:
            self._complete()
        return self.shards

    def abort(self) -> None:
        """Close the file being written (the private folder, removed at the end of the
        pass, holds it; the complete ones stay, under final names)."""
        if self._sink is not None:
            # Already failing: the removal of the private folder is what matters.
            with contextlib.suppress(OSError, pa.ArrowException):
                self._sink.discard()
            self._sink = None
