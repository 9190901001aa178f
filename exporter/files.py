"""Files that appear whole or not at all, and what removes them: every call takes a folder's
descriptor and a name in it, and none follows a link at that name (``exporter.folder`` says
why: OUT may hold links planted by someone else)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def sync_tree(dir_fd: int, name: str) -> None:
    """Flush ``name`` (a file, or a folder and every file under it) to disk, before a
    rename makes it visible."""
    fd = os.open(name, _READ, dir_fd=dir_fd)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            for child in sorted(os.listdir(fd)):
                sync_tree(fd, child)
        os.fsync(fd)
    finally:
        os.close(fd)


# renameat2(2)'s flag that exchanges two names in one step (Linux 3.15).
_RENAME_EXCHANGE = 2


def swap(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """Exchange ``src`` and ``dst`` (both existing): ``dst`` becomes what ``src`` was and
    ``src`` the old ``dst``. In one step where the C library and the file system can
    (renameat2), so a reader of ``dst`` never finds it missing; otherwise the old ``dst``
    is renamed to ``src`` through a third name, and a kill between the two renames leaves
    ``dst`` missing for a moment (the next export says so)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        names = os.fsencode(src), os.fsencode(dst)
        if renameat2(src_fd, names[0], dst_fd, names[1], _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), dst)
    aside = f"{src}.old"
    os.rename(dst, aside, src_dir_fd=dst_fd, dst_dir_fd=src_fd)
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    os.rename(aside, src, src_dir_fd=src_fd, dst_dir_fd=src_fd)


def remove(dir_fd: int, name: str) -> None:
    """Remove ``name``: a link itself (never what it points to), a file, or a folder and
    what it holds (``shutil.rmtree`` by descriptors, which follows no link inside)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


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


def sha256_of_files(files: list[Path]) -> str:
    """The sha256 of the ``<sha256>  <name>`` lines of ``files`` (all in one folder)."""
    lines = [f"{sha256_file(f)}  {f.name}\n" for f in sorted(files)]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def size_of_files(files: list[Path]) -> int:
    """Bytes of ``files``."""
    return sum(f.stat().st_size for f in files)


def size_of(path: Path) -> int:
    """Bytes of a file, or of all files in a folder."""
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
