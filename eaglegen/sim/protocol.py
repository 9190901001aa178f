"""SGLang's /generate wire format: request parsing, validation and response bodies."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglegen.sim.engine import (
    DEFAULT_MAX_NEW_TOKENS,
    Completion,
    Finish,
    Sampling,
    max_request_tokens,
    validate_lengths,
)

# Top-level keys of SGLang's GenerateReqInput that the simulator honours.
_SUPPORTED_KEYS = frozenset(
    {"input_ids", "text", "sampling_params", "rid", "stream", "return_logprob", "log_metrics"}
)
# GenerateReqInput keys accepted only at their SGLang default (they would change the answer).
_DEFAULT_ONLY_KEYS: Mapping[str, tuple[object, ...]] = {
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_text_in_logprobs": (None, False),
    "return_hidden_states": (None, False),
    "input_embeds": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "modalities": (None,),
    "session_params": (None,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "priority": (None,),
    "custom_labels": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "return_routed_experts": (None, False),  # SGLang 0.5.2x: MoE routing, off by default
}
# Every key of SGLang's SamplingParams; anything else is an error there too.
_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "custom_params", "stream_interval", "logit_bias", "sampling_seed",
    }
)  # fmt: skip
# Sampling keys whose non-default values the simulator cannot imitate.
_UNSUPPORTED_SAMPLING = ("stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag")


class RequestError(Exception):
    """A request SGLang answers with 400; validation=True means FastAPI's body-validation shape."""

    def __init__(self, message: str, *, validation: bool = False) -> None:
        """Keep the message and which error body to use."""
        super().__init__(message)
        self.message = message
        self.validation = validation

    def body(self) -> dict[str, Any]:
        """The JSON body SGLang sends with this 400."""
        if self.validation:
            return validation_error_body(self.message)
        return {"error": {"message": self.message}}


def validation_error_body(
    message: str, code: int = 400, kind: str = "Bad Request"
) -> dict[str, Any]:
    """SGLang's ErrorResponse body (request validation errors and HTTPExceptions)."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


@dataclass(frozen=True)
class Limits:
    """Server-side bounds a request is checked against."""

    vocab_size: int
    context_length: int
    kv_tokens: int
    default_seed: int


@dataclass(frozen=True)
class TextOptions:
    """How the generated ids are detokenized into `text`."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate call, validated."""

    rid: str
    input_ids: list[int]
    sampling: Sampling
    text_options: TextOptions
    # sampling_params.stream_interval; None means the server's --stream-interval.
    stream_interval: int | None = None

    @property
    def reserve(self) -> int:
        """Worst-case KV of this request: prompt plus max_new_tokens."""
        return len(self.input_ids) + self.sampling.max_new_tokens


@dataclass(frozen=True)
class GenerateRequest:
    """A validated /generate call: one item, or a batch answered with a JSON list."""

    items: list[GenerateItem]
    is_batch: bool
    log_metrics: bool
    stream: bool = False


def wants_stream(body: object) -> bool:
    """Whether a /generate body asks for a streamed answer (read before it is validated)."""
    return isinstance(body, dict) and body.get("stream") is True


def parse_generate(body: object, limits: Limits) -> GenerateRequest:
    """Validate a /generate body the way SGLang does; raise RequestError on anything wrong."""
    if not isinstance(body, dict):
        raise RequestError("Input should be a valid dictionary", validation=True)
    # Body types are FastAPI's to check, before SGLang sees the request.
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream: Input should be a valid boolean", validation=True)
    _check_top_level(body)
    prompts, is_batch = _parse_input_ids(body.get("input_ids"), limits.vocab_size)
    params = _per_item(body.get("sampling_params"), len(prompts), is_batch, "sampling_params")
    rids = _parse_rids(body.get("rid"), len(prompts), is_batch)
    items = [
        _item(rid, ids, sp, limits) for rid, ids, sp in zip(rids, prompts, params, strict=True)
    ]
    log_metrics = body.get("log_metrics", True)
    if not isinstance(log_metrics, bool):
        raise RequestError("log_metrics: Input should be a valid boolean", validation=True)
    return GenerateRequest(items, is_batch, log_metrics, stream)


def _check_top_level(body: dict[str, Any]) -> None:
    """Reject unknown keys and features the simulator does not implement."""
    unknown = sorted(k for k in body if k not in _SUPPORTED_KEYS and k not in _DEFAULT_ONLY_KEYS)
    if unknown:
        raise RequestError(f"Unknown field(s) in the request: {unknown}")
    for key, defaults in _DEFAULT_ONLY_KEYS.items():
        if key in body and body[key] not in defaults:
            raise RequestError(f"{key} is not supported by the simulator")
    if body.get("text") is not None:
        raise RequestError("The simulator accepts input_ids only; send input_ids instead of text.")
    if body.get("return_logprob"):
        raise RequestError("return_logprob is not supported by the simulator.")


