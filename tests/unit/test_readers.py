"""Dataset readers: every format, stable indexes, and InputError before any row."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from producer import readers
from producer.readers import InputError, detect_format, iter_rows
from producer.rows import RawRow

ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": 'brackets ] } [ { and "quotes"'}]},
    {"prompt": "bare", "system": "sys"},
    {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
]


def values(path: Path, fmt: str | None = None) -> list[Any]:
    rows = list(iter_rows(path, fmt))
    assert [r.index for r in rows] == list(range(len(rows)))
    assert all(r.error is None for r in rows)
    return [r.value for r in rows]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_skips_blank_lines_and_isolates_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n  \n{not json\n\xff\xfe\n[1]\r\n{"prompt": "b"}')
    rows = list(iter_rows(path))
    assert [r.index for r in rows] == [0, 3, 4, 5, 6]
    assert [r.value for r in rows if r.error is None] == [{"prompt": "a"}, [1], {"prompt": "b"}]
    bad_json, bad_bytes = rows[1], rows[2]
    assert bad_json.error is not None and bad_json.error.reason == "invalid_json"
    assert bad_json.error.detail.startswith("line 4: Expecting property name")
    assert bad_json.excerpt == "{not json\n"
    assert bad_bytes.error is not None and bad_bytes.error.reason == "invalid_json"
    assert bad_bytes.error.detail.startswith("line 5: ")


def test_undecoded_jsonl_rows_decode_to_the_rows_read_decoded(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{not json\n\xff\xfe\n[1]\n')
    undecoded = list(iter_rows(path, decode=False))
    assert [r.line for r in undecoded] == [
        b'{"prompt": "a"}\n',
        b"{not json\n",
        b"\xff\xfe\n",
        b"[1]\n",
    ]
    assert all(r.value is None and r.error is None for r in undecoded)

    def plain(row: RawRow) -> tuple[Any, ...]:
        error = None if row.error is None else (row.error.reason, row.error.detail)
        return (row.index, row.value, error, row.excerpt, row.line)

    assert [plain(r.decoded()) for r in undecoded] == [plain(r) for r in iter_rows(path)]


def test_jsonl_gz(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(json.dumps(row) for row in ROWS) + "\n")
    assert detect_format(path) == "jsonl"
    assert values(path) == ROWS


def test_gzip_is_recognised_by_content_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "d.data"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n'))
    assert values(path, "jsonl") == [{"prompt": "a"}]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_json_array_streams_across_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(readers, "CHUNK_CHARS", chunk)
    path = tmp_path / "d.json"
    # A number at the end of a chunk must not be cut short.
    path.write_text(json.dumps([*ROWS, 1234567890, {"n": 1e300}], indent=2))
    assert values(path) == [*ROWS, 1234567890, {"n": 1e300}]


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_json_object_with_one_list_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(readers, "CHUNK_CHARS", chunk)
    path = tmp_path / "d.json"
    document = {"version": "1.0", "meta": {"tags": ["a"]}, "data": ROWS, "count": 3}
    path.write_text(json.dumps(document))
    assert values(path) == ROWS


def test_json_gz_and_empty_array(tmp_path: Path) -> None:
    path = tmp_path / "d.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"data": ROWS}).encode()))
    assert values(path) == ROWS
    empty = tmp_path / "e.json"
    empty.write_text(" [ ] ")
    assert values(empty) == []


def test_json_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS).encode())
    assert values(path) == ROWS


def test_json_lines_in_a_json_file_are_read_as_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.json", [json.dumps(row) for row in ROWS])
    assert detect_format(path) == "jsonl"
    assert detect_format(path, "json") == "jsonl"
    assert values(path) == ROWS
    single = tmp_path / "one.json"
    single.write_text(json.dumps(ROWS) + "\n")
    assert detect_format(single) == "json"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"rows"', "expected a JSON array of rows or an object with a list field"),
        ("", "found 'nothing'"),
        ('{"version": 1}', "no list of rows (fields: version)"),
        ('{"train": [], "test": []}', "fields 'train' and 'test' both hold lists"),
        ('{"messages": [{"role": "user", "content": "q"}]}', "so it is one row"),
        ('[{"prompt": "a"}, {"prompt": "b"}', "invalid JSON at line 1: expected ',' or ']'"),
        ('[{"prompt": "a"},\n {"prompt": "b"', "invalid JSON at line 2"),
        ('[{"prompt": "a"}] [', "extra data after the top-level value"),
        ("{1: 2}", "expected a field name"),
    ],
)
def test_broken_json_documents_raise_input_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(InputError, match=r"d\.json") as info:
        list(iter_rows(path))
    assert message in str(info.value)


def test_parquet_rows_are_plain_python_and_drop_filled_in_nulls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(readers, "BATCH_ROWS", 2)
    table = pa.Table.from_pylist(
        [
            {"messages": [{"role": "user", "content": "q", "name": "n"}], "prompt": None},
            {"messages": [{"role": "user", "content": "r"}], "prompt": None},
            {"messages": None, "prompt": "bare"},
        ],
        schema=pa.schema(
            [
                (
                    "messages",
                    pa.list_(
                        pa.struct(
                            [("role", pa.string()), ("content", pa.string()), ("name", pa.string())]
                        )
                    ),
                ),
                ("prompt", pa.string()),
            ]
        ),
    ).append_column("ids", pa.array([[1, 2], [3], []], pa.list_(pa.int32())))
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)
    assert values(path) == [
        {"messages": [{"role": "user", "content": "q", "name": "n"}], "ids": [1, 2]},
        {"messages": [{"role": "user", "content": "r"}], "ids": [3]},
        {"prompt": "bare", "ids": []},
    ]


def test_count_rows_for_progress_bars(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    counts = {
        "a.jsonl": (b'{"p": 1}\n{"p": 2}', 2),  # no newline after the last line
        "b.jsonl": (b'{"p": 1}\n{"p": 2}\n', 2),
        "c.jsonl": (b"", 0),
        "d.json": (b'[{"p": 1}, {"p": 2}]', None),  # a document: unknown before parsing
    }
    for name, (content, _) in counts.items():
        (tmp_path / name).write_bytes(content)
    with gzip.open(tmp_path / "e.jsonl.gz", "wb") as handle:
        handle.write(b'{"p": 1}\n' * 5)
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}] * 7), tmp_path / "f.parquet")
    datasets.Dataset.from_list([{"prompt": "x"}] * 3).save_to_disk(str(tmp_path / "g"))
    expected = {name: n for name, (_, n) in counts.items()} | {
        "e.jsonl.gz": 5,
        "f.parquet": 7,
        "g": 3,
    }
    assert {name: readers.count_rows(tmp_path / name) for name in expected} == expected


def test_parquet_that_is_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_text("not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        iter_rows(path)


def test_hf_dataset_folder_ignores_its_saved_format(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [
        {"messages": [{"role": "user", "content": "q"}], "ids": [1, 2]},
        {"messages": [{"role": "user", "content": "r"}], "ids": [3]},
    ]
    dataset = datasets.Dataset.from_list(rows)
    dataset.set_format("numpy")  # saved with the dataset; rows must still be lists
    dataset.save_to_disk(str(tmp_path / "ds"))
    assert detect_format(tmp_path / "ds") == "hf"
    assert values(tmp_path / "ds") == rows


def test_hf_dataset_dict_reads_train(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    splits = {
        "test": datasets.Dataset.from_list([{"prompt": "test"}]),
        "train": datasets.Dataset.from_list([{"prompt": "train"}]),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert values(tmp_path / "dd", "hf") == [{"prompt": "train"}]


def test_hf_dataset_dict_with_one_split_reads_it(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    only = {"validation": datasets.Dataset.from_list([{"prompt": "v"}])}
    datasets.DatasetDict(only).save_to_disk(str(tmp_path / "dd"))
    assert values(tmp_path / "dd") == [{"prompt": "v"}]


def test_hf_dataset_dict_without_train_needs_a_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list([{"prompt": "x"}])
    datasets.DatasetDict({"test": one, "validation": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError) as info:
        iter_rows(tmp_path / "dd")
    assert str(info.value) == (
        f"{tmp_path / 'dd'}: a DatasetDict with splits test, validation and no 'train';"
        f" pass one split's folder instead, e.g. {tmp_path / 'dd' / 'test'}"
    )
    assert values(tmp_path / "dd" / "validation") == [{"prompt": "x"}]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"missing\.jsonl: no such file or folder"):
        iter_rows(tmp_path / "missing.jsonl")  # raised at the call, before iterating


@pytest.mark.parametrize("name", ["d.xlsx", "d.txt", "d.parquet.gz", "data"])
def test_unknown_suffix_lists_the_supported_formats(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("a,b\n")
    with pytest.raises(InputError) as info:
        iter_rows(path)
    message = str(info.value)
    assert message.startswith(f"{path}: cannot tell the format from the file name")
    for fmt in ("jsonl (.jsonl, .jsonl.gz)", "json (.json", "parquet (.parquet)", "hf (a folder"):
        assert fmt in message


def test_unknown_format_hint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["{}"])
    with pytest.raises(
        InputError, match=r"d\.jsonl: unknown format 'csv'; supported formats: jsonl"
    ):
        iter_rows(path, "csv")


def test_hint_that_does_not_fit_the_path(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["{}"])
    with pytest.raises(InputError, match="needs a folder"):
        iter_rows(path, "hf")
    with pytest.raises(InputError, match="is a folder; format 'json' needs a file"):
        iter_rows(tmp_path, "json")


def test_folder_that_is_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(InputError) as info:
        iter_rows(tmp_path)
    assert "not a Hugging Face dataset saved with save_to_disk" in str(info.value)
    assert "nor holds data files (.parquet, .jsonl" in str(info.value)


def hub_snapshot(folder: Path, shards: dict[str, list[dict[str, Any]]]) -> Path:
    """A folder as a Hub download leaves it: a README and Parquet shards named by split."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("# a dataset\n")
    for name, rows in shards.items():
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / name)
    return folder


