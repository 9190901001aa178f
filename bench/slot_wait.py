"""Threads waiting for a slot on a full server: tries (Redis script calls) per waiting
thread, with the worker's doubling pause against a fixed 50 ms one, side by side in one run.

Usage: python -m bench.slot_wait [--waiters 50] [--wait-s 2] [--rounds 3]
Services: --broker-url (default: this machine's Redis, db 10, flushed).
"""

from __future__ import annotations

import argparse
import threading

from core.settings import ServerSpec
from worker import servers
from worker.runner import worker_redis
from worker.servers import Router, Server
from worker.sglang import SGLangClient
from worker.slots import SlotPool


class CountedSlots(SlotPool):
    """The real slot pool, counting the tries made through it."""

    tries = 0
    _lock = threading.Lock()

    def try_acquire(self, server: str, limit: int) -> str | None:
        with self._lock:
            self.tries += 1
        return super().try_acquire(server, limit)


def tries_per_waiter(broker_url: str, waiters: int, wait_s: float, max_poll_s: float) -> float:
    """Tries per thread while ``waiters`` threads wait ``wait_s`` on a server held full."""
    servers.MAX_POLL_S = max_poll_s
    client = worker_redis(broker_url)
    client.flushdb()
    spec = ServerSpec(name="full", url="http://127.0.0.1:9")
    server = Server(spec, SGLangClient(spec, timeout_s=1), limit=1)
    slots = CountedSlots(client, lease_seconds=60)
    router = Router([server], slots)
    held = router.acquire(1.0)
    assert held is not None
    before = slots.tries
    threads = [threading.Thread(target=router.acquire, args=(wait_s,)) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    router.release(held)
    server.client.close()
    client.close()
    return (slots.tries - before) / waiters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--waiters", type=int, default=50)
    parser.add_argument("--wait-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/10")
    args = parser.parse_args()
    doubling = servers.MAX_POLL_S
    for round_ in range(1, args.rounds + 1):
        fixed = tries_per_waiter(args.broker_url, args.waiters, args.wait_s, 0.05)
        ours = tries_per_waiter(args.broker_url, args.waiters, args.wait_s, doubling)
        print(
            f"round {round_}: {args.waiters} waiters, {args.wait_s:g} s: tries per waiter "
            f"fixed 50 ms {fixed:.1f}, doubling to {doubling:g} s {ours:.1f}, "
            f"ratio {fixed / ours:.1f}"
        )


if __name__ == "__main__":
    main()
