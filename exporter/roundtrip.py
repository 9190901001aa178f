"""The round trip of a conversation: re-templated and re-encoded, is it the recorded ids?

A conversation is only as good as the ids a trainer gets back from it: SpecForge and
Model-Optimizer re-apply the chat template to each row. Re-applying the run's template to the
prompt's messages plus the decoded assistant turn must give the recorded prompt + output ids
exactly. Where it does not, where it first differs tells why: in the prompt (the template
renders the history another way once an assistant turn follows, e.g. it strips earlier
reasoning) or in the output (it adds an empty think block, drops what the model wrote after
its calls, ends a turn the model never ended). ``text_equal`` separates a template that
writes other text from ids that are not the tokenizer's own encoding of their text (a model
may sample a split of a word the tokenizer would not make).

A template may write more after the stop token that ends an assistant turn than the model
generated (Qwen3 writes ``<|im_end|>\n``; the model stops at ``<|im_end|>``). A row whose
recorded ids are the re-rendered ids but for that turn suffix is exact "up to the template's
turn suffix", counted apart. The suffix is not known in advance: the run's template renders
a probe conversation ending with a known assistant message, and what it writes after that
message is the template's end of turn (:func:`turn_end`); what follows the stop token there
is the suffix. The reverse holds for templates that write no stop token at the end of an
assistant turn (GLM-4.5: the model stops at the next turn's role token, ``<|observation|>``
or ``<|user|>``): a row whose recorded ids are the re-rendered ids plus one of the run's stop
ids is exact "but for the stop the template does not write", counted apart too. The caller
probes once per export (`turn_end`) and passes the result; all else here is pure.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.onpolicy import first_difference

# Ids of decoded context either side of the first difference.
CONTEXT_IDS = 8
# Differing rows kept per dataset as examples in the manifest.
EXAMPLES = 3
PROMPT, OUTPUT = "prompt", "output"
# The probe's final assistant message: plain words no template rewrites, found again in the
# rendered text by its position.
PROBE = [
    {"role": "user", "content": "Say the probe words."},
    {"role": "assistant", "content": "Probe words for the round trip."},
]


class Templater(Protocol):
    """What the probe needs of the run's tokenizer (``exporter.tokenizer.RunTokenizer``)."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The conversation as the run's template writes it, without a generation prompt."""
        ...

    def encode(self, text: str) -> list[int]:
        """``text``'s ids as the run encodes a rendered prompt."""
        ...


@dataclass(frozen=True)
class Check:
    """One row's round trip; ``text_equal`` to ``error`` describe the first difference."""

    exact: bool
    text_equal: bool = True
    position: int | None = None  # index into prompt + output ids
    part: str | None = None  # PROMPT or OUTPUT: where ``position`` falls
    recorded: str = ""  # decoded recorded ids around ``position``
    rendered: str = ""  # decoded re-rendered ids around ``position``
    error: str | None = None  # the template raised: nothing was rendered
    # Exact but for this, which the template writes after the turn's stop token (decoded).
    turn_suffix: str | None = None
    # Exact but for this stop token, which the model wrote and the template does not.
    unrendered_stop: str | None = None


def check(
    recorded: Sequence[int],
    prompt_len: int,
    rendered_text: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    *,
    end_of_turn: Sequence[int] = (),
    stops: Collection[int] = (),
) -> Check:
    """Compare the recorded ids with ``rendered_text`` encoded.

    ``end_of_turn``: what the template writes after a final assistant message
    (:func:`turn_end`); ``stops``: the dataset's stop ids.
    """
    rendered = encode(rendered_text)
    at = first_difference(recorded, rendered)
    if at is None:
        return Check(exact=True)
    # The render goes on after the recorded output with what the template writes after a stop.
    if at == len(recorded) > prompt_len and suffix_after_stop(recorded, rendered, end_of_turn):
        return Check(exact=True, turn_suffix=decode(rendered[at:]))
    # The model's stop, which the template does not write (GLM-4.5): the render lacks it.
    if at == len(rendered) and len(recorded) == at + 1 and recorded[-1] in stops:
        return Check(exact=True, unrendered_stop=decode(recorded[-1:]))
    lo, hi = max(at - CONTEXT_IDS, 0), at + CONTEXT_IDS
    return Check(
        exact=False,
        text_equal=decode(recorded) == rendered_text,
        position=at,
        part=PROMPT if at < prompt_len else OUTPUT,
        recorded=decode(recorded[lo:hi]),
        rendered=decode(rendered[lo:hi]),
    )


def suffix_after_stop(
    recorded: Sequence[int], rendered: Sequence[int], end_of_turn: Sequence[int]
) -> bool:
    """Whether ``rendered`` is ``recorded`` plus what the template writes after the stop
    token that ends ``recorded``: ``end_of_turn`` is that stop token, then the suffix."""
    if len(end_of_turn) < 2 or not recorded or recorded[-1] != end_of_turn[0]:
        return False
    n = len(recorded)
    # As lists: a list never equals a tuple of the same ids.
    return list(rendered[:n]) == list(recorded) and list(rendered[n:]) == list(end_of_turn[1:])