def test_folder_of_data_files_reads_its_train_split_in_shard_order(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    chat = [{"messages": [{"role": "user", "content": f"q{i}"}], "tools": None} for i in range(5)]
    folder = hub_snapshot(
        tmp_path / "snapshot",
        {
            "train-00000-of-00002.parquet": chat[:3],
            "train-00001-of-00002.parquet": chat[3:],
            "test-00000-of-00001.parquet": [{"prompt": "held out"}],
        },
    )
    assert detect_format(folder) == "hf"
    assert values(folder) == [{"messages": row["messages"]} for row in chat]  # nulls dropped
    assert readers.count_rows(folder) is None  # streamed: unknown until read


def test_folder_of_data_files_without_train_names_its_splits(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    row = {"prompt": "x"}
    folder = hub_snapshot(
        tmp_path / "snapshot",
        {"test-00000-of-00001.parquet": [row], "validation-00000-of-00001.parquet": [row]},
    )
    with pytest.raises(InputError, match="data files of splits test, validation and no 'train'"):
        iter_rows(folder)


def test_a_shard_that_cannot_be_read_fails_with_the_folder_named(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    folder = hub_snapshot(tmp_path / "snapshot", {"train-00000-of-00002.parquet": [{"p": "a"}]})
    (folder / "data" / "train-00001-of-00002.parquet").write_bytes(b"truncated download")
    with pytest.raises(
        InputError, match=r"snapshot: datasets failed after \d+ rows: Could not open"
    ):
        list(iter_rows(folder))


def test_csv_file_is_read_through_datasets(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    path = tmp_path / "d.csv"
    path.write_text('prompt,system\n"hello, world",\nbye,be brief\n')
    assert detect_format(path) == "hf"
    assert values(path) == [{"prompt": "hello, world"}, {"prompt": "bye", "system": "be brief"}]


def test_corrupt_gzip_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(b"\x1f\x8bnot really gzip")
    with pytest.raises(InputError, match=r"d\.jsonl\.gz: cannot read"):
        iter_rows(path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["{}"])
    path.chmod(0)
    with pytest.raises(InputError, match=r"d\.jsonl: cannot read"):
        iter_rows(path)


def test_heavy_libraries_are_imported_only_when_needed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}'])
    code = (
        "import sys; from pathlib import Path; from producer.readers import iter_rows;"
        f" list(iter_rows(Path({str(path)!r})));"
        " print(sorted({'pyarrow', 'datasets'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
