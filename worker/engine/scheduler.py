"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

One token budget (`max_num_batched_tokens`) is shared by decodes and prefill chunks, so a long
prompt is split over several steps instead of stalling every running decode (chunked prefill).
Order everywhere is (priority, arrival): lower priority values first, FCFS within a priority.

Memory policy:
- a waiting sequence is admitted only when the blocks for its whole uncomputed prompt are free;
  blocks of its prefix found in the prefix cache are shared, not allocated, and not computed;
- a running sequence that cannot get its next block preempts (by recompute) the worst running
  sequence, possibly itself, never a better one;
- a waiting sequence that cannot be admitted may preempt running sequences that are strictly
  worse in priority (vLLM only preempts on a failed append);
- a forked sample (n > 1) waits holding its prompt's shared blocks, and lets go of them when
  nothing runs and the head of the queue cannot be admitted without them;
- speculative drafts (spec_decode.py) ride along only where token budget and KV slots are left
  over: a draft never preempts anybody, nor takes a block a waiting request could be admitted to.

Background work (BackgroundLimit: priority at or past a threshold, a batch's class) shares steps
with foreground work only narrowly: while a foreground request runs or waits, background
sequences run in turns, computing at most `max_tokens` a step between them (a prompt is chunked
to fit), and none in a step that computes a foreground prompt. On a CPU a step's length grows
with its tokens, so this bounds what a batch adds to an interactive request's first token. With
no foreground work the batch runs at full width, or, with `alone_max_tokens` set, at most that
many tokens a step until `quiet_s` have passed without foreground work: a request that arrives
between interactive ones then waits for a short step, not a full-width one.

The scheduler decides and never touches tensors.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.sequence import Sequence, SequenceStatus
from inferline.worker.engine.spec_decode import NgramProposer, can_speculate


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # rows this step computes: known tokens, then the drafts
    spec_token_ids: list[int] = field(default_factory=list)  # drafts after the known tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a token is sampled
        (with drafts: a token per row, from the last known token's row on)."""
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.seq.num_computed_tokens + num_known == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # scheduled for the first time ever

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class BackgroundLimit:
    """Sequences of `priority` or worse are background: beside foreground work, at most
    `max_tokens` of theirs a step (in turns; a prompt counts every token it computes, so it is
    chunked), and none in a step with a foreground prompt. On a CPU a step's length grows with
    its tokens, and an interactive request that arrives waits for the step in flight."""

    priority: int
    max_tokens: int
    alone_max_tokens: int | None = None  # None: no bound with no foreground work
    quiet_s: float = 10.0  # without foreground work this long, alone_max_tokens no longer applies

    def is_background(self, seq: Sequence) -> bool:
        return seq.priority >= self.priority


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, policy: str = "continuous",
                 proposer: NgramProposer | None = None, spec_disable_batch_size: int | None = None,
                 background: BackgroundLimit | None = None, clock: Callable[[], float] = time.monotonic):
        assert policy in ("continuous", "static")
        self.background = background
        self.clock = clock  # seconds; a simulator gives it virtual time
        self.foreground_seen_at: float | None = None
        self.num_steps = 0
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.proposer = proposer  # None: no speculative decoding
        self.spec_disable_batch_size = spec_disable_batch_size
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        seats = self._background_seats()
        budget = self._schedule_running(out, self.max_num_batched_tokens, seats)
        if self.policy == "continuous":
            self._schedule_waiting(out, budget, seats=seats)
        elif not self.running:
            # Static batching: a new batch forms only when the last one is done; its members
            # are admitted together and their prompts run over the next steps as budget allows.
            self._schedule_waiting(out, budget, whole_batch=True)
        for c in out.scheduled:
            c.seq.last_scheduled_step = self.num_steps
        return out

    def _background_seats(self) -> list[int] | None:
        """How many background tokens this step may compute ([n]: a counter the step spends), or
        None for no limit: no BackgroundLimit, or no foreground work (for `quiet_s`, where
        `alone_max_tokens` is set)."""
        bg = self.background
        if bg is None or self.policy != "continuous":
            return None
        foreground = [s for s in (*self.running, *self.waiting) if not bg.is_background(s)]
        if not foreground:
            seen_at = self.foreground_seen_at
            recent = seen_at is not None and self.clock() - seen_at < bg.quiet_s
            return [bg.alone_max_tokens] if recent and bg.alone_max_tokens is not None else None
        self.foreground_seen_at = self.clock()
        prompt = any(s.num_uncomputed_tokens > 1 or s.status is SequenceStatus.WAITING for s in foreground)
        return [0 if prompt else bg.max_tokens]

    def _resting(self, seats: list[int] | None) -> set[Sequence]:
        """The running background sequences that sit this step out: the seats go to the least
        recently run background sequences, running or waiting (a waiting one first, as many as
        the batch has free places and memory for: a seat given to one that cannot be admitted
        would stall every background sequence), each taking the tokens it needs (a prompt: up to
        what is left)."""
        if seats is None:
            return set()
        free = max(0, self.max_num_seqs - len(self.running))
        waiting = [s for s in self.waiting if self.background.is_background(s)][:free]
        running = [s for s in self.running if self.background.is_background(s)]
        turn, left = set(), seats[0]
        # lazy: a waiting sequence's memory is checked only when the seats reach it
        for s in itertools.chain(itertools.takewhile(self._fits, waiting),
                                 sorted(running, key=lambda s: (s.last_scheduled_step, s.sort_key))):
            if left <= 0:
                break
            turn.add(s)
            left -= s.num_uncomputed_tokens
        return {s for s in self.running if self.background.is_background(s) and s not in turn}

    def _fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        return bm.can_allocate(bm.num_blocks_to_admit(seq, bm.cached_prefix(seq)))

    def _schedule_running(self, out: SchedulerOutput, budget: int, seats: list[int] | None = None) -> int:
        self.running.sort(key=lambda s: s.sort_key)
        resting = self._resting(seats)
        # Best first, the resting at the end: victims come from the end.
        queue = [s for s in self.running if s not in resting] + [s for s in self.running if s in resting]
        while queue and budget > 0 and queue[0] not in resting:
            seq = queue.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget, self._seats_left(seq, seats))
            if num_new <= 0:
                continue
            if not self._make_room(seq, num_new, queue, out):
                continue  # seq preempted itself
            decoding = num_new == seq.num_uncomputed_tokens == 1
            room = min(budget, self._seats_left(seq, seats)) - num_new
            drafts = self._drafts(seq, room, len(queue)) if decoding else []
            self.block_manager.append(seq, num_new + len(drafts))
            out.scheduled.append(ScheduledSequence(seq, num_new + len(drafts), drafts))
            budget -= num_new + len(drafts)
            self._take_seats(seq, seats, num_new + len(drafts))
        return budget

    def _seats_left(self, seq: Sequence, seats: list[int] | None) -> int:
        """The tokens `seq` may compute this step as far as the background limit goes."""
        if seats is None or not self.background.is_background(seq):
            return self.max_num_batched_tokens
        return seats[0]

    def _take_seats(self, seq: Sequence, seats: list[int] | None, num_new: int) -> None:
        if seats is not None and self.background.is_background(seq):
            seats[0] -= num_new

    def _drafts(self, seq: Sequence, budget: int, num_later: int) -> list[int]:
        """Drafts for a decoding `seq`, within the leftover token `budget` and the request's own
        max_tokens. Drafts that need a new block get none while a request waits (its admission
        comes first) or while the `num_later` running sequences after `seq` may need the free ones."""
        if (self.proposer is None or not can_speculate(seq.sampling)
                or (self.spec_disable_batch_size and len(self.running) >= self.spec_disable_batch_size)):
            return []
        # Every draft accepted plus the step's own token must stay within max_tokens.
        limit = min(budget, seq.sampling.max_tokens - seq.num_output_tokens - 1)
        drafts = self.proposer.propose(seq.token_ids, limit)
        bm, needed = self.block_manager, self.block_manager.num_new_blocks(seq, 1)
        blocks = bm.num_new_blocks(seq, 1 + len(drafts))
        if blocks > needed and (self.waiting or bm.num_free_blocks - blocks < num_later):
            # Only the slots left in the blocks the next token has anyway.
            slots = (len(seq.block_table) + needed) * bm.block_size - seq.num_computed_tokens - 1
            drafts = drafts[:slots]
        return drafts

    def _make_room(self, seq: Sequence, num_new: int, queue: list[Sequence],
                   out: SchedulerOutput) -> bool:
        """Preempt the worst not-yet-scheduled running sequences until `seq` fits."""
        while not self.block_manager.can_append(seq, num_new):
            victim = queue.pop() if queue else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, whole_batch: bool = False,
                          seats: list[int] | None = None) -> None:
        while self.waiting and (budget > 0 or whole_batch):
            seq = self.waiting[0]
            if self._seats_left(seq, seats) <= 0:
                break  # the waiting queue is in priority order: only background is left
            cached = self.block_manager.cached_prefix(seq)
            if not self._admit(seq, cached, out):
                break  # strict (priority, arrival) order: nobody jumps a request that waits for memory
            self.waiting.pop(0)
            # Reserve the whole prompt now, so later admissions in this step cannot overcommit.
            self.block_manager.allocate(seq, cached)
            budget = self.max_num_batched_tokens - out.num_batched_tokens  # preemption frees budget
            num_new = max(0, min(seq.num_uncomputed_tokens, budget, self._seats_left(seq, seats)))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.first_scheduled_time is None:
                out.started.append(seq)
            if num_new:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                self._take_seats(seq, seats, num_new)
            budget -= num_new

    def _admit(self, seq: Sequence, cached: list[int], out: SchedulerOutput) -> bool:
        """Room for `seq`'s whole uncomputed prompt (past its `cached` blocks) and a seat in the
        batch, preempting running sequences of strictly worse priority (even ones already
        scheduled this step). A preempted victim's blocks stay cached: `cached` stays valid."""
        while (len(self.running) >= self.max_num_seqs
               or not self.block_manager.can_allocate(self.block_manager.num_blocks_to_admit(seq, cached))):
            victim = max(self.running, key=lambda s: s.sort_key, default=None)
            if victim is not None and victim.priority > seq.priority:
                out.scheduled = [c for c in out.scheduled if c.seq is not victim]
                self._preempt(victim, out)
            elif self.running or not self._release_held(seq):
                return False
        return True

    def _release_held(self, seq: Sequence) -> bool:
        """Nothing runs, so nothing will free memory: the worst waiting fork (a sample holding
        its prompt's shared blocks, engine.py) lets go of them and will compute them again."""
        holders = [s for s in self.waiting if s.block_table and s is not seq]
        if not holders:
            return False
        self.block_manager.free(holders[-1])
        holders[-1].num_computed_tokens = 0
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV cache, keep the tokens, start over later."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
