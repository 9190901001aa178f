"""Streaming dataset readers: JSONL and JSON (optionally gzipped), Parquet, saved HF datasets."""

# Memory stays flat with the dataset's size. pyarrow and datasets are slow to import and not
# needed for JSON, so they are imported only when a Parquet file or an HF folder is read.

from __future__ import annotations

import gzip
import importlib
import io
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from producer.rows import RawRow, RowError

FORMATS = ("jsonl", "json", "parquet", "hf")
SUPPORTED = (
    "jsonl (.jsonl, .jsonl.gz), json (.json, .json.gz: an array of rows or an object with one"
    " list field), parquet (.parquet), hf (a folder written by datasets' save_to_disk, a"
    " folder of data files that datasets.load_dataset reads such as a Hub snapshot, or a .csv"
    " or .arrow file)"
)
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".ndjson": "jsonl",
    ".ndjson.gz": "jsonl",
    ".json": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".csv": "hf",
    ".arrow": "hf",
}
# Files only `datasets` reads here, and the load_dataset builder for each.
_DATASETS_BUILDERS = {".csv": "csv", ".arrow": "arrow"}
# What marks a folder as data files that load_dataset reads (it infers the builder from them).
_DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".arrow")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_GZIP_MAGIC = b"\x1f\x8b"
# Fields that make a JSON object one row rather than a container of rows.
_ROW_FIELDS = frozenset({"messages", "conversations"})
_WHITESPACE = re.compile(r"[ \t\n\r]*")
BATCH_ROWS = 1024
CHUNK_CHARS = 1 << 20
# A first line longer than this is not taken for a JSON Lines row when sniffing a .json file.
SNIFF_BYTES = 1 << 20
# A single JSON value this long means a corrupt file; bounds what a bad file can buffer.
MAX_VALUE_CHARS = 64 << 20
# A JSON Lines row longer than this is rejected unread (the default of the setting
# max_row_bytes): far above any prompt a context window holds, and a bound on what one line
# can cost in memory.
MAX_ROW_BYTES = 8 << 20
# What a stream that breaks mid-file raises: a truncated gzip (EOFError), corrupt gzip data
# (zlib.error, gzip.BadGzipFile is an OSError), or the disk itself (OSError).
_STREAM_ERRORS = (EOFError, OSError, zlib.error)


class InputError(ValueError):
    """A dataset that cannot be read at all; raised before any of its rows is yielded."""


def iter_rows(
    path: Path,
    fmt: str | None = None,
    *,
    decode: bool = True,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> Iterator[RawRow]:
    """Stream the rows of ``path`` with stable 0-based indexes; unreadable input: InputError.

    With ``decode=False`` JSON Lines rows come undecoded (see `RawRow.decoded`). A JSON
    Lines row over ``max_row_bytes`` comes as a ``too_long`` rejection, never read whole.
    """
    # Raised at this call for a missing, unreadable or unknown input; a file that breaks
    # off mid-stream (a truncated gzip, a JSON array never closed) cannot be resynchronised,
    # so it raises where it breaks, naming the last row read before it.
    found = detect_format(path, fmt)
    rows = _read_jsonl(path, max_row_bytes) if found == "jsonl" else _READERS[found](path)
    rows = _unbroken(path, rows)
    return (row.decoded() for row in rows) if decode else rows


def _unbroken(path: Path, rows: Iterator[RawRow]) -> Iterator[RawRow]:
    """``rows``, with a stream that breaks mid-file turned into one InputError saying where."""
    last = None
    try:
        for row in rows:
            last = row.index
            yield row
    except _STREAM_ERRORS as exc:
        where = "before its first row" if last is None else f"after row {last + 1:,}"
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, EOFError):
            reason = f"the file is truncated ({reason})"
        raise InputError(f"{path}: cannot read on {where}: {reason}") from exc


def count_rows(path: Path, fmt: str | None = None) -> int | None:
    """About how many rows ``iter_rows`` yields, where that is cheap to know (progress bars).

    JSON Lines: the lines (blank ones included); Parquet: the footer's count; a saved HF
    dataset: its row count; a JSON document or files datasets streams: None.
    """
    found = detect_format(path, fmt)
    if found == "jsonl":
        with _open_binary(path) as handle:
            lines, last = 0, b""
            while chunk := handle.read(CHUNK_CHARS):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
            return lines + (last not in (b"", b"\n"))  # a last line without a newline
    if found == "parquet":
        return int(_import("pyarrow.parquet", "parquet", "pyarrow").read_metadata(path).num_rows)
    if found == "hf" and path.is_dir() and _saved_to_disk(path):
        datasets = _import("datasets", "hf", "datasets")
        return int(datasets.load_from_disk(str(_hf_split(path))).num_rows)
    return None


