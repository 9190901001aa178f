"""The export folder (OUT): what in it an export writes, what a killed export leaves, and
the private folder one pass writes in.

A pass creates every file inside a folder of its own, ``.tmp-export-<64 random bits>``,
made in OUT with mode 0700: a name nobody can plant a link at ahead of time (the pid an
earlier version put in its temporary names was guessable). Each file is opened relative to
that folder's descriptor with O_CREAT|O_EXCL|O_NOFOLLOW, and renamed into OUT when complete,
relative to OUT's descriptor: a rename onto a link at the final name replaces the link, so
nothing is ever written through one. OUT is resolved once, when the pass opens it: a link
at OUT itself is followed (the user named it), a later change of what it points to is not.

A pass holds an exclusive lock (``flock``) on OUT: a second export into the same folder is
refused rather than interleaved, and any temporary the pass finds was left by an export
that ended. It removes those (never through a link), and, in a folder without a manifest,
the complete shards a killed first export renamed into place: that export never finished,
so the pass writes it again from the start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from exporter.files import TMP_PREFIX, remove, swap, sync_tree
from exporter.split import TRAIN, VAL

MANIFEST = "manifest.json"
# What the export says about loading it, beside the manifest (``exporter.layouts``).
USAGE = "how-to-load.txt"
PRIVATE_PREFIX = f"{TMP_PREFIX}export-"
_PRIVATE = re.compile(rf"{re.escape(PRIVATE_PREFIX)}[0-9a-f]{{16}}")
# A shard's name (the suffixes of writers.SUFFIXES; none: a save_to_disk folder).
SHARD = re.compile(rf"(?P<split>{TRAIN}|{VAL})-(?P<index>\d{{5,}})(?P<suffix>\.parquet|\.jsonl)?")
# The temporaries of exports before the private folder: ``.tmp-<pid>-<final name>``, and
# ``.arrow`` after it for the stream file of a save_to_disk shard.
_PID_TEMPORARY = re.compile(
    rf"{re.escape(TMP_PREFIX)}\d+-({re.escape(MANIFEST)}|{SHARD.pattern})(\.arrow)?"
)
# What `datasets` writes in a save_to_disk folder.
_SAVED = re.compile(r"data-\d{5}-of-\d{5}\.arrow|dataset_info\.json|state\.json")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one an export writes under before a file is complete."""
    return bool(_PRIVATE.fullmatch(name) or _PID_TEMPORARY.fullmatch(name))


def leftovers(out: Path) -> list[str]:
    """What an export killed before its manifest left in ``out`` (a folder without one):
    its temporaries and complete shards. A ValueError names the first entry no export
    writes: that folder is someone else's."""
    fd = _open_folder(out)
    try:
        return _leftovers(fd, out)
    finally:
        os.close(fd)


def _leftovers(fd: int, out: Path) -> list[str]:
    names = sorted(os.listdir(fd))
    found = []
    for name in names:
        if is_temporary(name) or name == USAGE:
            found.append(name)
        elif _is_split(fd, name):
            inner = _open_folder(name, dir_fd=fd, follow=False)
            try:
                found += [f"{name}/{n}" for n in sorted(os.listdir(inner))]
            finally:
                os.close(inner)
            found.append(name)  # the folder, emptied by then
        else:
            raise ValueError(
                f"{out} is not empty and holds no {MANIFEST} ({name!r} is not a file an "
                "export writes): choose an empty folder"
            )
    return found


def _is_shard(fd: int, name: str, split: str) -> bool:
    """Whether ``name`` (in ``split``'s folder) is a complete shard of ``split`` as an export
    writes one: a file (not a link), or a save_to_disk folder holding only what `datasets`
    writes there."""
    match = SHARD.fullmatch(name)
    if match is None or match["split"] != split:
        return False
    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    if match["suffix"]:
        return stat.S_ISREG(mode)
    return stat.S_ISDIR(mode) and _is_saved(fd, name)


