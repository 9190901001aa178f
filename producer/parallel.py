"""Where batches are prepared: in this process, or in worker processes on every core.

Rendering the chat template (jinja) and building jobs is Python work that holds the GIL, so
threads cannot spread it over cores; worker processes can. Workers fork from this process
while it has no other thread yet (Linux): they start in milliseconds and use this process's
own Templater. Otherwise they come from a fork server and each builds its Templater from the
same tokenizer files and template kwargs. All run the same `prepare`, so jobs and rejections
are the same wherever a batch went. Results come back as futures that the caller turns into
batches with `Preparer.result`, in submission order (a worker's batch waits in a spool file:
see `Preparer._start_pool`).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from producer.prepare import Prepared, prepare, render, tokenize
from producer.rows import RawRow, RowError, decode_line
from producer.template import Templater

# A pool from the fork server costs over a second of CPU (it imports transformers, each worker
# loads the tokenizer), repaid only by long inputs: without an explicit worker count it starts
# after this many rows, or at once for inputs of AUTO_START_BYTES or more (about as many short
# chat rows in JSONL). Workers forked from this process cost milliseconds: FORK_START_BYTES.
AUTO_START_ROWS = 32_768
AUTO_START_BYTES = 8 << 20
FORK_START_BYTES = 1 << 20
# Imported once by the fork server, so each worker forked from it starts in milliseconds and
# shares these modules' memory. "__main__" too: each worker would otherwise run the main
# script again (multiprocessing's "safe importing of main"), which for the `eaglegen` console
# script imported the whole CLI in every worker. producer.forkserver comes last: it freezes
# the server's heap so that the workers' collections leave those pages shared.
_PRELOAD = (
    "__main__",
    "producer.parallel",
    "transformers.models.auto.tokenization_auto",
    "producer.forkserver",
)

# This process's Templater and spool folder when it is a pool worker (set by the initializer).
_worker_templater: Templater | None = None
_worker_spool: Path | None = None


def can_fork() -> bool:
    """Whether workers may fork from this process now: Linux, and no other thread running.

    A fork copies only the calling thread; a lock another thread held at that instant stays
    locked in the child for good. (The tokenizer's own Rust threads are idle between calls,
    and the tokenizers library turns them off in a forked child.)
    """
    return sys.platform.startswith("linux") and threading.active_count() == 1


def default_workers() -> int:
    """Worker processes for this machine: one per usable core, none on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores if cores is not None and cores > 1 else 0


class Preparer:
    """Prepares batches here (``workers=0``) or in a pool of ``workers`` processes.

    Here, a batch is rendered in the caller's thread and tokenized on a helper thread (the
    Rust tokenizer releases the GIL), so the next batch renders meanwhile; in the pool, each
    worker does both. With ``start_after_rows``, the pool starts only once that many rows were
    seen, and batches are prepared here until a worker has loaded its tokenizer, so short
    inputs never pay for the pool and long ones overlap its start-up with work. Without it,
    the pool starts at once and every batch waits for it.
    """

    def __init__(
        self, templater: Templater, workers: int = 0, *, start_after_rows: int | None = None
    ) -> None:
        self.templater = templater
        self.workers = workers
        self.start_after_rows = start_after_rows
        self._rows = 0
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="enqueue-tokenize")
        self._pool: ProcessPoolExecutor | None = None
        self._forked = False
        self._ready: list[Future[None]] = []
        self._spool: Path | None = None

    @property
    def ahead(self) -> int:
        """Batches to submit before waiting for the oldest: two per worker, else one."""
        if self._pool is not None:
            return 2 * self.workers
        return 1 if self.templater.is_fast else 0

    def start(self) -> None:
        """Start the worker processes now, not at the first batch.

        Called before this process starts threads (progress bars, the writer), the workers
        fork from it and are ready at once.
        """
        if self._pool is None and self.workers > 0:
            self._start_pool()

    @property
    def forked(self) -> bool:
        """Whether the workers forked from this process (else: from a fork server)."""
        return self._forked

    def submit(
        self,
        batch: list[RawRow],
        max_context_len: int | None,
        max_new_tokens: int,
        turns: str = "last",
    ) -> Future[Prepared] | Future[str]:
        """Start preparing ``batch``; the future holds its jobs and rejections."""
        self._rows += len(batch)
        auto = self.start_after_rows is not None
        long_enough = not auto or self._rows > (self.start_after_rows or 0)
        if self._pool is None and self.workers > 0 and long_enough:
            self._start_pool()
        if self._pool is not None and (not auto or any(r.done() for r in self._ready)):
            wire = [_to_wire(raw) for raw in batch]
            return self._pool.submit(_prepare_batch, wire, max_context_len, max_new_tokens, turns)
        if not self.templater.is_fast:  # a Python tokenizer holds the GIL: nothing to overlap
            done: Future[Prepared] = Future()
            done.set_result(prepare(self.templater, batch, max_context_len, max_new_tokens, turns))
            return done
        rendered = render(self.templater, batch, turns)
        return self._tokenizing.submit(
            tokenize, self.templater, rendered, max_context_len, max_new_tokens
        )

    def result(self, future: Future[Prepared] | Future[str]) -> Prepared:
        """The prepared batch of ``future``; a worker's comes from its spool file."""
        value = future.result()  # re-raises a failed batch, or BrokenProcessPool
        if isinstance(value, Prepared):
            return value
        spooled = Path(value)
        with spooled.open("rb") as handle:
            prepared: Prepared = pickle.load(handle)  # our own worker wrote it, just now
        spooled.unlink()
        return prepared

    def close(self) -> None:
        """Stop the helpers; batches not yet started are dropped (the caller is done)."""
        self._tokenizing.shutdown(wait=True, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None

    def __enter__(self) -> Preparer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_pool(self) -> None:
        # Workers hand batches back through files here; the executor's pipe carries only
        # their names. A worker killed while writing a large result into that pipe (an OOM
        # kill) left half a message there, and CPython's executor then waited for the rest
        # forever; a short message is written whole, and a death before it is noticed.
        self._spool = Path(tempfile.mkdtemp(prefix="eaglegen-spool-"))
        if can_fork():
            self._start_forked_pool(self._spool)
            return
        templater = self.templater
        self._pool = ProcessPoolExecutor(
            self.workers,
            mp_context=_context(),
            initializer=_start_worker,
            initargs=(
                templater.path,
                templater.trust_remote_code,
                templater.template_kwargs,
                templater.named_family,  # its think pair decides what opens reasoning
                self._spool,
            ),
        )
        if self.start_after_rows is not None:  # a no-op task per worker: done once it is ready
            self._ready = [self._pool.submit(_ready) for _ in range(self.workers)]

    def _start_forked_pool(self, spool: Path) -> None:
        """Fork the workers now; they adopt this process's Templater (nothing to reload)."""
        self._pool = ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_adopt_templater,
            initargs=(self.templater, spool),  # inherited by the fork, never pickled
        )
        # One tokenizer thread per worker (see _start_worker). Set before the fork, since
        # tokenizers checks it then: unset, it warns in every child that it disables them.
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            # With the fork method, the executor forks all its workers at the first submit,
            # before it starts its own threads.
            self._ready = [self._pool.submit(_ready)]
        finally:
            if saved is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        self._forked = True


