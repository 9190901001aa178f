"""Folding SGLang's streamed answer into one body: chunking, both id modes, stalls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from worker.retry import AttemptError
from worker.stream import Assembler, events

IDS = [11, 12, 13, 14, 4]


def chunk(ids: list[int], total: int, finish: Any = None) -> bytes:
    body = {
        "text": "",
        "output_ids": ids,
        "meta_info": {"id": "7", "completion_tokens": total, "finish_reason": finish},
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def stream(cumulative: bool) -> bytes:
    parts = []
    for end in (2, 4, 5):
        ids = IDS[:end] if cumulative else IDS[end - (2 if end < 5 else 1) : end]
        parts.append(chunk(ids, end, {"type": "stop", "matched": 4} if end == 5 else None))
    return b"".join(parts) + b"data: [DONE]\n\n"


def fold(raw: bytes, piece: int = 7) -> dict[str, Any]:
    """Feed ``raw`` in pieces of ``piece`` bytes, as a socket would."""
    assembler = Assembler()
    pieces = (raw[i : i + piece] for i in range(0, len(raw), piece))
    for data in events(pieces, max_event_bytes=1 << 20, stall_s=60):
        assembler.add(data)
    return assembler.answer()


@pytest.mark.parametrize("cumulative", [True, False])
def test_both_id_modes_fold_into_the_whole_answer(cumulative: bool) -> None:
    body = fold(stream(cumulative))
    assert body["output_ids"] == IDS
    assert body["meta_info"]["completion_tokens"] == 5
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 4}


def test_an_event_split_anywhere_is_read_whole() -> None:
    for piece in (1, 3, 64, 10_000):
        assert fold(stream(False), piece)["output_ids"] == IDS


def test_ids_that_disagree_with_the_count_are_refused() -> None:
    raw = chunk([11, 12], 2) + chunk([13], 5) + b"data: [DONE]\n\n"
    with pytest.raises(AttemptError, match="disagree with completion_tokens=5"):
        fold(raw)


def test_a_stream_cut_before_done_is_a_retryable_transport_failure() -> None:
    with pytest.raises(AttemptError, match="ended before its last chunk") as info:
        fold(chunk([11, 12], 2))
    assert info.value.retryable and info.value.transport


def test_an_error_chunk_is_the_servers_refusal() -> None:
    raw = b'data: {"error": {"message": "too long"}}\n\ndata: [DONE]\n\n'
    with pytest.raises(AttemptError, match="server refused the request: too long") as info:
        fold(raw)
    assert not info.value.retryable


def test_bytes_without_a_complete_event_are_a_stall() -> None:
    # A drip: a byte at a time, each well within any read timeout, never a whole event.
    now = [0.0]

    def clock() -> float:
        return now[0]

    def drip() -> Iterator[bytes]:
        for byte in chunk(IDS, 5):
            now[0] += 1.0
            yield bytes([byte])

    with pytest.raises(AttemptError, match="no streamed chunk for over 30 s") as info:
        list(events(drip(), max_event_bytes=1 << 20, stall_s=30, clock=clock))
    assert info.value.retryable


def test_an_event_beyond_the_size_limit_is_refused_unread() -> None:
    endless = (b"data: " + b"[" * 1000 for _ in range(10_000))
    with pytest.raises(AttemptError, match="over max_response_bytes=65536"):
        list(events(endless, max_event_bytes=65536, stall_s=60))
