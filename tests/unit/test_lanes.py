"""Lanes (worker/intake/lanes.py) over a fake waiting pool: what passes, what parks, who gets the
pool's room next, the bounds, and what a revocation drops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition

from inferline.config.settings import Settings
from inferline.worker.intake.lanes import LANE_RECORD_OVERHEAD, Lanes

TP0, TP1 = TopicPartition("req", 0), TopicPartition("req", 1)


class Pool:
    """A waiting pool of `size`; `start()` takes its oldest request out (the engine ran it)."""

    def __init__(self, size: int) -> None:
        self.size, self.waiting, self.requeued = size, [], []

    def room(self) -> int:
        return self.size - len(self.waiting)

    def pool_full(self) -> bool:
        return self.room() <= 0

    def waiting_of(self, tenant: str) -> int:
        return sum(1 for a in self.waiting if a.request.tenant == tenant)

    def admit(self, adm) -> None:
        assert self.room() > 0
        self.waiting.append(adm)

    async def requeue(self, tps) -> None:
        self.requeued.append(tps)

    def fatal(self, exc) -> None:
        raise exc

    def start(self, lanes: Lanes) -> str:
        tenant = self.waiting.pop(0).request.tenant
        lanes.release()
        return tenant


def lanes_over(pool: Pool, max_records: int = 16, max_bytes: int = 2**20, **weights) -> Lanes:
    settings = Settings(
        lanes={"max_records": max_records, "max_bytes": max_bytes},
        scheduler={"tenant_weights": weights},
    )
    return Lanes(settings, pool)


_offsets = iter(range(10**6))


def adm(tenant: str, tp: TopicPartition = TP0, priority: int = 0, size: int = 100):
    request = SimpleNamespace(tenant=tenant, priority=priority, id=f"{tenant}-{next(_offsets)}")
    return SimpleNamespace(tp=tp, offset=next(_offsets), request=request, size=size)


def test_a_request_passes_while_the_pool_has_room_and_parks_once_it_is_full():
    pool = Pool(2)
    lanes = lanes_over(pool)
    for _ in range(3):
        lanes.admit(adm("a"))
    assert len(pool.waiting) == 2 and lanes.num_records == 1
    assert lanes.room() == 0 + 15 and not lanes.pool_full()
    pool.start(lanes)
    assert len(pool.waiting) == 2 and lanes.num_records == 0


def test_the_pools_room_goes_to_the_tenant_with_the_fewest_waiting():
    """A flood of `a` fills the pool and its lane; `b`'s records, read after it, enter first."""
    pool = Pool(4)
    lanes = lanes_over(pool)
    for _ in range(10):
        lanes.admit(adm("a"))
    lanes.admit(adm("b"))
    lanes.admit(adm("b"))
    entered = []
    for _ in range(4):
        pool.start(lanes)
        entered.append(pool.waiting[-1].request.tenant)
    assert entered[:2] == ["b", "b"], entered


def test_weights_share_the_pools_room():
    """Weights 1 and 3: the pool holds the two tenants' requests 1 to 3."""
    pool = Pool(8)
    lanes = lanes_over(pool, max_records=64, a=1.0, b=3.0)
    for _ in range(30):
        lanes.admit(adm("a"))
    for _ in range(30):
        lanes.admit(adm("b"))
    started = [pool.start(lanes) for _ in range(40)]
    assert (pool.waiting_of("a"), pool.waiting_of("b")) == (2, 6)
    assert started[-24:].count("b") == 18, started


def test_a_better_priority_goes_first_whatever_its_tenant():
    pool = Pool(1)
    lanes = lanes_over(pool)
    lanes.admit(adm("a"))
    lanes.admit(adm("b"))
    lanes.admit(adm("a", priority=-1))
    pool.start(lanes)
    assert pool.waiting[0].request.priority == -1


def test_room_counts_the_records_and_bytes_bounds():
    pool = Pool(1)
    size = 1000
    per_record = 2 * size + LANE_RECORD_OVERHEAD
    lanes = lanes_over(pool, max_records=5, max_bytes=3 * per_record)
    for _ in range(4):
        lanes.admit(adm("a", size=size))
    assert lanes.num_records == 3 and lanes.num_bytes == 3 * per_record
    assert lanes.room() == 0 and lanes.pool_full()  # the bytes bind before the count
    lanes = lanes_over(Pool(1), max_records=2)
    for _ in range(3):
        lanes.admit(adm("a"))
    assert lanes.room() == 0 and lanes.pool_full()


def test_a_revoked_partitions_parked_requests_go():
    pool = Pool(1)
    lanes = lanes_over(pool)
    for tp in (TP0, TP1, TP0, TP1):
        lanes.admit(adm("a", tp=tp))
    asyncio.run(lanes.requeue({TP1}))
    assert pool.requeued == [{TP1}]
    assert lanes.num_records == 1 and lanes.lanes["a"][0][2].tp == TP0
    assert lanes.num_bytes == 2 * 100 + LANE_RECORD_OVERHEAD


def test_a_request_the_recheck_refuses_is_not_admitted():
    pool = Pool(1)
    lanes = lanes_over(pool)
    lanes.recheck = lambda a: a.request.tenant != "cancelled"
    lanes.admit(adm("a"))
    lanes.admit(adm("cancelled"))
    lanes.admit(adm("a"))
    pool.start(lanes)
    assert [a.request.tenant for a in pool.waiting] == ["a"] and not lanes.lanes


def test_crowded_tenants_hold_their_share_of_the_lanes():
    """Topic tenancy pauses the topics of these: `a` holds more than its share of 8 records."""
    pool = Pool(1)
    lanes = lanes_over(pool, max_records=8)
    for _ in range(6):
        lanes.admit(adm("a"))
    lanes.admit(adm("b"))
    # shares among a, b and a newcomer: 8/3 each
    assert lanes.crowded() == {"a"}


def test_a_worker_parks_past_its_pool_and_answers_one_cancelled_meanwhile():
    """Through a real Worker (tests/chaos_fixtures.py's harness): with a pool of one, the second
    and third records wait in a lane; the engine starting the first lets the second in, starting
    the second lets the third out, and the third, cancelled while it waited, is answered
    `cancelled` without running."""
    import msgpack

    from inferline.worker.engine.engine import EngineStats
    from inferline.worker.engine.request import RequestOutput
    from tests.chaos_fixtures import IntakeHarness

    h = IntakeHarness(Settings(scheduler={"max_waiting": 1}))

    def record(rid: str) -> bytes:
        body = {"v": 1, "id": rid, "reply_topic": "inferline.reply.c", "prompt": "Hi."}
        return msgpack.packb({**body, "max_tokens": 2})

    _, first = h.feed(record("r-1"))
    assert [r.request_id for r in first] and h.feed(record("r-2"))[1] == []
    assert h.feed(record("r-3"))[1] == [] and h.worker.lanes.num_records == 2
    h.worker.requests.cancel("r-3")
    added = h.worker.engine_loop.added
    for n in (1, 2):  # the engine starts one: the pool has room again
        started = RequestOutput(request_id=added[n - 1].request_id, started=True)
        h.worker.requests.on_outputs([started], EngineStats())
    assert len(added) == 2 and h.worker.lanes.num_records == 0
    done = msgpack.unpackb(h.sent[-1].value)
    assert done["id"] == "r-3" and done["finish_reason"] == "cancelled", done
