"""`eaglegen doctor`: is this SGLang server fit to generate a run's training data?

Each check is one line: what was seen, and for a failure how to fix it. The checks that
decide are the ones the real run learned the hard way: the exact output ids with their
special tokens (a reasoning parser strips the think-end token from `output_ids` too),
`completion_tokens` equal to the ids returned and no prompt token among them (a bug of some
SGLang versions), metrics on, and the run's model served.

``examine`` does the I/O (core.bounded against the server: each answer capped in size and
in total time, so a hostile or broken server fails a check instead of hanging the doctor or
filling its memory); ``judge_generation`` is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from core import bounded
from models.records import RunModel
from worker.identity import Served, mismatch
from worker.retry import AttemptError
from worker.validate import Request, check_response

# A leaked prompt shows as the output beginning with the prompt's last tokens; fewer than
# this many in common is chance.
LEAK_MIN_TOKENS = 4
PARSERS = ("reasoning_parser", "tool_call_parser")
# The probe's answer length by default: a reasoning model thinks for thousands of tokens even
# about 17 + 25, and an answer cut before its think-end token cannot show whether the server
# keeps that token. Lowered to what the server's context leaves (`examine`).
PROBE_MAX_NEW_TOKENS = 8192
# The whole of each small answer (health, model and server info, metrics) within this.
PROBE_TIMEOUT_S = 10.0
# The probe generation: thousands of tokens of a large model on a busy server, but bounded.
GENERATE_TIMEOUT_S = 600.0
# A worker's own cap on a /generate body (EAGLEGEN_MAX_RESPONSE_BYTES' default).
GENERATE_MAX_BYTES = 64 * bounded.MIB


@dataclass(frozen=True)
class Check:
    """One verdict: ``ok`` True (passed), False (failed) or None (could not tell)."""

    name: str
    ok: bool | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True)
class Probe:
    """What to send, and what a correct answer to it must hold (from the run file)."""

    input_ids: list[int]
    model: RunModel | None = None
    think_end_id: int | None = None  # set when the probe prompt opens a reasoning block
    vocab_size: int | None = None
    max_new_tokens: int = PROBE_MAX_NEW_TOKENS


@dataclass
class DoctorReport:
    """Every check, and the server's facts (context length, KV pool, running cap)."""

    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """No check failed (a check that could not tell is not a failure)."""
        return all(c.ok is not False for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "healthy": self.healthy,
            "checks": [c.as_dict() for c in self.checks],
            "server": self.facts,
        }


@dataclass(frozen=True)
class _Server:
    """A bounded client on the server, and how long each of its kinds of call may take."""

    http: httpx.Client
    probe_timeout_s: float
    generate_timeout_s: float

    def get(self, path: str) -> httpx.Response:
        return bounded.get(self.http, path, self.probe_timeout_s)

    def get_json(self, path: str) -> Any:
        response = self.get(path)
        response.raise_for_status()
        return response.json()


