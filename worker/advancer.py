"""The advancer: after each settled turn of an on-policy conversation, its next turn.

Each run's conversations are advanced by one worker process of the cluster: the one that
holds the run's ``keys.advancer_lock`` (as the feeder and the reconciler hold theirs) and
can load the run's tokenizer. Each pass reads the conversations whose latest turn is settled
(the trigger of migration 0011 marks them 'waiting', in the transaction that settled the
turn) and decides each in one transaction (models.conversations.settle_conversation):

- the latest turn failed for good: the conversation ends (``failed``); skipped by a spent
  budget: it ends (``budget``);
- it is done: ``core.onpolicy.next_turn`` makes the next prompt from the model's own
  answers, and its job is inserted, queued ahead of the dataset's conversations not begun;
  or the conversation ends (truncated, tool divergence, too long, template error) or is done.

A pass killed anywhere leaves the conversation waiting and the next pass decides it again:
the decision re-checks what it read, and the (conversation, turn) key admits one job per
turn. The run's tokenizer is loaded from the folder the run recorded, checked by its
hashes: a process that cannot load it says why once, gives the run's lock up for a worker
that has it, and tries again after RETRY_LOAD_S.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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
# How long a run's tokenizer that could not be loaded here is not tried again.
RETRY_LOAD_S = 300.0
# A run's lock outlives a few passes; a holder that stops loses it after this.
LOCK_TTL_S = 10.0
# A next turn's server hint outlives any wait in the queue that a cache could survive.
HINT_TTL_S = 6 * 3600
# Conversations decided per pass: a pass stays short, the next one takes the rest.
BATCH = 256


@dataclass
class Advancer:
    """Decides waiting conversations, run by run: each run by the one process that holds
    its lock (``hold``) and can load its tokenizer."""

    repo: Repository
    # Take or keep a run's lock (``worker.leader.Leadership.hold``), and give it up.
    hold: Callable[[int], bool]
    release: Callable[[int], None]
    # Where a next turn's server hint goes (None: no hints, as with turn affinity off).
    redis: redis.Redis | None = None
    queue: str = ""
    # Each run's tokenizer once loaded; why it cannot be loaded here, and when that was
    # found (tried again after RETRY_LOAD_S: a folder may be mounted meanwhile).
    _tokenizers: dict[int, RunTokenizer] = field(default_factory=dict)
    _cannot: dict[int, tuple[str, float]] = field(default_factory=dict)

    def advance(self) -> int:
        """One pass: for each run with waiting conversations that this process can hold and
        load, decide up to BATCH of them; how many were decided. A run whose tokenizer is
        not here is left to a process that has it: its lock is given up."""
        decided = 0
        for run_id in self.repo.runs_waiting():
            if self._cannot_load(run_id) or not self.hold(run_id):
                continue
            tokenizer = self._tokenizer(run_id)
            if tokenizer is None:
                self.release(run_id)
                continue
            for conversation in self.repo.waiting_conversations(run_id, BATCH):
                decided += self._decide(conversation, tokenizer)
        return decided

    def release_all(self) -> None:
        """Give up the locks of the runs this process advanced (at stop)."""
        for run_id in self._tokenizers:
            self.release(run_id)

    def _cannot_load(self, run_id: int) -> bool:
        found = self._cannot.get(run_id)
        return found is not None and time.monotonic() - found[1] < RETRY_LOAD_S

    def _decide(self, conversation: WaitingConversation, tokenizer: RunTokenizer) -> bool:
        turns = self.repo.conversation_turns(conversation.id)
        if len(turns) != conversation.turns:
            return False  # read between a new turn's insert and its commit: next pass
        latest = turns[-1]
        if latest.state == JobState.FAILED.value:
            return self._settle(conversation, latest.state, Step(ended=FAILED), None)
        if latest.state == JobState.SKIPPED_BUDGET.value:
            return self._settle(conversation, latest.state, Step(ended=BUDGET), None)
        if latest.state != JobState.DONE.value:
            return False  # sent back to the queue meanwhile: active again
        answers = [
            Answer(t.output_ids or [], t.opens_reasoning, t.finish_type or "")
            for t in turns
            if t.state == JobState.DONE.value
        ]
        step = next_turn(
            tokenizer.with_template_kwargs(conversation.template_kwargs),
            Prompt.of(conversation.source),
            answers,
            stored_stop_ids(conversation.sampling_params),
            points=conversation.points,
            max_new_tokens=conversation.max_new_tokens,
            max_context_len=conversation.max_context_len,
        )
        return self._settle(conversation, latest.state, step, latest.server)

    def _settle(
        self, conversation: WaitingConversation, latest: str, step: Step, server: str | None
    ) -> bool:
        """Store the decision; a next turn's job is pointed at ``server``, the one that
        generated the turn before it (a hint the attempt follows when that server has room;
        one lost to a Redis outage only costs the cache hit)."""
        job = None
        if step.input_ids is not None and step.messages is not None:
            job = NextTurn(step.input_ids, step.messages, step.opens_reasoning)
        settled = self.repo.settle_conversation(
            conversation.id, conversation.turns, latest=latest, next_turn=job, ended=step.ended
        )
        if settled is None:
            return False
        if settled.job_id is not None and server is not None and self.redis is not None:
            self.redis.set(keys.turn_server(self.queue, settled.job_id), server, ex=HINT_TTL_S)
        return True

    def _tokenizer(self, run_id: int) -> RunTokenizer | None:
        """The run's tokenizer, loaded once; None (said once per reason) when it cannot be
        loaded here."""
        if run_id in self._tokenizers:
            return self._tokenizers[run_id]
        found = self._load(run_id)
        if isinstance(found, str):
            if self._cannot.get(run_id, ("",))[0] != found:
                log.error("advancer: run %d: %s", run_id, found)
            self._cannot[run_id] = (found, time.monotonic())
            return None
        self._cannot.pop(run_id, None)
        self._tokenizers[run_id] = found
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