def detect_format(path: Path, fmt: str | None = None) -> str:
    """The format ``path`` is read as: the hint if given, else its name or folder contents."""
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"{path}: unknown format {fmt!r}; supported formats: {SUPPORTED}")
    if path.is_dir():
        return _folder_format(path, fmt)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    _probe(path)
    found = fmt or _suffix_format(path)
    if found == "hf" and path.suffix.lower() not in _DATASETS_BUILDERS:
        raise InputError(
            f"{path}: format 'hf' needs a folder (save_to_disk or data files) or a .csv or"
            " .arrow file"
        )
    # .json files holding JSON Lines are common; reading them as one document would fail.
    return "jsonl" if found == "json" and _holds_json_lines(path) else found


def _folder_format(path: Path, fmt: str | None) -> str:
    """A folder is a Hugging Face dataset (saved, or data files) or nothing we read."""
    if fmt not in (None, "hf"):
        raise InputError(f"{path}: is a folder; format {fmt!r} needs a file")
    if not _saved_to_disk(path) and not _holds_data_files(path):
        markers = ", ".join(_HF_MARKERS)
        suffixes = ", ".join(_DATA_FILE_SUFFIXES)
        raise InputError(
            f"{path}: is a folder but not a Hugging Face dataset saved with save_to_disk"
            f" (none of {markers}) nor holds data files ({suffixes});"
            f" supported formats: {SUPPORTED}"
        )
    return "hf"


def _saved_to_disk(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in _HF_MARKERS)


def _holds_data_files(folder: Path) -> bool:
    return any(f.name.lower().endswith(_DATA_FILE_SUFFIXES) for f in folder.rglob("*"))


def _suffix_format(path: Path) -> str:
    """The format a file's name implies."""
    name = path.name.lower()
    for suffix, fmt in _SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    raise InputError(
        f"{path}: cannot tell the format from the file name; supported formats: {SUPPORTED}"
    )


def _probe(path: Path) -> None:
    """Fail now, not mid-stream, if the file (or its gzip stream) cannot be read."""
    try:
        with _open_binary(path) as handle:
            handle.read(1)
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from exc


def _open_binary(path: Path) -> gzip.GzipFile | io.BufferedReader:
    """The file's bytes, decompressed when it is gzip (recognised by content, not name)."""
    with path.open("rb") as handle:
        magic = handle.read(2)
    return gzip.open(path, "rb") if magic == _GZIP_MAGIC else path.open("rb")


def _holds_json_lines(path: Path) -> bool:
    """Whether the first line is a whole JSON value with more values after it."""
    with _open_binary(path) as handle:
        first = _next_nonblank_line(handle)
        if first is None or not first.endswith(b"\n"):
            return False
        try:
            json.loads(first)
        except ValueError:
            return False
        return _next_nonblank_line(handle) is not None


def _next_nonblank_line(handle: io.BufferedIOBase) -> bytes | None:
    """The next line with content (cut at SNIFF_BYTES), or None at the end."""
    while line := handle.readline(SNIFF_BYTES):
        if line.strip():
            return line
    return None