def _parse_input_ids(value: object, vocab_size: int) -> tuple[list[list[int]], bool]:
    """input_ids as a list of prompts and whether the call is a batch."""
    if value is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(value, list):
        raise RequestError("input_ids: Input should be a valid list", validation=True)
    if not value:
        raise RequestError("input_ids cannot be empty.")
    is_batch = isinstance(value[0], list)
    prompts = value if is_batch else [value]
    for prompt in prompts:
        _check_prompt(prompt, vocab_size)
    return prompts, is_batch


def _check_prompt(prompt: object, vocab_size: int) -> None:
    """One prompt must be a non-empty list of in-vocabulary token ids."""
    if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
        raise RequestError("input_ids: Input should be a list of integers", validation=True)
    if not prompt:
        raise RequestError("input_ids cannot be empty.")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RequestError(
            f"The input_ids contains values outside the vocabulary [0, {vocab_size})."
        )


def _per_item(value: object, n: int, is_batch: bool, name: str) -> list[dict[str, Any]]:
    """A per-prompt list of dicts from a dict (shared) or a list (one each)."""
    if value is None:
        return [{} for _ in range(n)]
    if isinstance(value, dict):
        return [value] * n
    if is_batch and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        if len(value) != n:
            raise RequestError(f"The length of {name} should be equal to the batch size.")
        return value
    raise RequestError(f"{name}: Input should be a valid dictionary", validation=True)


