"""The SGLang client gives each worker thread a connection of its own (encode/httpcore#1110:
a pool shared by threads can close a connection under another thread's request)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from core.settings import ServerSpec
from eaglegen.assets import special_ids
from eaglegen.sim import SimServer
from tests.hostile import Answer, Behaviour, good, hostile_server
from worker.retry import AttemptError
from worker.sglang import SGLangClient

IDS = special_ids()


def test_each_thread_keeps_its_own_connection_and_close_closes_them_all(
    sim: SimServer,
) -> None:
    # No connection is ever used by two threads: nothing can close one under another
    # thread's request (encode/httpcore#1110, the hangs of a shared pool).
    client = SGLangClient(ServerSpec(name="sim", url=sim.url), timeout_s=30)
    users: dict[tuple[int, int], set[int]] = {}  # (connection, local port) -> threads
    lock = threading.Lock()

    def ask(i: int) -> int:
        body = client.generate([IDS.bos, 100 + i, IDS.think_start], {"max_new_tokens": 4}, str(i))
        connection = client._local.connection
        key = (id(connection), connection.sock.getsockname()[1])
        with lock:
            users.setdefault(key, set()).add(threading.get_ident())
        return len(body["output_ids"])

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(64))) == [4] * 64
    # One connection per thread, kept alive for its next requests: 8 sockets for 64 requests.
    assert len(users) == 8
    assert all(len(threads) == 1 for threads in users.values()), users
    connections = list(client._open)
    client.close()
    assert len(connections) == 8 and all(c.sock is None for c in connections)


def test_many_threads_at_once_all_get_their_answer(sim: SimServer) -> None:
    # 256 threads, 4 requests each, as a busy worker sends them; none may wait for an answer
    # on a connection another thread closed (they did, now and then, with one shared pool).
    client = SGLangClient(ServerSpec(name="sim", url=sim.url), timeout_s=60)

    def ask(i: int) -> float:
        start = time.monotonic()
        for k in range(4):
            client.generate([IDS.bos, 200 + i, 7 + k, IDS.think_start], {"max_new_tokens": 8}, "r")
        return time.monotonic() - start

    try:
        with ThreadPoolExecutor(256) as pool:
            slowest = max(pool.map(ask, range(256)))
    finally:
        client.close()
    assert slowest < 45, f"a thread took {slowest:.0f} s for 4 short answers"


def _dripping(request: dict[str, Any]) -> Answer:
    return Answer(good(request).body, pause_s=0.05)


def _endless(request: dict[str, Any]) -> Answer:
    return Answer(stream=iter(lambda: b"[" * 65536, b""))


@pytest.mark.parametrize(
    ("answer", "reason"),
    [(_dripping, "a stalled or dripping server"), (_endless, "over max_response_bytes")],
    ids=["dripping", "endless"],
)
def test_a_refused_answer_closes_its_socket_at_once(
    answer: Callable[[dict[str, Any]], Answer], reason: str
) -> None:
    # The test server answers with Connection: close, so the response owns the socket: the
    # client must close it as it refuses the answer, not leave it open until the garbage
    # collector finds it (the error is kept here, as a worker's task keeps it while it
    # reports the failure; the server's next write then fails).
    behaviour = Behaviour(answer=answer)
    with hostile_server(behaviour) as url:
        client = SGLangClient(
            ServerSpec(name="h", url=url),
            timeout_s=30,
            stall_timeout_s=0.5,
            max_response_bytes=1 << 20,
        )
        try:
            with pytest.raises(AttemptError) as refused:
                client.generate([IDS.bos, 5], {"max_new_tokens": 4}, "1")
            assert behaviour.client_gone.wait(5), "the refused answer's socket is still open"
            assert not client._open
        finally:
            client.close()
    assert reason in str(refused.value)
