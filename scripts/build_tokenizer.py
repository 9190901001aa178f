"""Train the tiny byte-level BPE tokenizer shipped in eaglegen/assets/tokenizer."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parents[1] / "eaglegen" / "assets"
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 8192
BOS, EOS, PAD, UNK = "[BOS]", "<|im_end|>", "[PAD]", "[UNK]"
# The order fixes ids 0..15; eaglegen.assets.special_ids and the tests depend on it.
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "[UNK]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]


def corpus_lines(corpus_dir: Path) -> Iterator[str]:
    """Yield the corpus line by line, files in sorted order so training is reproducible."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"no *.txt files in {corpus_dir}")
    for path in files:
        yield from path.read_text(encoding="utf-8").splitlines(keepends=True)


def train(corpus_dir: Path) -> Tokenizer:
    """Train the BPE model with the special tokens at ids 0..15."""
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: byte-level BPE must round-trip any text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols up front, so no text ever needs [UNK].
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(corpus_dir), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(
            f"vocab is {tokenizer.get_vocab_size()}, want {VOCAB_SIZE}: grow the corpus"
        )
    for want, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != want:
            raise SystemExit(f"{token} has id {tokenizer.token_to_id(token)}, want {want}")
    return tokenizer


def hf_configs(chat_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (tokenizer_config, special_tokens_map) readable by transformers 4.x and 5.x."""
    named = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    # `additional_special_tokens` (a list) is understood by both major versions.
    extra = [t for t in SPECIAL_TOKENS if t not in named.values()]
    special_map = {**named, "additional_special_tokens": extra}
    config = {
        **special_map,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return config, special_map


def write(path: Path, text: str) -> None:
    """Write UTF-8 with LF endings whatever the platform, for byte-identical rebuilds."""
    path.write_bytes(text.encode("utf-8"))


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def main() -> None:
    """Build the tokenizer folder."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer")
    parser.add_argument("--corpus", type=Path, default=ASSETS / "corpus")
    parser.add_argument("--template", type=Path, default=ASSETS / "chat_template.jinja")
    args = parser.parse_args()

    tokenizer = train(args.corpus)
    config, special_map = hf_configs(args.template.read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    write(args.out / "tokenizer_config.json", dump_json(config))
    write(args.out / "special_tokens_map.json", dump_json(special_map))
    print(f"wrote {args.out} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
