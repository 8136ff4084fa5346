"""OffsetTracker: only the contiguous run of finished offsets is ever committed."""

import random

from aiokafka import TopicPartition
from hypothesis import given, strategies as st

from inferline.worker.delivery.offsets import OffsetTracker, encode_ledger

TP = TopicPartition("t", 0)
TP1 = TopicPartition("t", 1)


def test_nothing_seen_no_watermark():
    assert OffsetTracker().watermark(TP) is None


def test_watermark_stops_at_first_unfinished():
    tr = OffsetTracker()
    for o in range(5):
        tr.add(TP, o)
    tr.finish(TP, 0)
    tr.finish(TP, 1)
    tr.finish(TP, 3)
    assert tr.watermark(TP) == 2
    tr.finish(TP, 2)
    assert tr.watermark(TP) == 4
    tr.finish(TP, 4)
    assert tr.watermark(TP) == 5


def test_unfinished_first_offset_blocks_and_watermark_is_lowest():
    tr = OffsetTracker()
    for o in (10, 11, 12):
        tr.add(TP, o)
    tr.finish(TP, 12)
    tr.finish(TP, 11)
    assert tr.watermark(TP) == 10


def test_gaps_in_offsets_are_skipped():
    tr = OffsetTracker()
    for o in (100, 101, 103, 107):
        tr.add(TP, o)
    for o in (100, 101, 103):
        tr.finish(TP, o)
    assert tr.watermark(TP) == 107
    tr.finish(TP, 107)
    assert tr.watermark(TP) == 108


def test_partitions_have_their_own_watermarks():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP1, 0)
    tr.finish(TP, 0)
    assert (tr.watermark(TP), tr.watermark(TP1)) == (1, 0)
    tr.finish(TP1, 0)
    assert tr.watermark(TP1) == 1


def test_forget_drops_a_partition():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP1, 5)
    tr.finish(TP1, 5)
    assert tr.watermark(TP1) == 6
    tr.forget([TP1])
    tr.finish(TP1, 6)  # late ack for a forgotten partition: ignored
    assert tr.watermark(TP) == 0 and tr.watermark(TP1) is None
    assert tr.partitions() == [TP]


def test_redelivered_offsets_are_not_tracked_twice():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP, 1)
    tr.add(TP, 1)
    tr.finish(TP, 0)
    tr.finish(TP, 1)
    assert tr.pending(TP) == 0
    assert tr.watermark(TP) == 2


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.randoms())
def test_watermark_is_lowest_unfinished_for_any_order(gaps, rnd):
    offsets, o = [], 0
    for g in gaps:
        o += 1 + g
        offsets.append(o)
    tr = OffsetTracker()
    for off in offsets:
        tr.add(TP, off)
    order = offsets[:]
    rnd.shuffle(order)
    done = set()
    for off in order[: rnd.randint(0, len(order))]:
        tr.finish(TP, off)
        done.add(off)
        unfinished = [x for x in offsets if x not in done]
        expect = min(unfinished) if unfinished else offsets[-1] + 1
        assert tr.watermark(TP) == expect
        assert tr.pending(TP) == len(unfinished)


class _Counted(int):
    """An offset that counts the comparisons and hashes made of it."""

    ops = 0

    def __hash__(self):
        _Counted.ops += 1
        return int.__hash__(self)

    def __eq__(self, other):
        _Counted.ops += 1
        return int.__eq__(self, other)

    def __lt__(self, other):
        _Counted.ops += 1
        return int.__lt__(self, other)


def test_a_ledger_looks_at_a_few_offsets_not_at_every_one_in_flight():
    # 20,000 offsets in flight: a ledger (computed for every transaction) must not scan them.
    tr = OffsetTracker()
    for o in range(20_000):
        tr.add(TP, _Counted(o))
    tr.finish(TP, _Counted(5))
    _Counted.ops = 0
    assert tr.ledger(TP, [_Counted(0), _Counted(7)]) == (1, encode_ledger(1, {5, 7}))
    assert tr.watermark(TP) == 0
    assert _Counted.ops < 500


def test_a_finish_of_an_offset_not_in_flight_leaves_no_state():
    # A late or repeated finish (a replay after a fence, an offset the ledger skipped) must not be
    # remembered for ever.
    tr = OffsetTracker()
    tr.resume(TP, 100, encode_ledger(100, {102}))
    for o in range(100, 104):
        tr.add(TP, o)
    for o in (*range(0, 100), 102, 200, *range(100, 104)):
        tr.finish(TP, o)
    assert tr.watermark(TP) == 104 and tr.pending(TP) == 0
    st = tr._parts[TP]
    assert (st.heap, st.open, st.done) == ([], set(), [])


@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.randoms())
def test_the_ledger_matches_a_plain_model_for_any_order(gaps, rnd):
    offsets, o = [], 10
    for g in gaps:
        o += 1 + g
        offsets.append(o)
    tr = OffsetTracker()
    tr.resume(TP, 10, encode_ledger(10, {offsets[0]}))
    taken = [off for off in offsets if tr.add(TP, off)]
    order = taken[:]
    rnd.shuffle(order)
    done: set[int] = set()
    for off in order:
        finishing = set(rnd.sample(taken, min(3, len(taken))))
        open_ = [x for x in taken if x not in done | finishing]
        mark = min(open_, default=offsets[-1] + 1)
        listed = {x for x in done | finishing | {offsets[0]} if x > mark}
        assert tr.ledger(TP, finishing) == (mark, encode_ledger(mark, listed))
        tr.finish(TP, off)
        done.add(off)
