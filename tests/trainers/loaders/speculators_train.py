"""Run inside the trainers' venv: EAGLE-3 drafter steps on CPU with speculators 0.9.0's own
code, on an ``eaglegen export --for speculators`` split folder.

    python speculators_train.py DATA_PATH TOKENIZER_DIR WORK RESULT [--steps N]

What runs, in the order of ``speculators train`` (``speculators.train.cli.main``):

1. The target: a random-weight ``LlamaForCausalLM`` built from a tiny ``LlamaConfig`` with
   the test tokenizer's vocabulary (nothing downloaded), saved to WORK/verifier; it stands
   in for vLLM. Its hidden states for every row (the outputs of the three
   ``--target-layer-ids`` layers and the last layer's output before the final norm, as
   vLLM's extraction captures them) go to DATA_PATH/hidden_states/hs_<index>.safetensors,
   where ``speculators generate-offline-data`` puts them for the file backend.
2. ``TrainConfig.resolve`` of the CLI flags below, then ``cli.main``'s own steps:
   ``parse_vocab_mappings`` (no token_freq.pt, no --draft-vocab-size: the full verifier
   vocabulary), ``build_draft_model`` (``Eagle3DraftModel.from_training_args``: its embeddings
   and lm_head loaded from the verifier), ``create_train_val_loaders`` with ``shift_batch``
   (``ArrowDataset`` over DATA_PATH, ``MultipackDistributedBatchSamplerV2``, ``CollateFn``),
   ``get_trainer_kwargs`` (ttt_steps, decay, the kl_div loss, eager implementation: the fused
   one is Triton) and ``build_optimizers`` (AdamW).
3. Not their ``Trainer`` (it moves the model to a CUDA device): its ``train_epoch`` step,
   on CPU and one fixed packed batch: forward (returns loss and metrics), zero_grad,
   backward, ``clip_grad_norm_(1.0)``, optimizer step; N times.

RESULT gets the losses, whether the drafter's targets (its verifier_norm and
verifier_lm_head over the stored last hidden states) are the target's own logits, and the
batch's ids and mask (to compare with the database).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from datasets import load_from_disk
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

LAYERS = 4
AUX = [1, 2, 3]  # the target layers whose outputs EAGLE-3 reads (three, as it needs)
HIDDEN = 32


def build_target(tokenizer_dir: str, work: Path) -> tuple[Path, LlamaForCausalLM]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    folder = work / "verifier"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # a model folder has its tokenizer
    return folder, model


@torch.no_grad()
def write_hidden_states(model: LlamaForCausalLM, data_path: str) -> list[torch.Tensor]:
    """Per row: [seq_len, len(AUX) + 1, hidden] (the AUX layers' outputs, then the last
    layer's before the norm) and its ids; the target's logits, to check the drafter's."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, index=index: captured.__setitem__(
                index, out[0] if isinstance(out, tuple) else out
            )
        )
        for index, layer in enumerate(model.model.layers)
    ]
    folder = load_from_disk(data_path)
    out = Path(data_path) / "hidden_states"
    out.mkdir(exist_ok=True)
    logits = []
    for index in range(len(folder)):
        ids = torch.as_tensor(folder[index]["input_ids"], dtype=torch.long)
        logits.append(model(ids[None]).logits[0])
        # Layer id k is the hidden state after k decoder layers (HF's hidden_states[k]).
        states = [captured[k - 1][0] for k in AUX] + [captured[LAYERS - 1][0]]
        save_file(
            {"hidden_states": torch.stack(states, dim=1).contiguous(), "token_ids": ids},
            out / f"hs_{index}.safetensors",
        )
    for hook in hooks:
        hook.remove()
    return logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_path")
    parser.add_argument("tokenizer")
    parser.add_argument("work")
    parser.add_argument("result")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    work = Path(args.work)

    verifier, target = build_target(args.tokenizer, work)
    target_logits = write_hidden_states(target, args.data_path)

    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig

    flags = [
        f"--verifier-name-or-path={verifier}",
        f"--data-path={args.data_path}",
        f"--save-path={work / 'checkpoints'}",
        "--speculator-type=eagle3",
        "--num-layers=1",
        "--target-layer-ids",
        *map(str, AUX),
        "--draft-attn-impl=sdpa",
        "--hidden-states-dtype=float32",
        "--loss-implementation=eager",
        "--total-seq-len=2048",
        "--num-workers=0",
        "--on-missing=raise",
        "--lr=0.003",
        "--seed=0",
    ]
    cfg = TrainConfig.resolve(flags)
    ns = argparse.Namespace(**cfg.flatten())
    set_seed(ns.seed, ns.deterministic_cuda)
    if not ns.draft_mrope_full_head_hack:
        install_partial_neox_rotary()
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(ns)
    model_class = SpeculatorModel.registry[ns.speculator_type]
    draft = build_draft_model(ns, model_class, t2d, d2t, draft_vocab_size)
    hidden_size = draft.config.transformer_layer_config.hidden_size
    train_loader, _ = create_train_val_loaders(
        data_path=ns.data_path,
        total_seq_len=ns.total_seq_len,
        hidden_states_dtype=torch.float32,
        transfer=None,
        vllm_endpoint=ns.vllm_endpoint,
        on_missing=ns.on_missing,
        verifier_name_or_path=ns.verifier_name_or_path,
        request_timeout=ns.request_timeout,
        max_retries=ns.max_retries,
        generation_validation_retries=ns.generation_validation_retries,
        max_consecutive_generation_failures=ns.max_consecutive_generation_failures,
        hidden_size=hidden_size,
        num_target_layers=len(draft.target_layer_ids),
        num_workers=0,
        prefetch_factor=ns.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=ns.train_data_ratio,
        seed=ns.seed,
    )
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(ns))
    optimizers = build_optimizers(
        draft, TrainerConfig(lr=ns.lr, num_epochs=1, save_path=ns.save_path)
    )

    batch = next(iter(train_loader))
    dataset = train_loader.dataset
    # The drafter's targets are the target's logits: its verifier_norm and
    # verifier_lm_head (loaded from the verifier) over the stored last hidden states.
    first = dataset[0]
    with torch.no_grad():
        mine = draft.verifier_lm_head(draft.verifier_norm(first["verifier_last_hidden_states"]))
    targets_match = bool(torch.allclose(mine, target_logits[0], atol=1e-4))

    draft.train()
    losses: list[float] = []
    accuracy: list[float] = []
    for _ in range(args.steps):
        _tokens, loss, metrics = draft(**batch, **train_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(float(loss.detach()))
        total = max(float(metrics["full_acc_0_total"]), 1.0)
        accuracy.append(float(metrics["full_acc_0_sum"]) / total)

    lengths = batch["document_ids"][0]
    result: dict[str, Any] = {
        "model_class": f"{type(draft).__module__}.{type(draft).__name__}",
        "loss": [f"{f.__module__}.{f.__name__}" for f, _ in train_kwargs["loss_config"].values()],
        "ttt_steps": train_kwargs["ttt_steps"],
        "parameters": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "losses": losses,
        "accuracy_step0": accuracy,
        "finite": all(math.isfinite(x) for x in losses),
        "targets_match_target_logits": targets_match,
        "batch_tokens": int((lengths != -1).sum()),
        "batch_documents": int(lengths.max()) + 1,
        "batch_input_ids": batch["input_ids"][0].tolist(),
        "batch_loss_mask": batch["loss_mask"][0].tolist(),
        "batch_document_ids": lengths.tolist(),
        "train_rows": len(dataset),
        "row_ids": [int(i) for i in load_from_disk(args.data_path)["id"]],
    }
    with open(args.result, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
