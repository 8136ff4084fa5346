"""Weighted fair share of the engine's steps among tenants, within a priority class; the scheduler
asks it whose waiting sequence is admitted next and whose running one is preempted first.
design: docs/operations.md#fair-share-between-tenants
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from inferline.worker.engine.sequence import Sequence


class FairShare:
    """Virtual token counters (VTC: Sheng et al., "Fairness in Serving Large Language Models",
    OSDI 2024), weighted. Each tenant's counter grows by the tokens the scheduler computes for it
    (prompt chunks and decodes alike: what a step's token budget is made of) over its weight; the
    next waiting sequence admitted, a seat and its share of the step's token budget, is the best
    priority's, and within that class the one of the tenant with the lowest counter.

    Why VTC rather than deficit round robin or start-time fair queuing: those charge a packet's
    size when it is sent, but a request's cost (its output length) is unknown until it ends, and
    a continuous batch serves many requests at once over many steps. VTC charges tokens as they
    are computed, step by step, and lifts a tenant whose first sequence arrives to the lowest
    counter of the tenants that wait, so idle time banks no credit and a newcomer takes no more
    than its share; the paper bounds the service gap between two backlogged tenants by a
    constant (the largest request and the batch), however long they stay backlogged.

    State: an entry per tenant with a sequence in the scheduler (waiting, running or held), gone
    with its last one; a tenant with nothing waiting or running costs nothing.
    """

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0):
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.counters: dict[str, float] = {}  # virtual tokens: computed tokens / weight
        self.members: dict[str, int] = {}  # sequences in the scheduler, by tenant
        self.waiting: dict[str, list[Sequence]] = {}  # each sorted by sort_key, never empty

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def join(self, seq: Sequence) -> None:
        """`seq` entered the scheduler (call before `enqueue`)."""
        tenant = seq.tenant
        if tenant not in self.waiting:
            # The lift: no credit for time without waiting work, no head start for a newcomer.
            # Against the tenants that wait, else those that run: a newcomer never starts at 0
            # beside busy tenants (renaming would buy their whole service again).
            rivals = [c for t, c in self.counters.items() if t != tenant]
            waiting = [self.counters[t] for t in self.waiting if t != tenant]
            floor = min(waiting or rivals, default=0.0)
            self.counters[tenant] = max(self.counters.get(tenant, floor), floor)
        self.members[tenant] = self.members.get(tenant, 0) + 1

    def leave(self, seq: Sequence) -> None:
        """`seq` left the scheduler for good (finished or aborted)."""
        tenant = seq.tenant
        self.members[tenant] -= 1
        if not self.members[tenant]:
            del self.members[tenant], self.counters[tenant]

    def enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting.setdefault(seq.tenant, []), seq, key=lambda s: s.sort_key)

    def dequeue(self, seq: Sequence) -> None:
        queue = self.waiting[seq.tenant]
        queue.remove(seq)
        if not queue:
            del self.waiting[seq.tenant]

    def pick(self, skip: set[str] = frozenset()) -> Sequence | None:
        """The waiting sequence to admit next: best priority, then lowest counter, then the
        tenant's own order (priority, arrival); none of the tenants in `skip`."""
        heads = [q[0] for t, q in self.waiting.items() if t not in skip]
        if not heads:
            return None
        best = min(h.priority for h in heads)
        return min((h for h in heads if h.priority == best), key=self._head_key)

    def _head_key(self, seq: Sequence) -> tuple[float, tuple[int, float]]:
        return (self.counters[seq.tenant], seq.sort_key)

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` computed (or, negative, given back) for `seq` this step."""
        self.counters[seq.tenant] += num_tokens / self.weight(seq.tenant)

    def over_share(self, seq: Sequence, running: list[Sequence], num_seats: int):
        """The running sequence to preempt so that waiting `seq` gets a seat, or None: one of a
        tenant that keeps at least its share of `num_seats` without it (most over its share, then
        latest), while `seq`'s tenant stays within its own. Seats, not counters: whoever holds
        the seats when a flood arrives would otherwise keep them until its requests end, and
        shares of seats cannot swing back and forth (nobody is taken below its share)."""
        held, share = self._seat_shares(seq, running, num_seats)
        if held.get(seq.tenant, 0) + 1 > share(seq.tenant):
            return None
        over = [
            s
            for s in running
            if s.priority == seq.priority and held[s.tenant] - 1 >= share(s.tenant)
        ]
        return max(over, key=self.rank, default=None)

    def at_share(self, seq: Sequence, running: list[Sequence], num_seats: int) -> set[str]:
        """The tenants waiting in `seq`'s priority class whom one more seat would take past their
        share of `num_seats` (one pass: every such tenant leaves its turn at once)."""
        held, share = self._seat_shares(seq, running, num_seats)
        return {
            t
            for t, q in self.waiting.items()
            if q[0].priority == seq.priority and held.get(t, 0) + 1 > share(t)
        }

    def _seat_shares(self, seq: Sequence, running: list[Sequence], num_seats: int):
        """Seats held in `seq`'s priority class by tenant, and each tenant's share of them among
        those with a sequence of that class running or waiting."""
        held: dict[str, int] = {}
        for s in running:
            if s.priority == seq.priority:
                held[s.tenant] = held.get(s.tenant, 0) + 1
        tenants = set(held) | {t for t, q in self.waiting.items() if q[0].priority == seq.priority}
        total = sum(self.weight(t) for t in tenants | {seq.tenant})
        return held, lambda tenant: num_seats * self.weight(tenant) / total

    def rank(self, seq: Sequence) -> tuple[int, float, float]:
        """Lower is better among running sequences: priority, then the tenant least over its
        share, then arrival. Preemption takes victims from the worst end."""
        return (seq.priority, self.counters[seq.tenant], seq.arrival_time)

    def load(self) -> dict[str, tuple[int, int]]:
        """(waiting, running or held) sequences by tenant."""
        out = {}
        for tenant, members in self.members.items():
            waiting = len(self.waiting.get(tenant, ()))
            out[tenant] = (waiting, members - waiting)
        return out
