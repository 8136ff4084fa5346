"""A request sent again after its final `done` ends visibly with that answer, never a second,
different final (worker/delivery/finals.py, Delivery.answered_before): the remembered `done` again,
or a fresh `answered_before` one when it is not kept; a reply topic gone since dead-letters it.
Offline through the intake harness."""

from __future__ import annotations

import msgpack
import pytest

from inferline.worker.delivery import ledger as ledger_module
from inferline.worker.delivery.ledger import JobLedger
from tests.unit.test_delivery import DLQ, REPLY, body, committed, harness


def _done(out) -> dict:
    ev = msgpack.unpackb(out.value)
    assert ev["type"] == "done"
    return ev


def _answer(h, value: bytes):
    _, (admitted,) = h.feed(value)
    (first,) = [o for o in h.finish_admitted(admitted) if _done_or_none(o)]
    return first


def _done_or_none(out) -> bool:
    return msgpack.unpackb(out.value)["type"] == "done"


@pytest.mark.parametrize("since", ["cancelled", "rate_limited"])
def test_a_resubmission_gets_its_first_final_even_after_a_cancel_or_over_its_rate(since):
    h = harness()
    value = body()
    first = _answer(h, value)
    if since == "cancelled":
        h.worker.requests.cancel(msgpack.unpackb(value)["id"])
    else:
        h.worker.limiter.admit = lambda tenant, tokens: False
    sent, added = h.feed(value)
    assert not added and [(o.topic, o.value) for o in sent] == [(REPLY, first.value)]
    assert committed(h) == 2 and h.settled()


def test_a_resubmission_whose_done_was_too_big_to_keep_gets_a_fresh_answered_before(
    monkeypatch,
):
    monkeypatch.setattr(ledger_module, "MAX_REMEMBERED_EVENT_BYTES", 16)
    h = harness()
    value = body(metadata={"k": "v"})
    _answer(h, value)
    sent, added = h.feed(value)
    assert not added and [o.topic for o in sent] == [REPLY]
    done = _done(sent[0])
    assert done["finish_reason"] == "rejected" and done["error"]["code"] == "answered_before"
    assert done["metadata"] == {"k": "v"}
    assert committed(h) == 2 and h.settled()


def test_a_resubmission_to_a_reply_topic_deleted_since_is_dead_lettered():
    h = harness()
    value = body()
    _answer(h, value)
    h.unreachable.add(REPLY)  # the resent `done` is refused for good
    sent, _ = h.feed(value)
    assert [o.topic for o in sent] == [REPLY, DLQ] and sent[1].value == value
    assert committed(h) == 2 and h.settled()


def test_remembered_dones_are_bounded_in_bytes(monkeypatch):
    monkeypatch.setattr(ledger_module, "MAX_REMEMBERED_BYTES", 100_000, raising=False)
    ledger, h = JobLedger(), harness()
    jobs = []
    for n in range(3):
        _, (admitted,) = h.feed(body())
        job = h.worker.jobs[admitted.request_id]
        job.reply.final_event = bytes(40_000)
        ledger.remember(job)
        jobs.append(job)
    kept = [j for j in jobs if ledger.final_event(j.request.id) is not None]
    assert kept == jobs[1:] and all(ledger.finished(j.request) for j in jobs)