def _read_jsonl(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[RawRow]:
    """One undecoded row per non-blank line; the index is the line number minus one."""
    with _open_binary(path) as handle:
        index = 0
        while line := handle.readline(max_row_bytes + 1):
            if len(line) > max_row_bytes and not line.endswith(b"\n"):
                size = len(line) + _skip_line(handle)
                yield _oversized(index, line, size, max_row_bytes)
            elif line.strip():
                yield RawRow(index, line=line)
            index += 1


def _skip_line(handle: io.BufferedIOBase) -> int:
    """Read past the rest of the current line in bounded chunks; how many bytes it had."""
    skipped = 0
    while chunk := handle.readline(CHUNK_CHARS):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _oversized(index: int, start: bytes, size: int, limit: int) -> RawRow:
    error = RowError(
        "too_long",
        f"line {index + 1}: {size:,} bytes, over the row size limit of {limit:,}"
        " (EAGLEGEN_MAX_ROW_BYTES); not read",
    )
    return RawRow(index, error=error, excerpt=start[:300].decode("utf-8", "replace"))


class _JsonStream:
    """One JSON document decoded value by value from chunks, so rows stream."""

    def __init__(self, handle: io.TextIOBase, path: Path) -> None:
        self.handle = handle
        self.path = path
        self.buffer = ""
        self.pos = 0
        self.lines_dropped = 0  # newlines in text already dropped from the buffer
        self.decoder = json.JSONDecoder()

    def peek(self) -> str:
        """The next non-whitespace character, or "" at the end of the document."""
        while True:
            match = _WHITESPACE.match(self.buffer, self.pos)
            self.pos = match.end() if match else self.pos
            if self.pos < len(self.buffer) or not self._fill():
                return self.buffer[self.pos : self.pos + 1]

    def take(self, expected: str) -> str:
        """Consume the next character, which must be one of ``expected``."""
        char = self.peek()
        if not char or char not in expected:
            wanted = " or ".join(repr(c) for c in expected)
            raise self.error(f"expected {wanted}, found {char or 'the end'!r}")
        self.pos += 1
        return char

    def value(self) -> Any:
        """Decode the next whole value, reading on while it is cut by the buffer's end."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as exc:
                if not self._fill():
                    raise self.error(exc.msg, exc.pos) from exc
                continue
            # A number (or true/false/null) ending at the buffer's end may go on in the file.
            if end < len(self.buffer) or not self._fill():
                self.pos = end
                return value

    def error(self, message: str, pos: int | None = None) -> InputError:
        """An InputError naming the line where the document breaks."""
        line = self.lines_dropped + self.buffer.count("\n", 0, self.pos if pos is None else pos) + 1
        return InputError(f"{self.path}: invalid JSON at line {line}: {message}")

    def _fill(self) -> bool:
        """Append the next chunk, dropping decoded text; False at the end of the file."""
        pending = len(self.buffer) - self.pos
        if pending > MAX_VALUE_CHARS:
            raise self.error(f"a value longer than {MAX_VALUE_CHARS} characters")
        try:
            # Reading as much as is pending keeps re-decoding one long value linear.
            chunk = self.handle.read(max(CHUNK_CHARS, pending))
        except UnicodeDecodeError as exc:
            raise InputError(f"{self.path}: not UTF-8 text: {exc}") from exc
        if not chunk:
            return False
        self.lines_dropped += self.buffer.count("\n", 0, self.pos)
        self.buffer = self.buffer[self.pos :] + chunk
        self.pos = 0
        return True


def _read_json(path: Path) -> Iterator[RawRow]:
    """A JSON array of rows, or an object whose one list field holds the rows."""
    with io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig") as handle:
        stream = _JsonStream(handle, path)
        first = stream.peek()
        if first == "[":
            yield from _array_rows(stream)
        elif first == "{":
            yield from _object_rows(stream)
        else:
            raise InputError(
                f"{path}: expected a JSON array of rows or an object with a list field,"
                f" found {first or 'nothing'!r}"
            )
        if stream.peek():
            raise stream.error("extra data after the top-level value")


def _array_rows(stream: _JsonStream) -> Iterator[RawRow]:
    """The elements of the array at the stream's position."""
    stream.take("[")
    if stream.peek() == "]":
        stream.take("]")
        return
    index = 0
    while True:
        yield RawRow(index, stream.value())
        index += 1
        if stream.take(",]") == "]":
            return


def _object_rows(stream: _JsonStream) -> Iterator[RawRow]:
    """The rows of an object's only list field; other fields (metadata) are skipped."""
    listed: str | None = None
    fields: list[str] = []
    for name in _object_fields(stream):
        fields.append(name)
        if stream.peek() != "[":
            stream.value()
        elif name in _ROW_FIELDS:
            raise InputError(
                f"{stream.path}: the object has a {name!r} field, so it is one row;"
                " put rows in a JSON array or use JSON Lines"
            )
        elif listed is not None:
            raise InputError(
                f"{stream.path}: fields {listed!r} and {name!r} both hold lists;"
                " keep one list of rows per file"
            )
        else:
            listed = name
            yield from _array_rows(stream)
    if listed is None:
        shown = ", ".join(fields[:10]) or "none"
        raise InputError(f"{stream.path}: the JSON object has no list of rows (fields: {shown})")


def _object_fields(stream: _JsonStream) -> Iterator[str]:
    """Each field name of the object; the caller consumes the value before the next one."""
    stream.take("{")
    if stream.peek() == "}":
        stream.take("}")
        return
    while True:
        name = stream.value() if stream.peek() == '"' else None
        if not isinstance(name, str):
            raise stream.error("expected a field name")
        stream.take(":")
        yield name
        if stream.take(",}") == "}":
            return


def _read_parquet(path: Path) -> Iterator[RawRow]:
    """Rows of a Parquet file, record batch by record batch."""
    parquet = _import("pyarrow.parquet", "parquet", "pyarrow")
    try:
        parquet.read_metadata(path)  # the footer: fails now on a file that is not Parquet
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"{path}: not a readable Parquet file: {exc}") from exc
    return _parquet_rows(parquet, path)


