"""Lanes: admitted requests beyond the waiting pool's room wait here, in memory, one lane per
tenant, so that intake reads on past one tenant's backlog to the next tenant's records. The pool's
room goes to the lanes by priority, then fairly: next to the tenant with the fewest requests in
the pool for its weight. A parked record is unfinished in the offset tracker, so no commit passes
it: a crash loses nothing (its next owner reads it again from Kafka).
design: docs/operations.md#lanes
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

from aiokafka import TopicPartition

from inferline.worker.intake.triage import Admission

# Bytes a parked record costs beyond its key and value (counted twice: the record held to
# dead-letter it, the request decoded from it): the objects around them, an estimate.
LANE_RECORD_OVERHEAD = 1024
OBSERVE_EVERY_S = 0.25  # the lane gauges: a walk over the tenants, not on every record


class Pool(Protocol):
    """The waiting pool behind the lanes (the RequestTracker)."""

    def room(self) -> int: ...
    def pool_full(self) -> bool: ...
    def waiting_of(self, tenant: str) -> int: ...
    def admit(self, admission: Admission) -> None: ...
    async def requeue(self, tps: set[TopicPartition]) -> None: ...
    def fatal(self, exc: BaseException) -> None: ...


class Lanes:
    """The intake's sink in group mode, in front of the waiting pool: `room` is the pool's and
    the lanes' together, so intake pauses only when both are full. `admit` hands a request to the
    pool while nobody waits in a lane and the pool has room, else parks it in its tenant's lane;
    `release` moves parked requests into the pool's room, fairest first. `recheck` (set by the
    intake) says whether a parked request may still run (a cancel may have come meanwhile)."""

    def __init__(self, settings, pool: Pool, metrics=None) -> None:
        self._pool, self._m = pool, metrics
        self.max_records, self.max_bytes = settings.lanes.max_records, settings.lanes.max_bytes
        self._weights = settings.scheduler.tenant_weights
        self._default_weight = settings.scheduler.default_tenant_weight
        # Each a heap of (priority, order, admission, bytes): best priority, then first read.
        self.lanes: dict[str, list[tuple[int, int, Admission, int]]] = {}
        self.num_records = self.num_bytes = 0
        self.recheck: Callable[[Admission], bool] = lambda adm: True
        self._order = itertools.count()
        self._releasing = False
        self._observed_at = float("-inf")

    # -- the Sink ---------------------------------------------------------------------------------

    def room(self) -> int:
        """Records intake may take now: the pool's room and what the lanes have left."""
        self.release()
        return self._pool.room() + self.free()

    def pool_full(self) -> bool:
        return self._pool.pool_full() and self.free() == 0

    def admit(self, adm: Admission) -> None:
        if not self.lanes and self._pool.room() > 0:
            self._pool.admit(adm)
            return
        size = 2 * adm.size + LANE_RECORD_OVERHEAD
        parked = (adm.request.priority, next(self._order), adm, size)
        heapq.heappush(self.lanes.setdefault(adm.request.tenant, []), parked)
        self.num_records += 1
        self.num_bytes += size
        self.release()

    async def requeue(self, tps: set[TopicPartition]) -> None:
        """Revoked partitions: their parked requests go (the next owner reads them again)."""
        for tenant in list(self.lanes):
            kept = [p for p in self.lanes[tenant] if p[2].tp not in tps]
            self._drop(self.lanes[tenant], kept)
            if kept:
                heapq.heapify(kept)
                self.lanes[tenant] = kept
            else:
                del self.lanes[tenant]
        self._observe(force=True)
        await self._pool.requeue(tps)

    def fatal(self, exc: BaseException) -> None:
        self._pool.fatal(exc)

    # -- the lanes --------------------------------------------------------------------------------

    def free(self) -> int:
        """Records the lanes may still take (none once their bytes are spent)."""
        if self.num_bytes >= self.max_bytes:
            return 0
        return max(0, self.max_records - self.num_records)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    def release(self) -> None:
        """Parked requests into the pool's room: the best priority first; within it, next to the
        tenant with the fewest requests waiting in the pool for its weight (then the earliest)."""
        if self._releasing:  # a recheck's rejection may call back in
            return
        self._releasing = True
        try:
            while self.lanes and self._pool.room() > 0:
                tenant = min(self.lanes, key=self._turn)
                lane = self.lanes[tenant]
                _, _, adm, size = heapq.heappop(lane)
                if not lane:
                    del self.lanes[tenant]
                self.num_records -= 1
                self.num_bytes -= size
                if self.recheck(adm):
                    self._pool.admit(adm)
        finally:
            self._releasing = False
        self._observe()

    def _turn(self, tenant: str) -> tuple[int, float, int]:
        priority, order = self.lanes[tenant][0][:2]
        return (priority, (self._pool.waiting_of(tenant) + 1) / self.weight(tenant), order)

    def crowded(self) -> set[str]:
        """Tenants whose lane holds its weighted share of the lanes (among the tenants parked, and
        one newcomer of the default weight): topic tenancy leaves their topics in Kafka."""
        total = sum(self.weight(t) for t in self.lanes) + self._default_weight
        return {
            t
            for t, lane in self.lanes.items()
            if len(lane) >= self.max_records * self.weight(t) / total
        }

    def depths(self) -> dict[str, int]:
        """Parked requests by tenant."""
        return {t: len(lane) for t, lane in self.lanes.items()}

    def _drop(self, lane: list, kept: list) -> None:
        self.num_records -= len(lane) - len(kept)
        self.num_bytes -= sum(p[3] for p in lane) - sum(p[3] for p in kept)

    def _observe(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._m is not None and (force or now - self._observed_at >= OBSERVE_EVERY_S):
            self._observed_at = now
            self._m.observe_lanes(self.depths(), self.num_bytes)