def _parse_rids(value: object, n: int, is_batch: bool) -> list[str]:
    """Request ids: given, derived from a prefix, or fresh uuid hex like SGLang."""
    if value is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(value, str):
        return [f"{value}_{i}" for i in range(n)] if is_batch else [value]
    if is_batch and isinstance(value, list) and all(isinstance(r, str) for r in value):
        if len(value) != n:
            raise RequestError(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        if len(set(value)) != len(value):
            dupes = sorted({r for r in value if value.count(r) > 1})
            raise RequestError(f"Duplicate request IDs detected within the request: {dupes}")
        return value
    raise RequestError("The rid should be a string or a list of strings.")


def _item(rid: str, ids: list[int], params: dict[str, Any], limits: Limits) -> GenerateItem:
    """Validate one prompt's sampling parameters and lengths."""
    unknown = sorted(k for k in params if k not in _SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"Unexpected keyword argument(s) in sampling_params: {unknown}")
    _verify_sampling(params)
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers.")
    sampling = Sampling(
        max_new_tokens=_effective_max_new(len(ids), _max_new(params), limits),
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=_opt_bool(params, "ignore_eos", False),
        seed=_opt_int(params, "sampling_seed", limits.default_seed),
    )
    text = TextOptions(
        skip_special_tokens=_opt_bool(params, "skip_special_tokens", True),
        no_stop_trim=_opt_bool(params, "no_stop_trim", False),
    )
    # SGLang takes `stream_interval or --stream-interval`, so 0 means the server's too.
    interval = _opt_int(params, "stream_interval", 0)
    if interval < 0:
        raise RequestError(f"stream_interval must be at least 0, got {interval}.")
    return GenerateItem(rid, ids, sampling, text, interval or None)


def _max_new(params: dict[str, Any]) -> int | None:
    """max_new_tokens as sent: absent means SGLang's default, an explicit null means no cap."""
    if "max_new_tokens" not in params:
        return DEFAULT_MAX_NEW_TOKENS
    if params["max_new_tokens"] is None:
        return None
    return _opt_int(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)


def _effective_max_new(prompt_tokens: int, requested: int | None, limits: Limits) -> int:
    """Apply the tokenizer manager's context check, then the scheduler's max_req_len clamp."""
    if requested is not None:
        message = validate_lengths(prompt_tokens, requested, limits.context_length)
        if message:
            raise RequestError(message)
    max_req_len = max_request_tokens(limits.context_length, limits.kv_tokens)
    # SGLang keeps a few tokens of headroom below max_req_len for the prompt.
    max_req_input_len = max_req_len - 5
    if prompt_tokens >= max_req_input_len:
        raise RequestError(
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
            f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    cap = max_req_len - prompt_tokens - 1
    return cap if requested is None else min(requested, cap)


def _verify_sampling(p: dict[str, Any]) -> None:
    """SamplingParams.verify(): the ranges SGLang enforces, with its messages."""
    temperature = _opt_number(p, "temperature", 1.0)
    top_p = _opt_number(p, "top_p", 1.0)
    top_k = _opt_int(p, "top_k", -1)
    min_p = _opt_number(p, "min_p", 0.0)
    max_new = _max_new(p)
    min_new = _opt_int(p, "min_new_tokens", 0)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 and top_k != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    _verify_penalties(p)
    if max_new is not None and max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    if min_new < 0 or (max_new is not None and min_new > max_new):
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if _opt_int(p, "n", 1) != 1:
        raise RequestError("n > 1 (parallel sampling) is not supported by the simulator.")
    for key in _UNSUPPORTED_SAMPLING:
        if p.get(key):
            raise RequestError(f"sampling_params.{key} is not supported by the simulator.")


def _verify_penalties(p: dict[str, Any]) -> None:
    """Penalty ranges from SamplingParams.verify()."""
    frequency = _opt_number(p, "frequency_penalty", 0.0)
    presence = _opt_number(p, "presence_penalty", 0.0)
    repetition = _opt_number(p, "repetition_penalty", 1.0)
    if not -2.0 <= frequency <= 2.0:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not -2.0 <= presence <= 2.0:
        raise RequestError(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not 0.0 < repetition <= 2.0:
        raise RequestError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}."
        )


def _is_int(value: object) -> bool:
    """A JSON integer (bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(p: dict[str, Any], key: str, default: int) -> int:
    """An optional integer sampling value; null means the default."""
    value = p.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(
            f"sampling_params.{key}: Input should be a valid integer", validation=True
        )
    return int(value)


def _opt_number(p: dict[str, Any], key: str, default: float) -> float:
    """An optional numeric sampling value; null means the default."""
    value = p.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(
            f"sampling_params.{key}: Input should be a valid number", validation=True
        )
    return float(value)


def _opt_bool(p: dict[str, Any], key: str, default: bool) -> bool:
    """An optional boolean sampling value; null means the default."""
    value = p.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(
            f"sampling_params.{key}: Input should be a valid boolean", validation=True
        )
    return value


def response_body(
    item: GenerateItem,
    completion: Completion,
    *,
    text: str,
    cached_tokens: int,
    e2e_latency: float,
    leak_prompt_tokens: int = 0,
    retractions: int = 0,
) -> dict[str, Any]:
    """One /generate result, with meta_info keys in SGLang's order."""
    return result_body(
        item,
        leak(completion.output_ids, item.input_ids, leak_prompt_tokens),
        text=text,
        finish=completion.finish,
        completion_tokens=len(completion.output_ids),
        cached_tokens=cached_tokens,
        e2e_latency=e2e_latency,
        retractions=retractions,
    )


def leak(output_ids: list[int], input_ids: list[int], n: int) -> list[int]:
    """The real bug's shape: the last n prompt tokens lead output_ids (completion_tokens does
    not count them)."""
    if n <= 0:
        return output_ids
    return [*input_ids[max(0, len(input_ids) - n) :], *output_ids]


def strip_special(ids: list[int], specials: frozenset[int], final_stop: bool) -> list[int]:
    """ids without the added special tokens, as a server skipping them sends; the matched
    stop token that ends a finished output (final_stop) stays."""
    last = len(ids) - 1 if final_stop else -1
    return [t for i, t in enumerate(ids) if i == last or t not in specials]


def stripped(completion: Completion, specials: frozenset[int]) -> Completion:
    """A finished completion as the strip_special_tokens fault sends it."""
    final_stop = completion.finish.type == "stop"
    ids = strip_special(completion.output_ids, specials, final_stop)
    return Completion(ids, completion.finish, completion.broken_tool_args)


def result_body(
    item: GenerateItem,
    output_ids: list[int],
    *,
    text: str,
    finish: Finish | None,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency: float | None,
    retractions: int = 0,
) -> dict[str, Any]:
    """A result or a stream chunk: an unfinished one has a null finish_reason and, as in
    SGLang, no e2e_latency yet."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish.to_json() if finish is not None else None,
        "prompt_tokens": len(item.input_ids),
        "weight_version": "default",
        "total_retractions": retractions,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def ids_for_text(completion: Completion, options: TextOptions) -> list[int]:
    """The ids SGLang detokenizes: a matched stop token is trimmed unless no_stop_trim."""
    ids = completion.output_ids
    if completion.finish.type == "stop" and not options.no_stop_trim and ids:
        return ids[:-1]
    return ids