def _context() -> BaseContext:
    """A fork server where there is one, else spawn.

    Workers never fork from this process, which has threads (the writer, the tokenizer's)
    that a fork would copy mid-flight.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))  # no effect once the server runs
    return context


def _start_worker(
    path: Path,
    trust_remote_code: bool,
    template_kwargs: dict[str, Any],
    family: str | None,
    spool: Path,
) -> None:
    """Pool initializer of fork-server workers: build this worker's Templater once."""
    # One tokenizer thread per worker: the workers already fill the cores, and idle threads
    # of the tokenizer's own pool would spin on them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    templater = Templater(
        path, trust_remote_code=trust_remote_code, template_kwargs=template_kwargs, family=family
    )
    _become_worker(templater, spool)


def _adopt_templater(templater: Templater, spool: Path) -> None:
    """Pool initializer of forked workers: use the Templater the fork copied."""
    _become_worker(templater, spool)


def _become_worker(templater: Templater, spool: Path) -> None:
    global _worker_templater, _worker_spool
    _worker_templater, _worker_spool = templater, spool
    # Ctrl-C reaches the whole process group; the main process decides and shuts the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A main process killed outright (SIGTERM, SIGKILL) never shuts the pool down, and the
    # worker would wait for tasks forever: leave when it is gone.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_after, args=(parent,), daemon=True).start()
    # The worker's long-lived objects (transformers, the tokenizer) leave the collector's
    # full passes, which templating's cyclic garbage otherwise triggers again and again; in a
    # forked worker this also keeps the pages it shares with its parent shared.
    gc.freeze()


def _exit_after(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()
    if _worker_spool is not None:  # the parent that would have removed it is gone
        shutil.rmtree(_worker_spool, ignore_errors=True)
    os._exit(1)


def _ready() -> None:
    """A no-op task: done once some worker has run its initializer."""


def _prepare_batch(
    batch: list[_WireRow], max_context_len: int | None, max_new_tokens: int, turns: str
) -> str:
    """Pool task: prepare one batch with this worker's Templater; the spool file's name."""
    assert _worker_templater is not None, "the pool initializer did not run"
    rows = [_from_wire(row) for row in batch]
    prepared = prepare(_worker_templater, rows, max_context_len, max_new_tokens, turns)
    descriptor, name = tempfile.mkstemp(dir=_worker_spool, suffix=".batch")
    with os.fdopen(descriptor, "wb") as handle:
        pickle.dump(prepared, handle, protocol=pickle.HIGHEST_PROTOCOL)
    return name


# A RawRow as sent to a worker: RowError's constructor takes (reason, detail), which the
# default pickling of exceptions does not pass back, so the error travels as its two parts.
# JSON Lines rows travel undecoded: bytes pickle far cheaper than the objects they hold.
_WireRow = tuple[int, Any, str | None, str, str, bytes | None]


def _to_wire(raw: RawRow) -> _WireRow:
    error = raw.error
    if error is None:
        return (raw.index, raw.value, None, "", raw.excerpt, raw.line)
    return (raw.index, raw.value, error.reason, error.detail, raw.excerpt, raw.line)


def _from_wire(row: _WireRow) -> RawRow:
    index, value, reason, detail, excerpt, line = row
    if line is not None:
        return decode_line(index, line)  # decoded at once: one row object, not two
    error = None if reason is None else RowError(reason, detail)
    return RawRow(index, value, error, excerpt)