def examine(
    url: str,
    probe: Probe,
    timeout_s: float = GENERATE_TIMEOUT_S,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> DoctorReport:
    """Run every check against the server at ``url``: each answer whole within
    ``probe_timeout_s`` (the generation's within ``timeout_s``) and its size cap."""
    report = DoctorReport()
    with bounded.client(url) as http:
        server = _Server(http, probe_timeout_s, timeout_s)
        try:
            server.get("/health").raise_for_status()
        except httpx.HTTPError as exc:
            report.checks.append(Check("reachable", False, f"{url}: {_why(exc)}: is it up?"))
            return report
        report.checks.append(Check("reachable", True, f"{url} answers /health"))
        report.checks.append(_model_check(server, probe.model))
        report.checks += _server_info(server, report.facts)
        report.checks += _generation_checks(server, _within_context(probe, report.facts))
        report.checks.append(_metrics_check(server))
    return report


def _why(exc: httpx.HTTPError) -> str:
    """One line: a refused answer says its path itself; httpx's errors do not all."""
    if isinstance(exc, bounded.AnswerRefused):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _model_check(server: _Server, wanted: RunModel | None) -> Check:
    try:
        served = Served.of(server.get_json("/get_model_info"))
    except bounded.AnswerRefused as exc:
        return Check("model", False, f"{exc}: the model is unknown")
    except (httpx.HTTPError, ValueError) as exc:
        return Check("model", False, f"/get_model_info does not say the model: {exc}")
    if wanted is None:
        return Check("model", None, f"serves {served.model_path!r} (no run file to compare)")
    why = mismatch(wanted, served)
    if why is not None:
        return Check(
            "model", False, f"{why}: serve the run's model, or fix `model` in the run file"
        )
    return Check("model", True, f"serves {served.model_path!r}, the run's model")


def _server_info(server: _Server, facts: dict[str, Any]) -> list[Check]:
    """The server's limits into ``facts``; a failed check per output-changing parser."""
    try:
        info = server.get_json("/get_server_info")
    except bounded.AnswerRefused as exc:
        return [Check("server info", None, f"unavailable: {exc}")]
    except (httpx.HTTPError, ValueError) as exc:
        return [Check("server info", None, f"/get_server_info unavailable ({exc})")]
    if not isinstance(info, dict):
        return [Check("server info", None, "/get_server_info is not an object")]
    for key in ("context_length", "max_total_num_tokens", "max_running_requests", "version"):
        if key in info:
            facts[key] = info[key]
    return [
        Check(
            parser,
            False,
            f"the server runs with --{parser.replace('_', '-')} {info[parser]}: it rewrites what "
            "comes back (the think and tool-call tokens leave output_ids too); restart without it",
        )
        for parser in PARSERS
        if info.get(parser)
    ]


def _within_context(probe: Probe, facts: dict[str, Any]) -> Probe:
    """The probe with its answer length cut to what the server's context leaves (SGLang
    refuses a prompt plus max_new_tokens that reaches its context length)."""
    context = facts.get("context_length")
    if not isinstance(context, int):
        return probe
    room = context - len(probe.input_ids) - 1
    return replace(probe, max_new_tokens=room) if 0 < room < probe.max_new_tokens else probe


def _generation_checks(server: _Server, probe: Probe) -> list[Check]:
    body = {
        "input_ids": probe.input_ids,
        "rid": "eaglegen-doctor",
        "sampling_params": {"max_new_tokens": probe.max_new_tokens, "temperature": 0.0},
    }
    try:
        response = bounded.request(
            server.http,
            "POST",
            "/generate",
            server.generate_timeout_s,
            GENERATE_MAX_BYTES,
            json=body,
        )
        response.raise_for_status()
        answer = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return [Check("generate", False, f"/generate with input_ids failed: {exc}")]
    return judge_generation(probe, answer)


def judge_generation(probe: Probe, answer: Any) -> list[Check]:
    """The checks of one /generate answer to ``probe``. Pure."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    ids = answer.get("output_ids") if isinstance(answer, dict) else None
    if not isinstance(meta, dict) or not isinstance(ids, list):
        return [
            Check("generate", False, "/generate returned no output_ids: use SGLang's native API")
        ]
    checks = [Check("generate", True, f"/generate with input_ids returned {len(ids)} ids")]
    leaked = leaked_prompt(probe.input_ids, ids)
    count = meta.get("completion_tokens")
    if leaked:
        checks.append(
            Check(
                "no prompt in output",
                False,
                f"output_ids begin with the prompt's last {leaked} tokens (an SGLang bug of "
                "some versions): upgrade SGLang",
            )
        )
    elif count != len(ids):
        checks.append(
            Check(
                "completion count",
                False,
                f"completion_tokens is {count} but {len(ids)} output ids came back: upgrade SGLang",
            )
        )
    else:
        checks.append(Check("completion count", True, f"completion_tokens = {count} ids"))
    checks.append(_contract(probe, answer))
    if probe.think_end_id is not None:
        checks.append(_think_end(probe, ids, meta))
    return checks


def leaked_prompt(prompt: Sequence[int], output: Sequence[int]) -> int:
    """How many of the prompt's last tokens the output begins with (0 below LEAK_MIN_TOKENS)."""
    for n in range(min(len(prompt), len(output)), LEAK_MIN_TOKENS - 1, -1):
        if list(output[:n]) == list(prompt[-n:]):
            return n
    return 0


def _contract(probe: Probe, answer: Any) -> Check:
    """Everything a worker checks before storing (worker.validate), on this answer."""
    sent = Request(probe.input_ids, "eaglegen-doctor", probe.max_new_tokens, probe.vocab_size)
    try:
        check_response(answer, sent, "doctor")
    except AttemptError as error:
        return Check("response contract", False, f"a worker would refuse it: {error}")
    if probe.vocab_size is None:
        ids = answer["output_ids"]  # integers: check_response saw to it
        return Check(
            "response contract",
            None,
            f"meets a worker's checks, but the vocabulary was not checked without a run file "
            f"(largest output id {max(ids, default='none')}): give RUN.toml to check it",
        )
    return Check("response contract", True, "a worker would store it as it is")


def _think_end(probe: Probe, ids: list[Any], meta: dict[str, Any]) -> Check:
    """For a prompt that opens reasoning: the think-end token must be in output_ids."""
    if probe.think_end_id in ids:
        return Check("special tokens", True, f"the think-end token ({probe.think_end_id}) is kept")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "length":
        return Check(
            "special tokens",
            None,
            f"the answer was cut at {len(ids)} tokens before any think-end token: cannot tell; "
            "raise --max-new-tokens",
        )
    return Check(
        "special tokens",
        False,
        f"the prompt opened a reasoning block and the answer ended ({kind}) without the "
        f"think-end token ({probe.think_end_id}) in output_ids: the server strips special "
        "tokens (a --reasoning-parser, or skip_special_tokens); restart it without",
    )


def _metrics_check(server: _Server) -> Check:
    try:
        response = server.get("/metrics")
    except bounded.AnswerRefused as exc:
        return Check("metrics", False, f"{exc}: a worker could not read it to set its limit")
    except httpx.HTTPError as exc:
        return Check(
            "metrics", False, f"/metrics does not answer ({exc}): launch with --enable-metrics"
        )
    if response.status_code != 200 or "sglang:" not in response.text:
        return Check(
            "metrics",
            False,
            f"/metrics answers {response.status_code} without sglang: metrics: launch with "
            "--enable-metrics",
        )
    return Check("metrics", True, "/metrics serves SGLang's metrics")
