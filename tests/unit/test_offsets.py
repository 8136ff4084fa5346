"""OffsetTracker: only the contiguous run of finished offsets is ever committed."""

import random

from aiokafka import TopicPartition
from hypothesis import given, strategies as st

from inferline.worker.delivery.offsets import OffsetTracker

TP = TopicPartition("t", 0)
TP1 = TopicPartition("t", 1)


def test_nothing_seen_nothing_to_commit():
    assert OffsetTracker().to_commit() == {}


def test_watermark_stops_at_first_unfinished():
    tr = OffsetTracker()
    for o in range(5):
        tr.add(TP, o)
    tr.finish(TP, 0)
    tr.finish(TP, 1)
    tr.finish(TP, 3)
    assert tr.to_commit() == {TP: 2}
    tr.finish(TP, 2)
    assert tr.to_commit() == {TP: 4}
    tr.finish(TP, 4)
    assert tr.to_commit() == {TP: 5}


def test_unfinished_first_offset_blocks_and_watermark_is_lowest():
    tr = OffsetTracker()
    for o in (10, 11, 12):
        tr.add(TP, o)
    tr.finish(TP, 12)
    tr.finish(TP, 11)
    assert tr.to_commit() == {TP: 10}


def test_gaps_in_offsets_are_skipped():
    tr = OffsetTracker()
    for o in (100, 101, 103, 107):
        tr.add(TP, o)
    for o in (100, 101, 103):
        tr.finish(TP, o)
    assert tr.to_commit() == {TP: 107}
    tr.finish(TP, 107)
    assert tr.to_commit() == {TP: 108}


def test_only_moved_watermarks_are_reported():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP1, 0)
    tr.finish(TP, 0)
    marks = tr.to_commit()
    assert marks == {TP: 1, TP1: 0}
    tr.committed(marks)
    assert tr.to_commit() == {}
    tr.finish(TP1, 0)
    assert tr.to_commit() == {TP1: 1}


def test_filter_by_partition_and_forget():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP1, 5)
    tr.finish(TP1, 5)
    assert tr.to_commit([TP1]) == {TP1: 6}
    tr.forget([TP1])
    tr.finish(TP1, 6)  # late ack for a forgotten partition: ignored
    assert tr.to_commit() == {TP: 0}
    assert tr.partitions() == [TP]


def test_redelivered_offsets_are_not_tracked_twice():
    tr = OffsetTracker()
    tr.add(TP, 0)
    tr.add(TP, 1)
    tr.add(TP, 1)
    tr.finish(TP, 0)
    tr.finish(TP, 1)
    assert tr.pending(TP) == 0
    assert tr.to_commit() == {TP: 2}


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
        assert tr.to_commit() == {TP: expect}
        assert tr.pending(TP) == len(unfinished)
