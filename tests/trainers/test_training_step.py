"""EAGLE-3 drafter steps on an export (issue 29, part 3): a simulator run exported
``--for speculators``, a tiny random-weight Llama target built locally from a config (its
hidden states stand in for vLLM's), and speculators 0.9.0's own drafter
(``Eagle3DraftModel``), data path (``ArrowDataset``, ``shift_batch``, the multipack sampler,
``CollateFn``) and loss (eager ``kl_div``), driven on CPU by its Trainer's step code: its
``Trainer`` itself needs a CUDA device. loaders/speculators_train.py says exactly what runs.

SpecForge's loss is Triton-only: for SpecForge this tier proves loading and masks
(test_specforge.py), not a step."""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

from core.settings import Settings
from tests.helpers import InspectRepository
from tests.trainers.runs import export, generate, in_venv, stored

STEPS = 15


def test_speculators_drafter_steps_on_an_export_lower_a_finite_loss(
    settings: Settings, repo: InspectRepository, tmp_path: Path, trainers_python: Path
) -> None:
    [(family, tokenizer)] = generate(settings, repo, tmp_path, ["kimi_k2"]).items()
    database = stored(repo, family)
    out = tmp_path / "out"
    export(settings, family, out, "--for", "speculators", "--include-truncated")
    (tmp_path / "work").mkdir()
    result = in_venv(
        trainers_python,
        "speculators_train.py",
        str(out / "train"),
        str(tokenizer),
        str(tmp_path / "work"),
        "--steps",
        str(STEPS),
        str(tmp_path / "train.json"),
        timeout=280,
    )
    assert result["model_class"] == "speculators.models.eagle3.core.Eagle3DraftModel"
    assert result["loss"] == ["speculators.losses.eager.kl_div_loss"]
    assert result["targets_match_target_logits"], "the hidden states are not the target's"
    losses = result["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    # A fixed batch, a seeded model on CPU: each step lowers the loss.
    assert all(later < earlier for earlier, later in pairwise(losses)), losses

    # The packed batch is the database's rows: each document is a row's ids and mask
    # shifted by one (shift_batch: the first id has no prediction), the last one possibly
    # cut at --total-seq-len.
    ids, mask = result["batch_input_ids"], result["batch_loss_mask"]
    docs = result["batch_document_ids"]
    rows = {tuple(s.input_ids[1:]): s.loss_mask[1:] for s in database.values()}
    assert result["batch_documents"] > 1
    last = result["batch_documents"] - 1
    for doc in range(last + 1):
        at = [i for i, d in enumerate(docs) if d == doc]
        doc_ids, doc_mask = tuple(ids[i] for i in at), [mask[i] for i in at]
        if doc < last:
            assert rows.get(doc_ids) == doc_mask, f"document {doc} is not a row's ids and mask"
        else:
            cut = [key for key in rows if key[: len(doc_ids)] == doc_ids]
            assert any(rows[key][: len(doc_mask)] == doc_mask for key in cut), doc
