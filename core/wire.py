"""The one message format: a Celery task message in kombu's Redis envelope, built and parsed.

A message is ``generate(job_id=N)``: Celery's task-message protocol 2, JSON-serialized, in
the envelope kombu's Redis transport LPUSHes onto the queue list. It is a hint, never the
truth (docs/design.md §2): Postgres decides whether the job runs.

Every path that publishes (the feeder, and a worker sending back a message whose job it
never claimed: ``Publisher.publish_later``) goes through ``envelope``/``EnvelopeFactory``; every
path that reads the queue list back goes through ``job_id_of``. Tests pin both directions
to Celery's own ``send_task`` and kombu's own decoding.

The ``argsrepr`` header is what Celery logs and Flower shows as the task's arguments
(Celery's ``send_task(argsrepr=...)`` sets it the same way): here a label, ``job 123 ·
dataset chat · run r1``, instead of the ``()`` of a call by keyword. Only people read it;
the body alone carries the job id.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

TASK_GENERATE = "eaglegen.generate"
# The custom event of a budget-skipped job: Flower shows an unknown ``task-*`` event as a
# state of that name, here SKIPPED, neither a success nor a failure.
SKIPPED_EVENT = "task-skipped"
SKIPPED_RESULT = "skipped_budget"
_TASK_IDS = uuid.UUID("6f1d4a52-8f4e-4c59-9d55-3c1f0e6b2a10")
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_JSON = json.dumps(_EMBED).encode()
_SEP = " · "


def tag(dataset: str | None, run: str | None = None) -> str:
    """What follows the job id in a message's label: `` · dataset chat · run r1``."""
    parts = ([f"dataset {dataset}"] if dataset else []) + ([f"run {run}"] if run else [])
    return "".join(_SEP + part for part in parts)


def label(job_id: int, job_tag: str = "") -> str:
    """A message's ``argsrepr``: ``job 123`` and its tag."""
    return f"job {int(job_id)}{job_tag}"


def kwargsrepr(job_id: int) -> str:
    """A message's ``kwargsrepr``: the task's keyword arguments as Celery would show them."""
    return f"{{'job_id': {job_id}}}"


def tag_of(job_id: int, argsrepr: object) -> str:
    """The tag inside a label of ``job_id`` as built by ``label``, else ``""``."""
    head = label(job_id)
    if isinstance(argsrepr, str) and argsrepr.startswith(head + _SEP):
        return argsrepr[len(head) :]
    return ""


def job_task_id(queue: str, job_id: int) -> str:
    """The Celery task id of every message of one job: Flower follows a job as one task
    through its retries, deferrals and re-publishes, as it does for Celery's own
    ``Task.retry`` (a duplicate message only repeats a state). UUID-shaped, derived from
    the queue and the job id."""
    return str(uuid.uuid5(_TASK_IDS, f"{queue}:{int(job_id)}"))


def body(job_id: int) -> bytes:
    """The task body: ``(args, kwargs, embed)`` as Celery's JSON serializer writes it."""
    return b'[[], {"job_id": %d}, ' % int(job_id) + _EMBED_JSON + b"]"


def envelope(
    job_id: int,
    *,
    queue: str,
    origin: str,
    task_id: str,
    delivery_tag: str,
    countdown: float | None = None,
    retries: int = 0,
    job_tag: str = "",
) -> dict[str, Any]:
    """The envelope of ``generate(job_id)`` as a dict: the readable definition of the format.

    ``countdown``: the worker holds the message that long before running it (Celery's
    ``eta``; none for 0, as Celery does); ``retries``: how many times this job was sent back
    (the task's ``request.retries``); ``job_tag``: the dataset part of its label (``tag``).
    """
    job_id = int(job_id)
    eta = None
    if countdown:
        eta = (datetime.now(UTC) + timedelta(seconds=countdown)).isoformat()
    return {
        "body": base64.b64encode(body(job_id)).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": TASK_GENERATE,
            "id": task_id,
            "shadow": None,
            "eta": eta,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": retries,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": label(job_id, job_tag),
            "kwargsrepr": kwargsrepr(job_id),
            "origin": origin,
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": delivery_tag,
        },
    }


# Placeholders in the factory's template, each replaced per message.
_ID, _KWARGS, _BODY, _TAG, _ARGS = _SLOTS = (
    "\x01id\x01",
    "\x01kw\x01",
    "\x01body\x01",
    "\x01tag\x01",
    "\x01args\x01",
)
# Distinct tags whose JSON escaping is kept: a producer publishes one per dataset.
_ESCAPED_TAGS = 256


