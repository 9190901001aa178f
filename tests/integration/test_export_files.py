"""What an export folder may hold that an export did not write: links planted at the names
an export writes, a manifest naming files outside the folder, and what a killed export left
(docs/reference/export.md, "What a killed export leaves")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from exporter.export import ExportResult
from exporter.folder import Workspace
from exporter.manifest import MANIFEST
from models.repository import Repository
from tests.integration.test_export import comparable, export, recorded_run, shard_files

VICTIM = b"precious: not the export's\n"


def first_export(repo: Repository, out: Path) -> ExportResult:
    recorded_run(repo, {"a": [(4, 6, "stop")] * 3})
    return export(repo, out)


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder as "dir"."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[name] = "dir"
        else:
            found[name] = path.read_bytes()
    return found


def test_links_planted_at_the_temporary_names_are_removed_and_never_written_through(
    repo: Repository, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first_export(repo, out)
    recorded_run(repo, {"b": [(5, 7, "stop")] * 2})  # rows for a new shard
    victims = {name: tmp_path / f"victim-{name}" for name in (MANIFEST, "train-00001.parquet")}
    for name, victim in victims.items():
        victim.write_bytes(VICTIM)
        # The names the export wrote through before: guessable, since the pid is.
        (out / f".tmp-{os.getpid()}-{name}").symlink_to(victim)
    result = export(repo, out, incremental=True)
    assert [v.read_bytes() for v in victims.values()] == [VICTIM] * 2
    for final in (out / MANIFEST, out / "train" / "train-00001.parquet"):
        assert not final.is_symlink() and final.is_file()
    assert json.loads((out / MANIFEST).read_bytes()) == result.manifest
    assert sorted(result.removed) == sorted(f".tmp-{os.getpid()}-{n}" for n in victims)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def edit_manifest(out: Path, **shard: Any) -> None:
    manifest = json.loads((out / MANIFEST).read_bytes())
    manifest["shards"][0].update(shard)
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name", ["../victim.txt", "/etc/passwd", "sub/train-00000.parquet", "..", "", 7, "link"]
)
def test_a_manifest_naming_a_shard_outside_the_folder_is_refused_and_nothing_written(
    repo: Repository, tmp_path: Path, name: str | int
) -> None:
    out = tmp_path / "out"
    first_export(repo, out)
    (tmp_path / "victim.txt").write_bytes(VICTIM)
    (out / "link").symlink_to(tmp_path / "victim.txt")  # a shard that leaves the folder
    edit_manifest(out, file=name)
    recorded_run(repo, {"b": [(5, 7, "stop")]})
    before = tree(tmp_path)
    with pytest.raises(ValueError) as refused:
        export(repo, out, incremental=True)
    assert tree(tmp_path) == before
    line = str(refused.value)
    assert "\n" not in line and str(out / MANIFEST) in line and repr(name) in line


def test_a_link_inside_the_folder_is_a_shard_name_like_any_other(
    repo: Repository, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = first_export(repo, out).manifest
    (out / "train" / "alias.parquet").symlink_to(out / shard_files(first)[0])
    edit_manifest(out, file="train/alias.parquet")
    assert shard_files(export(repo, out, incremental=True).manifest)[0] == "train/alias.parquet"


def test_a_manifest_that_is_a_link_is_refused(repo: Repository, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first_export(repo, out)
    (out / MANIFEST).rename(tmp_path / "elsewhere.json")
    (out / MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="is a symbolic link, not a manifest an export wrote"):
        export(repo, out, incremental=True)
    assert tree(tmp_path) == before


def killed_first_export(clean: Path, out: Path) -> list[str]:
    """``out`` as an export killed before its manifest leaves it: the first complete shard
    of the export in ``clean``, the next one cut short in the private folder, and a
    temporary of an earlier version; the names."""
    private = out / ".tmp-export-0123456789abcdef"
    private.mkdir(parents=True)
    first, second = shard_files(json.loads((clean / MANIFEST).read_bytes()))[:2]
    (out / "train").mkdir()
    (out / first).write_bytes((clean / first).read_bytes())
    second_name = second.removeprefix("train/")
    (private / second_name).write_bytes((clean / second).read_bytes()[:100])
    (out / f".tmp-4242-{second_name}").write_bytes(b"PAR1")
    return sorted([".tmp-export-0123456789abcdef", f".tmp-4242-{second_name}", first])


def test_a_killed_first_export_is_written_again_from_the_start(
    repo: Repository, tmp_path: Path
) -> None:
    recorded_run(repo, {"a": [(300, 500, "stop")] * 60})  # 4 shards of the smallest size
    clean = export(repo, tmp_path / "clean", shard_bytes=2_000).manifest
    out = tmp_path / "out"
    left = killed_first_export(tmp_path / "clean", out)
    (out / "notes.txt").write_text("not the export's")
    before = tree(out)
    with pytest.raises(ValueError, match=r"'notes\.txt' is not a file an export writes"):
        export(repo, out, shard_bytes=2_000)
    assert tree(out) == before  # someone else's folder: nothing removed
    (out / "notes.txt").unlink()
    result = export(repo, out, shard_bytes=2_000)
    assert sorted(result.removed) == left
    assert comparable(result.manifest) == comparable(clean)
    # Each says where it is (how-to-load.txt) and when it was written (the manifest).
    differ = {MANIFEST: b"", "how-to-load.txt": b""}
    assert tree(out) | differ == tree(tmp_path / "clean") | differ


def test_stale_temporaries_are_removed_never_through_a_link_and_only_ours(
    repo: Repository, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first_export(repo, out)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "file").write_bytes(VICTIM)
    stale = {
        ".tmp-export-00000000000000ff": "dir",  # a killed pass's private folder
        ".tmp-17-train-00001.parquet": "file",  # temporaries of the versions before it
        ".tmp-17-train-00002.arrow": "file",
        ".tmp-18-manifest.json": "link",
        ".tmp-19-val-00000": "link",  # a save_to_disk folder's, as a link to a folder
        ".tmp-17-train-00001.parquet.bak": "file",  # not a name an export writes
    }
    for name, kind in stale.items():
        if kind == "dir":
            (out / name).mkdir()
            (out / name / "link").symlink_to(kept)
        elif kind == "file":
            (out / name).write_bytes(b"partial")
        else:
            (out / name).symlink_to(kept)
    result = export(repo, out, incremental=True)
    assert sorted(result.removed) == sorted(set(stale) - {".tmp-17-train-00001.parquet.bak"})
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] == [
        ".tmp-17-train-00001.parquet.bak"
    ]
    assert tree(kept) == {"file": VICTIM}


def test_a_second_export_into_a_folder_being_written_is_refused(
    repo: Repository, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    recorded_run(repo, {"a": [(4, 6, "stop")]})
    with Workspace(out, first=True), pytest.raises(ValueError, match="another export is writing"):
        export(repo, out)
    assert list(out.iterdir()) == []  # the first one's private folder, removed at its end
    assert shard_files(export(repo, out).manifest) == ["train/train-00000.parquet"]


def test_a_folder_given_as_a_link_is_written_where_it_points(
    repo: Repository, tmp_path: Path
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    manifest = first_export(repo, tmp_path / "link").manifest
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == sorted(
        [MANIFEST, "how-to-load.txt", "train"]
    )
    assert [f"train/{p.name}" for p in (tmp_path / "real" / "train").iterdir()] == shard_files(
        manifest
    )
