"""Load the tokenizer the simulator speaks: its special ids and its ordinary id range."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from eaglegen.assets import special_ids
from eaglegen.sim.engine import Vocab


def load_vocab(tokenizer_dir: Path) -> tuple[Vocab, Tokenizer]:
    """Read the special ids and the tokenizer; ordinary ids avoid every added token."""
    ids = special_ids(tokenizer_dir)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    size = min(ids.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    reserved = set(tokenizer.get_added_tokens_decoder()) | {
        ids.bos,
        ids.pad,
        ids.im_end,
        ids.think_start,
        ids.think_end,
        ids.tool_calls_section_begin,
        ids.tool_calls_section_end,
        ids.tool_call_begin,
        ids.tool_call_argument_begin,
        ids.tool_call_end,
    }
    lo, hi = longest_free_run(reserved, size)
    vocab = Vocab(
        think_end=ids.think_end,
        im_end=ids.im_end,
        tool_section_begin=ids.tool_calls_section_begin,
        tool_section_end=ids.tool_calls_section_end,
        tool_call_begin=ids.tool_call_begin,
        tool_call_argument_begin=ids.tool_call_argument_begin,
        tool_call_end=ids.tool_call_end,
        vocab_size=size,
        ordinary_lo=lo,
        ordinary_hi=hi,
    )
    return vocab, tokenizer


def longest_free_run(reserved: Iterable[int], size: int) -> tuple[int, int]:
    """The longest [lo, hi) inside [0, size) that contains no reserved id."""
    best = (0, 0)
    start = 0
    for rid in [*sorted({r for r in reserved if 0 <= r < size}), size]:
        if rid - start > best[1] - best[0]:
            best = (start, rid)
        start = rid + 1
    if best[1] <= best[0]:
        raise ValueError("the tokenizer has no ordinary token ids")
    return best