def turn_end(templater: Templater) -> tuple[int, ...]:
    """The ids the run's template writes after a final assistant message: its end-of-turn
    token and what follows it (Qwen3: ``<|im_end|>`` then ``\n``). Empty when the probe
    does not show them: the template refused it, rewrote the message, or encodes that end
    otherwise inside the conversation than alone."""
    try:
        text = templater.render(PROBE, None)
    except Exception:  # jinja raises many types; without the probe, no suffix is allowed
        return ()
    at = text.rfind(PROBE[-1]["content"])
    if at < 0:
        return ()
    tail = templater.encode(text[at + len(PROBE[-1]["content"]) :])
    whole = templater.encode(text)
    return tuple(tail) if tail and whole[-len(tail) :] == tail else ()


def failed(error: Exception) -> Check:
    """The round trip of a row the template refused to render."""
    return Check(exact=False, text_equal=False, error=f"{type(error).__name__}: {error}")


@dataclass
class DatasetRoundTrip:
    """One dataset's round trips: how many reproduce, and how the others differ."""

    checked: int = 0
    exact: int = 0  # every row that reproduces, up_to_turn_suffix among them
    up_to_turn_suffix: int = 0  # exact but for what the template writes after the stop
    turn_suffix: str | None = None  # that suffix, decoded (the first one seen)
    stop_unrendered: int = 0  # exact but for a stop token the template does not write
    unrendered_stop: str | None = None  # that stop, decoded (the first one seen)
    text_equal: int = 0  # not exact, but the same text: the ids are not the canonical encoding
    differs_in: dict[str, int] = field(default_factory=lambda: {PROMPT: 0, OUTPUT: 0})
    template_errors: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, row_id: int, result: Check) -> None:
        """Count one row's round trip; keep the first few differing ones as examples."""
        self.checked += 1
        if result.exact:
            self.exact += 1
            if result.turn_suffix is not None:
                self.up_to_turn_suffix += 1
                self.turn_suffix = self.turn_suffix or result.turn_suffix
            if result.unrendered_stop is not None:
                self.stop_unrendered += 1
                self.unrendered_stop = self.unrendered_stop or result.unrendered_stop
            return
        if result.error is not None:
            self.template_errors += 1
        elif result.text_equal:
            self.text_equal += 1
        if result.part is not None:
            self.differs_in[result.part] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(_example(row_id, result))

    def merge(self, other: DatasetRoundTrip) -> None:
        """Add ``other``'s counts (an incremental export's previous passes)."""
        self.checked += other.checked
        self.exact += other.exact
        self.up_to_turn_suffix += other.up_to_turn_suffix
        self.turn_suffix = self.turn_suffix or other.turn_suffix
        self.stop_unrendered += other.stop_unrendered
        self.unrendered_stop = self.unrendered_stop or other.unrendered_stop
        self.text_equal += other.text_equal
        self.template_errors += other.template_errors
        for part, n in other.differs_in.items():
            self.differs_in[part] = self.differs_in.get(part, 0) + n
        self.examples = (self.examples + other.examples)[:EXAMPLES]

    def document(self) -> dict[str, Any]:
        """As the manifest writes it."""
        return {
            "checked": self.checked,
            "exact": self.exact,
            "exact_rate": round(self.exact / self.checked, 4) if self.checked else None,
            "exact_up_to_turn_suffix": self.up_to_turn_suffix,
            "turn_suffix": self.turn_suffix,
            "exact_but_unrendered_stop": self.stop_unrendered,
            "unrendered_stop": self.unrendered_stop,
            "same_text_other_ids": self.text_equal,
            "differs_in": dict(self.differs_in),
            "template_errors": self.template_errors,
            "examples": self.examples,
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> DatasetRoundTrip:
        """Inverse of :meth:`document`."""
        return cls(
            checked=int(doc["checked"]),
            exact=int(doc["exact"]),
            # Manifests written before the turn suffix was told apart have neither key.
            up_to_turn_suffix=int(doc.get("exact_up_to_turn_suffix", 0)),
            turn_suffix=doc.get("turn_suffix"),
            stop_unrendered=int(doc.get("exact_but_unrendered_stop", 0)),
            unrendered_stop=doc.get("unrendered_stop"),
            text_equal=int(doc["same_text_other_ids"]),
            differs_in={str(k): int(v) for k, v in doc["differs_in"].items()},
            template_errors=int(doc["template_errors"]),
            examples=list(doc["examples"]),
        )


def _example(row_id: int, result: Check) -> dict[str, Any]:
    return {
        "id": row_id,
        "position": result.position,
        "part": result.part,
        "same_text": result.text_equal,
        "recorded": result.recorded,
        "rendered": result.rendered,
        "error": result.error,
    }


class RoundTrips:
    """The round trips of every dataset an export read."""

    def __init__(self) -> None:
        self.datasets: dict[str, DatasetRoundTrip] = {}

    def add(self, dataset: str, row_id: int, result: Check) -> None:
        """Count one row's round trip."""
        self.datasets.setdefault(dataset, DatasetRoundTrip()).add(row_id, result)

    def merged(self, other: RoundTrips) -> RoundTrips:
        """A new tally of both."""
        merged = RoundTrips()
        for tally in (self, other):
            for name, counts in tally.datasets.items():
                merged.datasets.setdefault(name, DatasetRoundTrip()).merge(counts)
        return merged

    def document(self) -> dict[str, Any]:
        """Per dataset, as the manifest writes it."""
        return {name: c.document() for name, c in sorted(self.datasets.items())}

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> RoundTrips:
        """The round trips of an earlier manifest."""
        trips = cls()
        for name, counts in doc.items():
            trips.datasets[name] = DatasetRoundTrip.from_document(counts)
        return trips