class EnvelopeFactory:
    """Renders envelopes (as the JSON string kombu would LPUSH) for one queue and origin.

    A plain message (no countdown, first send) is the producer's hot path: it is joined from
    a template serialized once instead of dumping a dict per message (BENCHMARKS.md,
    "Publishing"); a test pins the two renderings to each other.
    """

    def __init__(self, queue: str, origin: str) -> None:
        self.queue = queue
        self.origin = origin
        proto = envelope(0, queue=queue, origin=origin, task_id=_ID, delivery_tag=_TAG)
        proto["body"] = _BODY
        proto["headers"]["kwargsrepr"] = _KWARGS
        proto["headers"]["argsrepr"] = _ARGS
        template = json.dumps(proto)
        marks = {json.dumps(slot)[1:-1]: index for index, slot in enumerate(_SLOTS)}
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", template)
        self._literals = pieces[0::2]
        self._order = [marks[mark] for mark in pieces[1::2]]
        # Delivery tags must be unique per message (kombu keys a worker's unacked messages
        # by the tag): a random prefix per factory and a counter make them so, in UUID
        # shape, without a uuid4() call a message. Task ids are the job's (job_task_id).
        self._tag_prefix = str(uuid.uuid4())[:24]
        self._serial = itertools.count()
        self._escaped: dict[str, str] = {}

    def __call__(self, job_id: int, job_tag: str = "") -> str:
        """The JSON string kombu's Redis transport would LPUSH for ``generate(job_id)``,
        labelled with ``job_tag`` (see ``tag``)."""
        job_id = int(job_id)  # never anything but digits inside the template
        serial = self._next_serial()
        values = (
            job_task_id(self.queue, job_id),
            kwargsrepr(job_id),
            base64.b64encode(body(job_id)).decode(),
            self._tag_prefix + serial,
            f"job {job_id}{self._escape(job_tag)}",
        )
        literals = self._literals
        out = [literals[0]]
        for i, slot in enumerate(self._order, 1):
            out.append(values[slot])
            out.append(literals[i])
        return "".join(out)

    def _escape(self, job_tag: str) -> str:
        """``job_tag`` as it sits inside a JSON string (names may hold quotes, backslashes)."""
        if not job_tag:
            return ""
        escaped = self._escaped.get(job_tag)
        if escaped is None:
            if len(self._escaped) >= _ESCAPED_TAGS:
                self._escaped.clear()
            escaped = self._escaped[job_tag] = json.dumps(job_tag)[1:-1]
        return escaped

    def later(
        self,
        job_id: int,
        *,
        countdown: float,
        retries: int,
        task_id: str | None = None,
        job_tag: str = "",
    ) -> str:
        """A job sent back after an attempt: run after ``countdown`` s, ``retries`` so far.

        ``task_id``: the id of the message it replaces (by default the job's own).
        """
        serial = self._next_serial()
        return json.dumps(
            envelope(
                job_id,
                queue=self.queue,
                origin=self.origin,
                task_id=task_id or job_task_id(self.queue, job_id),
                delivery_tag=self._tag_prefix + serial,
                countdown=countdown,
                retries=retries,
                job_tag=job_tag,
            )
        )

    def _next_serial(self) -> str:
        return f"{next(self._serial):012x}"


def job_id_of(raw: bytes | str) -> int | None:
    """The job id inside one envelope read back from the queue list, None if it is not ours."""
    message = read(raw)
    return None if message is None else message.job_id


@dataclass(frozen=True)
class Message:
    """What a worker that reads the queue list itself (worker.loop) needs of a message."""

    job_id: int
    eta: float | None  # POSIX time before which it is not to run (Celery's ``eta``)
    retries: int  # times the job was sent back (the task's ``request.retries``)
    argsrepr: str  # its label, ``label``


def read(raw: bytes | str) -> Message | None:
    """One envelope read back from the queue list; None if it is not ours (or is not an
    envelope at all)."""
    try:
        message = json.loads(raw)
        headers = message["headers"]
        if headers["task"] != TASK_GENERATE:
            return None
        _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        eta = headers.get("eta")
        return Message(
            job_id=int(kwargs["job_id"]),
            eta=None if eta is None else datetime.fromisoformat(eta).timestamp(),
            retries=int(headers.get("retries") or 0),
            argsrepr=str(headers.get("argsrepr") or ""),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def refusal(raw: bytes | str) -> str:
    """Why ``read`` found no job in a message, in one line (its start shown escaped)."""
    try:
        content_type = str(json.loads(raw).get("content-type"))
    except (ValueError, AttributeError):
        return f"not a message envelope: {raw[:120]!r}"
    if content_type != "application/json":
        pickled = " (a pickle: never unpickled)" if "python-serialize" in content_type else ""
        return f"its body is {content_type!r}, not JSON{pickled}"
    return f"not an eaglegen job: {raw[:200]!r}"


def lpush_command(key: str, values: Sequence[bytes]) -> bytes:
    """``LPUSH key values...`` in the Redis protocol (RESP).

    redis-py packs a command argument by argument in Python, which for a batch of envelopes
    cost several times this one join (BENCHMARKS.md, "Publishing").
    """
    name = key.encode()
    parts = [b"*%d\r\n$5\r\nLPUSH\r\n$%d\r\n%s\r\n" % (len(values) + 2, len(name), name)]
    for value in values:
        parts.append(b"$%d\r\n" % len(value))
        parts.append(value)
        parts.append(b"\r\n")
    return b"".join(parts)
