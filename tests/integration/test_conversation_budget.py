"""A budget-capped dataset of on-policy conversations (issue 30) holds whole conversations:
a next turn is published ahead of the conversations not begun, so a spent budget cuts few
halfway. What decides it is the feeder's order and the advancer (worker.background's side
loops, the same on either engine): it runs against the default engine only, where the rest
of the conversation tests run against each (tests.workers.EACH_ENGINE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select, text

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from models.repository import Repository
from models.schema import Conversation
from tests.helpers import write_jsonl
from tests.integration.test_conversations import FAST, chat, dataset_of, wait_conversations
from tests.workers import in_thread_worker

# A budget-capped dataset of on-policy conversations (three turns each, a budget of about a
# third of every turn), run with little room for reordering: two threads, a window of two,
# turns of about half a second (30 tokens of 15 ms) against the advancer's 1 s passes.
CAPPED_ROWS = 36
CAPPED_POINTS = 3
CAPPED_THREADS = 2
CAPPED_WINDOW = 2
CAPPED_SIM: dict[str, Any] = {**FAST, "decode_step_ms": 15.0}
# Conversations a spent budget may cut halfway. Only those open when it ran out can be:
# running (threads), published (window), or settled since the advancer's last pass, whose
# next turn does not exist yet so the feeder begins others meanwhile (about two turns per
# thread in a 1 s pass at this speed).
CAPPED_CUT_BOUND = CAPPED_THREADS + CAPPED_WINDOW + 2 * CAPPED_THREADS
# The control: each next turn queued behind the dataset's conversations not begun (its
# first turn's key moved past every key, which are 60 bits), the opposite of the rule.
_BEHIND_SQL = """
CREATE FUNCTION behind_new_conversations() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.sort_key := NEW.sort_key + (1::bigint << 60);
  RETURN NEW;
END $$;
CREATE TRIGGER behind_new_conversations BEFORE INSERT ON jobs
  FOR EACH ROW WHEN (NEW.turn > 0) EXECUTE FUNCTION behind_new_conversations();
"""


def test_a_budget_capped_dataset_holds_whole_conversations(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    """A budget of about a third of every turn cuts few conversations halfway: a next turn
    takes its conversation's first sort_key, so the feeder publishes it ahead of the
    conversations not begun, and only those open when the budget ran out are cut
    (CAPPED_CUT_BOUND). The control runs the same dataset with each next turn queued behind
    the conversations not begun: it cuts more than the bound, and several times the
    conversations the rule cuts."""
    rows = [
        chat(f"Row {i}: name a colour.", "Blue.", "Another?", "Red.", "Mix them?")
        for i in range(CAPPED_ROWS)
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    budget = CAPPED_ROWS * CAPPED_POINTS // 3 * FAST["mean_output_tokens"]
    with SimServer(SimConfig(**CAPPED_SIM)) as sim:
        served = settings.model_copy(
            update={
                "servers": [ServerSpec(name="sim", url=sim.url)],
                "worker_concurrency": CAPPED_THREADS,
                "window": CAPPED_WINDOW,
                "budget_defer_s": 0.2,
            }
        )
        prioritized = _run_capped(served, repo, path, "prioritized", budget)
        with repo.engine.begin() as conn:
            conn.execute(text(_BEHIND_SQL))
        control = _run_capped(served, repo, path, "control", budget)
    print(f"budget {budget}: prioritized {prioritized}, control {control}")
    for ends in (prioritized, control):
        assert set(ends) <= {"done", "cut", "not begun"}, ends
        assert sum(ends.values()) == CAPPED_ROWS, ends
    done, cut = prioritized.get("done", 0), prioritized.get("cut", 0)
    assert 0 < done < CAPPED_ROWS and cut < done, prioritized
    # Side by side, not against the bound alone: a loaded machine stretches the advancer's
    # pass against the turns, and may cut a few more (the bound says how many it should).
    assert control.get("cut", 0) > CAPPED_CUT_BOUND, control
    assert 3 * cut < control.get("cut", 0), (prioritized, control)


def _run_capped(
    settings: Settings, repo: Repository, path: Path, run: str, budget: int
) -> dict[str, int]:
    """Enqueue ``path`` as run ``run``'s dataset of conversations capped at ``budget``
    completion tokens, run it to the end; its conversations by how they ended: "done",
    "cut" (begun, a later turn skipped by the spent budget) or "not begun" (turn 0 skipped)."""
    from collections import Counter

    from eaglegen.assets import TOKENIZER_DIR
    from models.conversations import BUDGET
    from producer.commands import run_enqueue
    from producer.plan import DatasetPlan, RunPlan

    report = run_enqueue(
        settings,
        settings.services(),
        RunPlan(
            run=run,
            tokenizer=TOKENIZER_DIR,
            datasets=[
                DatasetPlan(
                    "d",
                    path,
                    sampling={"max_new_tokens": 150},
                    budget_tokens=budget,
                    turns="all",
                )
            ],
        ),
        quiet=True,
    )
    assert report.datasets[0].conversations == CAPPED_ROWS
    dataset = dataset_of(repo, run)
    with in_thread_worker(settings):
        counts = wait_conversations(repo, dataset, timeout_s=240)
    assert set(counts.ended_by_reason) <= {BUDGET}, counts
    with repo.engine.connect() as conn:
        rows = conn.execute(
            select(Conversation.state, Conversation.turns).where(Conversation.dataset_id == dataset)
        ).all()
    return dict(
        Counter(
            "done" if r.state == "done" else "cut" if r.turns > 1 else "not begun" for r in rows
        )
    )
