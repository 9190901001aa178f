"""The advancer: after each settled turn of an on-policy conversation, its next turn.

One worker of the cluster advances (it holds ``keys.advancer_lock``, as the feeder and the
reconciler hold theirs). Each pass reads the conversations whose latest turn is settled
(the trigger of migration 0011 marks them 'waiting', in the transaction that settled the
turn) and decides each in one transaction (models.conversations.settle_conversation):

- the latest turn failed for good: the conversation ends (``failed``); skipped by a spent
  budget: it ends (``budget``);
- it is done: ``core.onpolicy.next_turn`` makes the next prompt from the model's own
  answers, and its job is inserted, queued ahead of the dataset's conversations not begun;
  or the conversation ends (truncated, tool divergence, too long, template error) or is done.

A pass killed anywhere leaves the conversation waiting and the next pass decides it again:
the decision re-checks what it read, and the (conversation, turn) key admits one job per
turn. The run's tokenizer is loaded from the folder the run recorded, checked by its hash:
a worker host without it says so once and leaves the run's conversations waiting for a
worker that has it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import redis

from core import keys
from core.dialogue import FAILED
from core.onpolicy import Answer, Step, next_turn
from core.tokenizer import RunTokenizer, stored_stop_ids
from core.turns import Prompt
from models.conversations import BUDGET, NextTurn, WaitingConversation
from models.repository import Repository
from models.states import JobState

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
# A next turn's server hint outlives any wait in the queue that a cache could survive.
HINT_TTL_S = 6 * 3600
# Conversations decided per pass: a pass stays short, the next one takes the rest.
BATCH = 256


@dataclass
class Advancer:
    """Decides waiting conversations; one per worker process, run by the lock's holder."""

    repo: Repository
    # Where a next turn's server hint goes (None: no hints, as with turn affinity off).
    redis: redis.Redis | None = None
    queue: str = ""
    # Each run's tokenizer once loaded, or why it cannot be here (said once).
    _tokenizers: dict[int, RunTokenizer | str] = field(default_factory=dict)

    def advance(self) -> int:
        """One pass: decide up to BATCH waiting conversations; how many were decided."""
        decided = 0
        for conversation in self.repo.waiting_conversations(BATCH):
            tokenizer = self._tokenizer(conversation.run_id)
            if isinstance(tokenizer, str):
                continue  # waits for a worker with the tokenizer
            decided += self._decide(conversation, tokenizer)
        return decided

    def _decide(self, conversation: WaitingConversation, tokenizer: RunTokenizer) -> bool:
        turns = self.repo.conversation_turns(conversation.id)
        if len(turns) != conversation.turns:
            return False  # read between a new turn's insert and its commit: next pass
        latest = turns[-1]
        if latest.state == JobState.FAILED.value:
            return self._settle(conversation, Step(ended=FAILED), None)
        if latest.state == JobState.SKIPPED_BUDGET.value:
            return self._settle(conversation, Step(ended=BUDGET), None)
        if latest.state != JobState.DONE.value:
            return False  # sent back to the queue meanwhile: active again
        answers = [
            Answer(t.output_ids or [], t.opens_reasoning, t.finish_type or "")
            for t in turns
            if t.state == JobState.DONE.value
        ]
        step = next_turn(
            tokenizer,
            Prompt.of(conversation.source),
            answers,
            stored_stop_ids(conversation.sampling_params),
            points=conversation.points,
            max_new_tokens=conversation.max_new_tokens,
            max_context_len=conversation.max_context_len,
        )
        return self._settle(conversation, step, latest.server)

    def _settle(self, conversation: WaitingConversation, step: Step, server: str | None) -> bool:
        """Store the decision; a next turn's job is pointed at ``server``, the one that
        generated the turn before it (a hint the attempt follows when that server has room;
        one lost to a Redis outage only costs the cache hit)."""
        job = None
        if step.input_ids is not None and step.messages is not None:
            job = NextTurn(step.input_ids, step.messages, step.opens_reasoning)
        settled = self.repo.settle_conversation(
            conversation.id, conversation.turns, next_turn=job, ended=step.ended
        )
        if settled is None:
            return False
        if settled.job_id is not None and server is not None and self.redis is not None:
            self.redis.set(keys.turn_server(self.queue, settled.job_id), server, ex=HINT_TTL_S)
        return True

    def _tokenizer(self, run_id: int) -> RunTokenizer | str:
        found = self._tokenizers.get(run_id)
        if found is None:
            found = self._tokenizers[run_id] = self._load(run_id)
            if isinstance(found, str):
                log.error("advancer: %s", found)
        return found

    def _load(self, run_id: int) -> RunTokenizer | str:
        """The run's tokenizer as recorded, or why it cannot be loaded here."""
        recorded = self.repo.run_tokenization(run_id)
        path = Path(recorded.tokenizer_path)
        waiting = "its conversations wait for a worker that has it"
        if not path.is_dir():
            return f"the run's tokenizer {path} is not on this host; {waiting}"
        try:
            tokenizer = RunTokenizer(
                path,
                trust_remote_code=recorded.trust_remote_code,
                template_kwargs=recorded.chat_template_kwargs,
                family=recorded.family,
                recorded_template_sha256=recorded.chat_template_sha256,
            )
        except ValueError as exc:
            return f"{exc}; {waiting}"
        if tokenizer.tokenizer_sha256() != recorded.tokenizer_sha256:
            return f"the tokenizer at {path} is not the one the run recorded; {waiting}"
        if not tokenizer.template_matches_run:
            return f"the chat template at {path} is not the one the run recorded; {waiting}"
        return tokenizer
