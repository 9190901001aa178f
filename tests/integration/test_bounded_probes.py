"""A worker's reads of a server's probes and metrics are bounded in size and in total time
(issue 27), against a real HTTP server that answers too much or drips its answer: the read
stops at its cap, or fails by its deadline, instead of filling memory or hanging."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from core import bounded
from core.bounded import AnswerTooLarge, AnswerTooSlow
from core.settings import ServerSpec
from tests.hostile import Answer, Behaviour, hostile_server
from worker.servers import Server, probe
from worker.sglang import SGLangClient

MIB = bounded.MIB
HUGE = 64 * MIB  # what a server offers: sixteen times the /metrics cap
# A hang detector, not a measure: a bounded read fails within its deadline (1 s here).
HANG_S = 20


def huge(chunk: bytes = b"#" * MIB) -> Answer:
    """An answer of HUGE bytes with no Content-Length, sent as fast as it is read."""
    return Answer(stream=itertools.repeat(chunk, HUGE // len(chunk)))


def dripping() -> Answer:
    """A body that never ends, a byte every 0.2 s: each read gets one before any per-read
    timeout."""
    return Answer(stream=itertools.repeat(b"#"), pause_s=0.2)


def dripping_head() -> Answer:
    """The status line and headers themselves dripped, and never finished."""
    head = iter(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    return Answer(
        stream=(bytes([c]) for c in itertools.chain(head, itertools.repeat(ord("a")))),
        pause_s=0.2,
        raw=True,
    )


def declared(length: int) -> Answer:
    """Headers that declare ``length`` bytes, then a body of 16 MiB that does not matter."""
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n".encode()
    return Answer(stream=itertools.chain([head], itertools.repeat(b"{" * MIB, 16)), raw=True)


Serve = Callable[[dict[str, Callable[[], Answer]]], tuple[SGLangClient, Behaviour]]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """A hostile server answering GETs of the given paths as told; a worker's client on it."""
    with hostile_server(behaviour := Behaviour()) as url:
        client = SGLangClient(ServerSpec(name="hostile", url=url), timeout_s=30)

        def start(answers: dict[str, Callable[[], Answer]]) -> tuple[SGLangClient, Behaviour]:
            behaviour.get = lambda path: answers[path]() if path in answers else None
            return client, behaviour

        yield start
        client.close()


def test_a_huge_metrics_answer_is_read_up_to_its_cap_only(serve: Serve) -> None:
    client, behaviour = serve({"/metrics": huge})
    with pytest.raises(AnswerTooLarge, match=r"^/metrics: answer over 4 MiB$") as refused:
        client.get("/metrics", 10.0)
    cap = bounded.CAPS["/metrics"]
    # One read's worth past the cap at most (httpcore reads 64 KiB at a time).
    assert cap < refused.value.received <= cap + MIB
    # The connection was dropped: the server could not send much more than the socket
    # buffers hold, nowhere near what it had.
    assert behaviour.client_gone.wait(HANG_S)
    assert behaviour.bytes_sent < HUGE // 2
    # The pool is not poisoned: the next probe is answered.
    assert client.get("/health", 10.0).status_code == 200


def test_a_model_info_declared_huge_is_refused_unread(serve: Serve) -> None:
    client, _ = serve({"/get_model_info": lambda: declared(400_000_000)})
    with pytest.raises(AnswerTooLarge, match="400000000 bytes declared, over 1 MiB") as refused:
        client.get("/get_model_info", 10.0)
    assert refused.value.received == 0


@pytest.mark.timeout(HANG_S)
def test_a_dripping_metrics_body_fails_by_its_total_deadline(serve: Serve) -> None:
    client, _ = serve({"/metrics": dripping})
    with pytest.raises(AnswerTooSlow, match=r"^/metrics: no full answer within 1 s$"):
        client.get("/metrics", 1.0)


@pytest.mark.timeout(HANG_S)
def test_a_health_probe_with_dripping_headers_says_the_server_is_down(serve: Serve) -> None:
    """The worker's health probe (worker.servers, which handles httpx's errors) gets one of
    those errors, not a hang, from a server that never finishes its headers."""
    client, _ = serve({"/health_generate": dripping_head})
    server = Server(spec=client.server, client=client, limit=8)
    reason = probe(server, 1.0)
    assert reason == "AnswerTooSlow: /health_generate: no full answer within 1 s"


def test_eaglegen_plan_reads_a_servers_facts_within_their_caps(serve: Serve) -> None:
    from eaglegen.cli.plan import _get

    # The bounded client (the deadline is proven above for every caller of it).
    client, _ = serve({"/metrics": huge})
    metrics, why = _get(client.server.url, "/metrics")
    assert metrics is None and why == "AnswerTooLarge: /metrics: answer over 4 MiB"