def _parquet_rows(parquet: ModuleType, path: Path) -> Iterator[RawRow]:
    """The rows, reading one batch at a time."""
    with parquet.ParquetFile(path) as file:
        yield from _columnar_rows(file.iter_batches(batch_size=BATCH_ROWS))


def _read_hf(path: Path) -> Iterator[RawRow]:
    """Rows of a Hugging Face dataset: saved with ``save_to_disk``, or files it loads."""
    if path.is_dir() and _saved_to_disk(path):
        return _read_saved(path)
    return _read_loadable(path)


def _read_loadable(path: Path) -> Iterator[RawRow]:
    """Rows of data files as ``datasets.load_dataset`` reads them, streamed (no cache copy)."""
    datasets = _import("datasets", "hf", "datasets")
    builder = _DATASETS_BUILDERS.get(path.suffix.lower())
    try:
        if builder is None:  # a folder: load_dataset infers the builder and the splits
            splits = datasets.load_dataset(str(path), streaming=True)
        else:
            splits = datasets.load_dataset(builder, data_files=str(path), streaming=True)
    except Exception as exc:  # datasets raises many types; none may escape as a crash
        raise InputError(f"{path}: datasets cannot load it: {exc}") from exc
    names = [str(name) for name in splits]
    if "train" not in names and len(names) != 1:
        shown = ", ".join(sorted(names)) or "none"
        raise InputError(
            f"{path}: data files of splits {shown} and no 'train'; keep one split's files"
            " in the folder"
        )
    split = splits["train" if "train" in names else names[0]]
    return _streamed_rows(path, split.with_format("arrow").iter(batch_size=BATCH_ROWS))


def _streamed_rows(path: Path, batches: Iterable[Any]) -> Iterator[RawRow]:
    """Rows of batches datasets reads lazily: a shard it cannot read fails here, clearly."""
    rows = _columnar_rows(batches)
    index = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # e.g. shards whose columns disagree
            raise InputError(f"{path}: datasets failed after {index} rows: {exc}") from exc
        yield row
        index += 1


def _read_saved(path: Path) -> Iterator[RawRow]:
    """Rows of a dataset saved with ``save_to_disk`` (memory-mapped, read batch by batch)."""
    folder = _hf_split(path)
    datasets = _import("datasets", "hf", "datasets")
    try:
        dataset = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as exc:
        raise InputError(f"{folder}: cannot load the saved dataset: {exc}") from exc
    # The arrow format ignores a format saved with the dataset (numpy, torch, column subsets).
    return _columnar_rows(dataset.with_format("arrow").iter(batch_size=BATCH_ROWS))


def _hf_split(path: Path) -> Path:
    """The folder of the split to read: the dataset itself, "train", or the only split."""
    manifest = path / "dataset_dict.json"
    if not manifest.is_file():
        return path
    try:
        splits = [str(s) for s in json.loads(manifest.read_text(encoding="utf-8"))["splits"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{manifest}: unreadable DatasetDict manifest: {exc}") from exc
    if "train" in splits or len(splits) == 1:
        return path / ("train" if "train" in splits else splits[0])
    shown = ", ".join(splits) or "none"
    raise InputError(
        f"{path}: a DatasetDict with splits {shown} and no 'train';"
        f" pass one split's folder instead, e.g. {path / (splits[0] if splits else 'train')}"
    )


def _columnar_rows(batches: Iterable[Any]) -> Iterator[RawRow]:
    """Rows of arrow batches (RecordBatch or Table) as plain Python objects."""
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield RawRow(index, _drop_nulls(row))
            index += 1


def _drop_nulls(value: Any) -> Any:
    """``value`` without null object fields, recursively."""
    # Arrow gives every struct all fields seen in the column, so a field one row lacks comes
    # back as null; dropping nulls restores the row as written (an explicit null is lost).
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _import(module: str, fmt: str, package: str) -> ModuleType:
    """Import a heavy, untyped dependency when its format is first read."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise InputError(f"reading {fmt} needs the {package!r} package: {exc}") from exc


_READERS: dict[str, Callable[[Path], Iterator[RawRow]]] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "hf": _read_hf,
}