def _is_saved(fd: int, name: str) -> bool:
    """Whether the folder ``name`` holds only files `datasets` writes in a save_to_disk."""
    inner = _open_folder(name, dir_fd=fd, follow=False)
    try:
        return all(_is_file(inner, n) and _SAVED.fullmatch(n) for n in os.listdir(inner))
    finally:
        os.close(inner)


def _is_file(fd: int, name: str) -> bool:
    return stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)


def _is_split(fd: int, name: str) -> bool:
    """Whether ``name`` is a split's folder as an export writes it: shards of that split,
    its one JSON Lines file, or a save_to_disk Dataset (``exporter.layouts``)."""
    if name not in (TRAIN, VAL):
        return False
    if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
        return False
    if _is_saved(fd, name):
        return True
    inner = _open_folder(name, dir_fd=fd, follow=False)
    try:
        return all(
            _is_shard(inner, n, name) or (n == f"{name}.jsonl" and _is_file(inner, n))
            for n in os.listdir(inner)
        )
    finally:
        os.close(inner)


def _open_folder(path: Path | str, *, dir_fd: int | None = None, follow: bool = True) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return os.open(path, flags, dir_fd=dir_fd)


class Workspace:
    """One pass's hold on OUT: the lock, the private folder it writes in, and what it
    removed on the way in (``removed``: names in OUT)."""

    def __init__(self, out: Path, *, first: bool) -> None:
        """Open ``out`` (made if missing) and clean it up; ``first``: there is no manifest,
        so the shards of a killed export are removed too."""
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self._splits: dict[str, int] = {}
        self._out_fd = _open_folder(out)
        try:
            _lock(self._out_fd, out)
            self.removed = self._clean(first=first)
            self._name, self._fd = _make_private(self._out_fd)
        except BaseException:
            os.close(self._out_fd)
            raise

    def __enter__(self) -> Workspace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _clean(self, *, first: bool) -> list[str]:
        names = os.listdir(self._out_fd)
        if first and MANIFEST in names:
            raise ValueError(
                f"{self.out} holds a {MANIFEST} now (another export wrote it since this one "
                "started): run the export again"
            )
        stale = (
            _leftovers(self._out_fd, self.out)
            if first
            else sorted(n for n in names if is_temporary(n))
        )
        for name in stale:
            remove(self._out_fd, name)
        return [n for n in stale if n not in (TRAIN, VAL)]

    def names(self, split: str) -> list[str]:
        """The names in ``split``'s folder in OUT (none when it does not exist)."""
        fd = self._split(split, make=False)
        return [] if fd is None else os.listdir(fd)

    def _split(self, split: str, *, make: bool) -> int | None:
        """The descriptor of ``split``'s folder in OUT, made if ``make``; a link there is
        refused (mkdir never follows one, the open does not either)."""
        if split not in (TRAIN, VAL):
            raise ValueError(f"no split {split!r}")
        if split not in self._splits:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(split, 0o777, dir_fd=self._out_fd)
            try:
                self._splits[split] = _open_folder(split, dir_fd=self._out_fd, follow=False)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ValueError(
                    f"{self.out / split} is not a folder an export made (a link, or a file): "
                    "choose another folder"
                ) from exc
        return self._splits[split]

    def mkdir(self, name: str) -> None:
        """A folder ``name`` in the private folder."""
        os.mkdir(name, 0o700, dir_fd=self._fd)

    def create(self, name: str) -> BinaryIO:
        """A new file ``name`` in the private folder (or in a folder made there), open for
        writing."""
        return os.fdopen(os.open(name, _CREATE, 0o666, dir_fd=self._fd), "wb")

    def read(self, split: str, name: str) -> BinaryIO:
        """``name`` in ``split``'s folder in OUT, open for reading (never through a link)."""
        fd = self._split(split, make=False)
        if fd is None:
            raise FileNotFoundError(f"{self.out / split} is missing")
        return os.fdopen(os.open(name, _READ, dir_fd=fd), "rb")

    def path(self, name: str) -> Path:
        """``name`` in the private folder as a path, for what opens files by path
        (`datasets`, checksums): an OSError if the folder there is no longer this pass's
        (renamed and replaced by someone who may write in OUT)."""
        folder = self.out / self._name
        there, own = os.stat(folder, follow_symlinks=False), os.fstat(self._fd)
        if (there.st_dev, there.st_ino) != (own.st_dev, own.st_ino):
            raise OSError(f"{folder} was replaced during the export: run it again")
        return folder / name

    def published(self, split: str) -> Path:
        """``split``'s folder in OUT as a path, for `datasets` to read (checked to be the
        folder this pass holds open, not a link put there since)."""
        fd = self._split(split, make=False)
        folder = self.out / split
        if fd is None:
            raise FileNotFoundError(f"{folder} is missing")
        there, own = os.stat(folder, follow_symlinks=False), os.fstat(fd)
        if (there.st_dev, there.st_ino) != (own.st_dev, own.st_ino):
            raise OSError(f"{folder} was replaced during the export: run it again")
        return folder

    def publish(self, name: str, split: str | None = None, *, as_name: str | None = None) -> None:
        """Move the complete ``name`` (a file or a folder) from the private folder into OUT,
        or into ``split``'s folder there, under the same name or ``as_name``, durably:
        synced before the rename makes it visible."""
        into = self._out_fd if split is None else self._split(split, make=True)
        assert into is not None
        sync_tree(self._fd, name)
        os.replace(name, as_name or name, src_dir_fd=self._fd, dst_dir_fd=into)
        os.fsync(into)

    def install(self, split: str) -> None:
        """Put the private folder's complete ``split`` folder in OUT in place of the one
        there (swapped in one step where the file system can; the old one is left in the
        private folder, removed at the end of the pass)."""
        sync_tree(self._fd, split)
        old = self._splits.pop(split, None)
        if old is not None:
            os.close(old)
        try:
            os.stat(split, dir_fd=self._out_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(split, split, src_dir_fd=self._fd, dst_dir_fd=self._out_fd)
        else:
            swap(self._fd, split, self._out_fd, split)
        os.fsync(self._out_fd)

    def write(self, name: str, data: bytes) -> None:
        """Replace ``name`` in OUT by ``data``: a reader sees the old or the new, never part."""
        with self.create(name) as handle:
            handle.write(data)
        self.publish(name)

    def write_in(self, split: str, name: str, data: bytes) -> None:
        """Replace ``name`` in ``split``'s folder in OUT by ``data``, as ``write`` does."""
        staged = f"{split}-{name}"
        with self.create(staged) as handle:
            handle.write(data)
        self.publish(staged, split, as_name=name)

    def discard(self, name: str) -> None:
        """Remove ``name`` from the private folder."""
        remove(self._fd, name)

    def close(self) -> None:
        """Remove the private folder and release OUT."""
        try:
            # What is left in it is incomplete; if this fails, the next export removes it.
            with contextlib.suppress(OSError):
                remove(self._out_fd, self._name)
        finally:
            for fd in self._splits.values():
                os.close(fd)
            os.close(self._fd)
            os.close(self._out_fd)


def _lock(fd: int, out: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(
            f"another export is writing to {out}: wait for it to end, or choose another folder"
        ) from None


def _make_private(out_fd: int) -> tuple[str, int]:
    """A new folder only this pass writes in (mode 0700; mkdir never follows a link at its
    name), and its descriptor."""
    while True:
        name = PRIVATE_PREFIX + secrets.token_hex(8)
        try:
            os.mkdir(name, 0o700, dir_fd=out_fd)
        except FileExistsError:  # 64 random bits: never in practice
            continue
        return name, _open_folder(name, dir_fd=out_fd, follow=False)
