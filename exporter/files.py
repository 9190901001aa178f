"""Files that appear whole or not at all: written under a temporary name, synced, renamed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def temporary(final: Path) -> Path:
    """Where ``final`` is written before it is complete: a hidden name in the same folder
    (a rename within one file system is atomic), unique to this process."""
    return final.with_name(f"{TMP_PREFIX}{os.getpid()}-{final.name}")


def sync_file(path: Path) -> None:
    """Flush ``path``'s data to disk (before a rename makes it visible)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """Flush every file under ``path``, and ``path`` itself."""
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            sync_file(child)
    sync_file(path)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` (a file or a folder) to ``final``, durably."""
    sync_tree(tmp)
    os.replace(tmp, final)
    sync_file(final.parent)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data``: a reader sees the old or the new content, never part."""
    tmp = temporary(path)
    try:
        tmp.write_bytes(data)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    """A file's sha256; for a folder, the sha256 of the ``<sha256>  <relative path>`` lines
    of its files in sorted order (what ``sha256sum`` prints there, sorted by path)."""
    if not path.is_dir():
        return sha256_file(path)
    lines = [
        f"{sha256_file(f)}  {f.relative_to(path).as_posix()}\n"
        for f in sorted(path.rglob("*"))
        if f.is_file()
    ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def size_of(path: Path) -> int:
    """Bytes of a file, or of all files in a folder."""
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
