"""What the simulator speaks: a tokenizer folder's vocabulary, in its model family's layout.

`load_voice(folder, family)` reads the folder (`eaglegen.sim.vocab`), names its family with
`core.families.family_for` (its tokens and chat template; `family` overrides), and builds the
family's layout (`eaglegen.sim.layouts`), its call format (`eaglegen.sim.tools.FORMATS`) and
the reader of the tools its prompts declare (`eaglegen.sim.declarations`). Text is the
longest run of ids that no added token interrupts; the stop is the family's (else the
tokenizer's eos). What cannot be served is one line (`ValueError`, `FileNotFoundError`)
naming the folder; a tokenizer of no known family is served reasoning (when it has a think
pair), text and stop, with one warning line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from core.families import KIMI_K2, UNKNOWN, Family, family_for
from eaglegen.sim.declarations import Declarations, TemplateDeclarations, learn
from eaglegen.sim.engine import Layout
from eaglegen.sim.layouts import Spelling, layout_for
from eaglegen.sim.tools import FORMATS, CallFormat, ToolDeclarations
from eaglegen.sim.vocab import TokenizerFolder, read_folder

# Kimi-K2's template block that declares tools (read by `ToolDeclarations`).
_KIMI_BLOCK = ("<|im_system|>", "<|im_middle|>")


@dataclass(frozen=True)
class Voice:
    """A tokenizer folder as the simulator speaks it."""

    path: Path
    family: str  # core.families' name
    tokenizer: Tokenizer
    layout: Layout
    declarations: Declarations | None  # None: the family's calls are not written
    call_format: CallFormat | None
    warning: str | None = None  # one line to show at startup


def load_voice(path: Path, family: str | None = None) -> Voice:
    """The voice of the folder at `path`; `family` names its family instead of detecting it."""
    folder = read_folder(path)
    chosen = _family(folder, family)
    stops = _stops(folder, chosen)
    if not stops:
        raise ValueError(
            f"{path}: no stop token (none of the {chosen.name} family's, no eos_token in "
            "tokenizer_config.json, no eos_token_id in the model configs): the simulator "
            "could not end an answer"
        )
    call_format = FORMATS.get(chosen.syntax)  # none for a family whose calls are unread
    reserved = [folder.vocab[t] for t in chosen.tokens() if t in folder.vocab]
    spelling = Spelling(
        vocab=folder.vocab,
        encode=folder.encode,
        size=folder.size,
        ordinary=folder.ordinary([*reserved, *stops]),
        stops=stops,
        natural_stop=stops[0],
    )
    return Voice(
        path=path,
        family=chosen.name,
        tokenizer=folder.tokenizer,
        layout=layout_for(chosen, spelling, call_format),
        declarations=None if call_format is None else _declarations(folder, chosen),
        call_format=call_format,
        warning=_warning(folder, chosen, family is not None),
    )


def _family(folder: TokenizerFolder, name: str | None) -> Family:
    """The detected family, or the one named; a named family's tokens must be there."""
    try:
        chosen = family_for(folder.vocab, folder.template, name)
    except ValueError as exc:
        raise ValueError(f"{folder.path}: {exc}") from None
    missing = [t for t in (*chosen.structure(), *chosen.vocab_marks) if t not in folder.vocab]
    if missing:
        raise ValueError(
            f"{folder.path}: the {chosen.name} family needs tokens this tokenizer "
            f"lacks: {', '.join(missing)}"
        )
    return chosen


def _stops(folder: TokenizerFolder, family: Family) -> tuple[int, ...]:
    """The family's stop ids in the vocabulary, then the tokenizer's eos ids."""
    found = [i for i in family.stop_ids(folder.vocab) if i < folder.size]
    return tuple(dict.fromkeys([*found, *(i for i in folder.eos if 0 <= i < folder.size)]))


def _declarations(folder: TokenizerFolder, family: Family) -> Declarations:
    """Kimi-K2's declaration block when the tokenizer has its tokens, else the template's way
    (learnt by rendering it)."""
    if family is KIMI_K2 and all(t in folder.vocab for t in (*_KIMI_BLOCK, family.stops[0])):
        return ToolDeclarations(folder.tokenizer, folder.vocab[family.stops[0]])
    probe = learn(folder.template, folder.tokens, folder.added_strings)
    return TemplateDeclarations(probe, folder.decode)


def _warning(folder: TokenizerFolder, family: Family, named: bool) -> str | None:
    """The line a tokenizer of no known family deserves (named: by --family)."""
    if family is not UNKNOWN:
        return None
    think = family.think is not None and all(t in folder.vocab for t in family.think)
    why = "--family unknown" if named else "no known model family in its tokens and chat template"
    return (
        f"{folder.path}: {why}: serving {'reasoning, ' if think else ''}text and a stop, "
        "no tool calls" + ("" if named else " (--family names one)")
    )
