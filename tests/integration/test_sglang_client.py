"""The SGLang client gives each worker thread a connection of its own (encode/httpcore#1110:
a pool shared by threads can close a connection under another thread's request)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from core.settings import ServerSpec
from eaglegen.assets import special_ids
from eaglegen.sim import SimServer
from worker.sglang import SGLangClient

IDS = special_ids()


def test_each_thread_has_its_own_client_and_close_closes_them_all(sim: SimServer) -> None:
    client = SGLangClient(ServerSpec(name="sim", url=sim.url), timeout_s=30)
    seen: list[object] = []
    lock = threading.Lock()

    def ask(i: int) -> int:
        body = client.generate([IDS.bos, 100 + i, IDS.think_start], {"max_new_tokens": 4}, str(i))
        with lock:
            seen.append(client._local.client)
        return len(body["output_ids"])

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(64))) == [4] * 64
    assert len({id(c) for c in seen}) == 8  # one per thread, reused for its next requests
    clients = list(client._clients)
    client.close()
    assert all(c.is_closed for c in clients)


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
