"""Iteration-level scheduling: which sequences run this step and how many tokens each; decides,
never touches tensors. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.fair_share import FairShare
from inferline.worker.engine.sequence import Sequence, SequenceStatus
from inferline.worker.engine.spec_decode import NgramProposer, can_speculate


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # rows this step computes: known tokens, then the drafts
    spec_token_ids: list[int] = field(default_factory=list)  # drafts after the known tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a token is sampled."""
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
    """Sequences of `priority` or worse are background work (docs/batch.md, "Priorities")."""

    priority: int
    max_tokens: int
    alone_max_tokens: int | None = None  # None: no bound with no foreground work
    quiet_s: float = 10.0  # without foreground work this long, alone_max_tokens no longer applies

    def is_background(self, seq: Sequence) -> bool:
        return seq.priority >= self.priority


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "continuous",
        proposer: NgramProposer | None = None,
        spec_disable_batch_size: int | None = None,
        background: BackgroundLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
        fair: FairShare | None = None,
    ):
        assert policy in ("continuous", "static")
        self.background = background
        self.clock = clock  # seconds; injectable for virtual time
        self.foreground_seen_at: float | None = None
        self.num_steps = 0
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.proposer = proposer  # None: no speculative decoding
        self.spec_disable_batch_size = spec_disable_batch_size
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        # Who is admitted next within a priority class, who is preempted first: tenants' shares.
        self.fair = fair if fair is not None else FairShare()
        self.running: list[Sequence] = []
        # Out of the batch, blocks kept: the token in flight ends them (worker/engine/overlap.py).
        self.held: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new sequence waits (its tenant's share counts it from now)."""
        self.fair.join(seq)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        self.fair.enqueue(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of any queue and give its blocks back."""
        for queue in (self.running, self.waiting, self.held):
            if seq in queue:
                queue.remove(seq)
                if queue is self.waiting:
                    self.fair.dequeue(seq)
                self.fair.leave(seq)
                break
        self.block_manager.free(seq)

    def hold(self, seq: Sequence) -> None:
        """Keep a running sequence out of the next schedules until remove(): its last token, still
        on the device, certainly ends it."""
        self.running.remove(seq)
        self.held.append(seq)

    def owners(self) -> list[Sequence]:
        """Every sequence that may hold blocks."""
        return self.running + self.waiting + self.held

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        if self.block_manager.window is not None:  # blocks behind the sliding window go back first
            for seq in self.running:
                self.block_manager.free_behind_window(seq)
        seats = self._background_seats()
        budget = self._schedule_running(out, self.max_num_batched_tokens, seats)
        if self.policy == "continuous":
            self._schedule_waiting(out, budget, seats=seats)
        elif not self.running:
            # Static batching: a new batch forms only when the last one is done.
            self._schedule_waiting(out, budget, whole_batch=True)
        for c in out.scheduled:
            c.seq.last_scheduled_step = self.num_steps
        return out

    def _background_seats(self) -> list[int] | None:
        """Background tokens this step may compute ([n], spent by the step), or None: no limit."""
        bg = self.background
        if bg is None or self.policy != "continuous":
            return None
        foreground = [s for s in (*self.running, *self.waiting) if not bg.is_background(s)]
        if not foreground:
            seen_at = self.foreground_seen_at
            recent = seen_at is not None and self.clock() - seen_at < bg.quiet_s
            return [bg.alone_max_tokens] if recent and bg.alone_max_tokens is not None else None
        self.foreground_seen_at = self.clock()
        prompt = any(
            s.num_uncomputed_tokens > 1 or s.status is SequenceStatus.WAITING for s in foreground
        )
        return [0 if prompt else bg.max_tokens]

    def _resting(self, seats: list[int] | None) -> set[Sequence]:
        """The running background sequences that sit this step out: seats go to the least recently
        run, waiting ones first if they fit."""
        if seats is None:
            return set()
        free = max(0, self.max_num_seqs - len(self.running))
        waiting = [s for s in self.waiting if self.background.is_background(s)][:free]
        running = [s for s in self.running if self.background.is_background(s)]
        turn, left = set(), seats[0]
        # lazy: memory is checked only when the seats reach a waiting sequence
        for s in itertools.chain(
            itertools.takewhile(self._fits, waiting),
            sorted(running, key=lambda s: (s.last_scheduled_step, s.sort_key)),
        ):
            if left <= 0:
                break
            turn.add(s)
            left -= s.num_uncomputed_tokens
        return {s for s in self.running if self.background.is_background(s) and s not in turn}

    def _fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        return bm.can_allocate(bm.num_blocks_to_admit(seq, bm.cached_prefix(seq)))

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, seats: list[int] | None = None
    ) -> int:
        self.running.sort(key=self.fair.rank)
        resting = self._resting(seats)
        # Best first, the resting at the end: victims come from the end.
        queue = [s for s in self.running if s not in resting] + [
            s for s in self.running if s in resting
        ]
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
            self.fair.charge(seq, num_new + len(drafts))
            budget -= num_new + len(drafts)
            self._take_seats(seq, seats, num_new + len(drafts))
        return budget

    def _seats_left(self, seq: Sequence, seats: list[int] | None) -> int:
        if seats is None or not self.background.is_background(seq):
            return self.max_num_batched_tokens
        return seats[0]

    def _take_seats(self, seq: Sequence, seats: list[int] | None, num_new: int) -> None:
        if seats is not None and self.background.is_background(seq):
            seats[0] -= num_new

    def _drafts(self, seq: Sequence, budget: int, num_later: int) -> list[int]:
        """Drafts within the leftover `budget` and max_tokens; none needing a new block while a
        request waits or the `num_later` sequences after `seq` may need the free ones."""
        if (
            self.proposer is None
            or not can_speculate(seq.sampling)
            or (self.spec_disable_batch_size and len(self.running) >= self.spec_disable_batch_size)
        ):
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

    def _make_room(
        self, seq: Sequence, num_new: int, queue: list[Sequence], out: SchedulerOutput
    ) -> bool:
        """Preempt the worst not-yet-scheduled running sequences until `seq` fits."""
        while not self.block_manager.can_append(seq, num_new):
            victim = queue.pop() if queue else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        whole_batch: bool = False,
        seats: list[int] | None = None,
    ) -> None:
        full: set[str] = set()  # tenants at their share of the seats: the others go first
        while self.waiting and (budget > 0 or whole_batch):
            seq = self.fair.pick(full)  # the best priority's, by tenants' shares
            if seq is None or self._seats_left(seq, seats) <= 0:
                break  # picks are in priority order: only background is left
            cached = self.block_manager.cached_prefix(seq)
            if not self._admit(seq, cached, out):
                at_share = self.fair.at_share(seq, self.running, self.max_num_seqs)
                if seq.tenant in at_share:
                    full |= at_share
                    continue
                break  # strict order: nobody jumps a request waiting for memory
            self.waiting.remove(seq)
            self.fair.dequeue(seq)
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
                self.fair.charge(seq, num_new)
                self._take_seats(seq, seats, num_new)
            budget -= num_new

    def _admit(self, seq: Sequence, cached: list[int], out: SchedulerOutput) -> bool:
        """Room and a seat for `seq`'s uncomputed prompt, preempting strictly worse running
        sequences, or equal ones of a tenant over its share (their blocks stay cached: `cached`
        holds)."""
        while len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(
            self.block_manager.num_blocks_to_admit(seq, cached)
        ):
            victim = max(self.running, key=self.fair.rank, default=None)
            if victim is None or victim.priority <= seq.priority:
                # Equal priorities: only a tenant over its share of the seats gives one up.
                victim = self.fair.over_share(seq, self.running, self.max_num_seqs)
            if victim is not None:
                self._unschedule(victim, out)
                self._preempt(victim, out)
            elif self.running or not self._release_held(seq):
                return False
        return True

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take `seq`'s chunk out of this step: it is not computed after all."""
        for chunk in [c for c in out.scheduled if c.seq is seq]:
            out.scheduled.remove(chunk)
            self.fair.charge(seq, -chunk.num_new_tokens)

    def _release_held(self, seq: Sequence) -> bool:
        """Nothing runs to free memory: the worst waiting fork drops its shared prompt blocks."""
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
        self._enqueue(seq)
