"""`eaglegen show` and `eaglegen sample`: one generation decoded with its special tokens
visible, cut into prompt tail, reasoning, answer and tool calls (what the user of the real
run pasted to spot the reasoning bug)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Group
from rich.constrain import Constrain
from rich.rule import Rule
from rich.text import Text

from core.anatomy import Markers
from core.families import KIMI_K2, Family
from eaglegen.report.quality import NOT_CHECKED, declared_names
from eaglegen.report.text import visible
from models.stats import Detail

# Prompt ids shown before the output: enough for the end of the template's generation
# prompt (the think-start token, say) and the last words of the user's turn.
PROMPT_TAIL = 48


@dataclass(frozen=True)
class CallView:
    """One tool call as decoded."""

    name: str
    index: int | None
    arguments: str
    arguments_json: bool
    declared: bool | None


@dataclass(frozen=True)
class SampleView:
    """One job's generation, decoded part by part (``generated`` False: none yet)."""

    job_id: int
    run: str
    dataset: str
    state: str
    generated: bool
    finish_type: str | None
    prompt_tokens: int
    completion_tokens: int | None
    prompt_tail: str
    prompt_tail_tokens: int
    opens_reasoning: bool
    reasoning: str | None
    reasoning_tokens: int | None
    think_end_present: bool | None
    answer: str
    answer_tokens: int
    tool_calls: tuple[CallView, ...]
    sections_balanced: bool
    stray: str
    stop: str | None
    family: str = KIMI_K2.name  # the run's model family (core.families)
    calls_checked: bool = True  # False: its calls are not read, and stay in the answer
    conversation_id: int | None = None  # its conversation (turns = "all"), and turn
    turn: int | None = None
    sample: int = 0  # its prompt's sample, variant and seed (core.samples)
    variant: str | None = None
    sampling_seed: int | None = None

    def document(self) -> dict[str, Any]:
        """The JSON form: ``tool_calls`` is "not checked" where the family's calls are not
        read (never an empty list, as if there were none)."""
        body = asdict(self)
        calls = [asdict(c) for c in self.tool_calls]
        body["tool_calls"] = calls if self.calls_checked else NOT_CHECKED
        return body


def view(
    detail: Detail,
    decode: Callable[[Sequence[int]], str],
    markers: Markers,
    tail: int = PROMPT_TAIL,
    *,
    family: Family = KIMI_K2,
) -> SampleView:
    """Decode ``detail``'s prompt tail and output, cut by the run's ``family`` (``markers``:
    its tokens, with the dataset's stored stop ids)."""
    prompt = detail.input_ids[-tail:] if tail > 0 else []
    output = detail.output_ids or []
    anatomy = family.dissect(output, markers, opens_reasoning=detail.opens_reasoning)
    calls = family.parse_calls(anatomy, decode, declared_names(detail.tools))
    return SampleView(
        job_id=detail.job_id,
        run=detail.run,
        dataset=detail.dataset,
        state=detail.state,
        generated=detail.output_ids is not None,
        finish_type=detail.finish_type,
        prompt_tokens=len(detail.input_ids),
        completion_tokens=detail.completion_tokens,
        prompt_tail=decode(prompt),
        prompt_tail_tokens=len(prompt),
        opens_reasoning=detail.opens_reasoning,
        reasoning=None if anatomy.reasoning is None else decode(anatomy.reasoning),
        reasoning_tokens=None if anatomy.reasoning is None else len(anatomy.reasoning),
        think_end_present=anatomy.think_end_present,
        answer=decode(anatomy.answer),
        answer_tokens=len(anatomy.answer),
        tool_calls=tuple(CallView(**asdict(c)) for c in calls),
        sections_balanced=anatomy.sections_balanced,
        stray=decode(anatomy.stray),
        stop=None if anatomy.stop is None else decode([anatomy.stop]),
        family=family.name,
        calls_checked=anatomy.calls_checked,
        conversation_id=detail.conversation_id,
        turn=detail.turn,
        sample=detail.sample,
        variant=detail.variant,
        sampling_seed=detail.sampling_seed,
    )


def block(value: str) -> Text:
    """Decoded text for the terminal: its lines kept, every other control character
    written as its escape, no markup."""
    return Text("\n".join(visible(line) for line in value.split("\n")))


def _heading(label: str, detail: str = "") -> Text:
    return Text.assemble((label, "bold cyan"), (f" {detail}" if detail else "", "dim"))


def render(v: SampleView, think_end: str) -> Group:
    """The view as rich renderables."""
    title = (
        f"job {v.job_id} · dataset {v.dataset} · run {v.run} · family {v.family} · {v.state}"
        + ("" if v.turn is None else f" · conversation {v.conversation_id} turn {v.turn}")
        + ("" if v.sampling_seed is None else f" · sample {v.sample} seed {v.sampling_seed}")
        + ("" if v.variant is None else f" · variant {v.variant}")
        + (f" · finish {v.finish_type} · {v.completion_tokens:,} tokens" if v.generated else "")
    )
    heading = visible(title)
    parts: list[Any] = [
        # As wide as its title, not as the console: on a pipe the console has no width.
        Constrain(Rule(Text(heading), align="left"), width=max(80, cell_len(heading) + 6)),
        _heading("prompt", f"(last {v.prompt_tail_tokens} of {v.prompt_tokens:,} tokens)"),
        block(v.prompt_tail),
    ]
    if not v.generated:
        parts.append(Text("no generation yet", style="yellow"))
        return Group(*parts)
    if v.reasoning is not None:
        parts += [_heading("reasoning", f"({v.reasoning_tokens:,} tokens)"), block(v.reasoning)]
        present = v.think_end_present
        parts.append(
            Text.assemble(
                (visible(think_end), "bold"),
                (": present" if present else ": MISSING", "green" if present else "bold red"),
            )
        )
    parts += [_heading("answer", f"({v.answer_tokens:,} tokens)"), block(v.answer or "")]
    if not v.calls_checked:
        parts.append(_heading("tool calls", f"not checked (family {v.family}: not read)"))
    elif v.tool_calls or not v.sections_balanced:
        parts += _calls(v)
    if v.stray:
        parts += [_heading("inside a section, outside any call"), block(v.stray)]
    parts.append(
        Text.assemble(("stop ", "bold cyan"), visible(v.stop) if v.stop else ("none", "yellow"))
    )
    return Group(*parts)


def _calls(v: SampleView) -> list[Any]:
    balanced = "" if v.sections_balanced else " — sections NOT balanced"
    out: list[Any] = [_heading("tool calls", f"({len(v.tool_calls)}){balanced}")]
    for call in v.tool_calls:
        declared = {True: "declared", False: "NOT DECLARED", None: "no tools declared"}
        ok = call.arguments_json and call.declared is True
        out.append(
            Text.assemble(
                (f"[{'-' if call.index is None else call.index}] ", "dim"),
                (visible(call.name), "bold"),
                (f" ({declared[call.declared]}", "green" if ok else "bold red"),
                (
                    ", arguments JSON)" if call.arguments_json else ", arguments NOT JSON)",
                    "green" if call.arguments_json else "bold red",
                ),
            )
        )
        out.append(block(call.arguments))
    return out
