"""The heartbeat record: what a worker writes is what every reader parses, and a record
that is not a heartbeat is left out, never an error in `status`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from core.heartbeat import Heartbeat, ServerBeat

BEAT = Heartbeat(
    worker="gpu-a-1",
    nodename="gpu-a-1@host",
    host="host",
    pid=41,
    ts=1_700_000_000.25,
    in_flight=3,
    threads=64,
    consuming=True,
    db_pool=8,
    servers={"gpu-a": ServerBeat(True, None, 3, 48, True, "moonshotai/Kimi-K2.5")},
    unserved_runs={"other": "no server serves qwen"},
    numa_node=1,
    cpus="48-95",
    membind="preferred",
)


def test_a_record_round_trips_through_its_json() -> None:
    assert Heartbeat.from_json(BEAT.to_json()) == BEAT
    assert Heartbeat.from_json(BEAT.to_json().encode()) == BEAT


def test_a_server_seen_to_change_model_round_trips_and_older_records_still_parse() -> None:
    swapped = ServerBeat(True, None, 0, 48, True, "org/model-b", "org/model-a", 1_700_000_000.5)
    beat = replace(BEAT, servers={"gpu-a": swapped})
    assert Heartbeat.from_json(beat.to_json()) == beat
    # A worker of before the change writes neither field: it never saw a model change.
    document = json.loads(BEAT.to_json())
    for field in ("previous_model", "model_changed_at"):
        del document["servers"]["gpu-a"][field]
    parsed = Heartbeat.from_json(json.dumps(document))
    assert parsed is not None and parsed.servers["gpu-a"] == BEAT.servers["gpu-a"]


def test_an_unpinned_worker_of_no_servers_round_trips() -> None:
    bare = Heartbeat("w", "w@h", "h", 1, 0.0, 0, 16, False, 4)
    document = json.loads(bare.to_json())
    assert document["servers"] == {} and document["numa_node"] is None
    assert Heartbeat.from_json(bare.to_json()) == bare


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1, 2]",
        json.dumps({"worker": "w"}),  # fields missing
        json.dumps({**json.loads(BEAT.to_json()), "pid": "forty-one"}),
        json.dumps({**json.loads(BEAT.to_json()), "servers": {"gpu-a": {"healthy": True}}}),
    ],
)
def test_a_record_that_is_not_a_heartbeat_is_none(raw: str) -> None:
    assert Heartbeat.from_json(raw) is None
