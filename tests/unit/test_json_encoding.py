"""The JSON encoding of the wire contract (contract/schema.py, docs/protocol.md "Encodings"): a
request with `content-type: application/json` decodes to what its msgpack twin does, under the same
caps; bad JSON and unknown content types are dead-lettered; every event written for a JSON request
(started, tokens, done, a rejection, a resubmission's remembered done) is JSON with that header, a
msgpack one's carries `application/msgpack`. Offline through the intake harness; on the real broker
with kcat: tests/kafka/test_json_encoding.py."""

from __future__ import annotations

import json

import msgpack
import pytest

from inferline.contract import schema
from inferline.contract.schema import JSON, MSGPACK
from tests.unit.test_asyncapi import FULL_REQUEST
from tests.unit.test_delivery import DLQ, REPLY, harness

JSON_HEADERS = [("content-type", b"application/json")]
BASE = {"v": 1, "id": "r-json", "reply_topic": REPLY, "prompt": "Hi.", "max_tokens": 2}


def as_json(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def decode_json(payload: dict, **kwargs) -> schema.Request:
    return schema.decode_request(as_json(payload), content_type=JSON, **kwargs)


# --------------------------------------------------------------------------- the codec


@pytest.mark.parametrize(
    "payload",
    [
        FULL_REQUEST,
        {**BASE, "prompt": None, "messages": [{"role": "user", "content": "h\u00e9 \U0001f600"}]},
        {**BASE, "prompt": None, "prompt_token_ids": [0, 5, 2**31 - 1], "seed": 2**64 - 1},
        {**BASE, "created_at": 1767225600, "timeout_s": 30, "unknown": {"a": [1]}},
    ],
)
def test_a_json_request_decodes_to_what_its_msgpack_twin_does(payload):
    payload = {k: v for k, v in payload.items() if v is not None}
    from_msgpack = schema.decode_request(msgpack.packb(payload))
    from_json = decode_json(payload)
    assert from_json.model_dump() == from_msgpack.model_dump()
    assert (from_json.content_type, from_msgpack.content_type) == (JSON, MSGPACK)
    # Both ways round: a client's JSON encoding reads back the same.
    again = schema.decode_request(schema.encode_request(from_json, JSON), content_type=JSON)
    assert again.model_dump() == from_msgpack.model_dump()


def test_created_at_is_unix_seconds_a_json_number():
    assert decode_json({**BASE, "created_at": 1767225600.5}).created_at == 1767225600.5
    with pytest.raises(schema.InvalidRequest, match="created_at"):
        decode_json({**BASE, "created_at": "2026-01-01T00:00:00Z"})


@pytest.mark.parametrize(
    "change, field, code",
    [
        ({"stop": ["x"] * (schema.MAX_STOP + 1)}, "stop", "invalid_request"),
        ({"metadata": {"k": "x" * schema.MAX_METADATA_BYTES}}, "metadata", "invalid_request"),
        ({"prompt": None, "prompt_token_ids": [1] * 9}, "prompt_token_ids", "prompt_too_long"),
        ({"temperature": float("-1")}, "temperature", "invalid_request"),
        ({"priority": 1.0}, "priority", "invalid_request"),  # strict, as in msgpack
        ({"v": 2}, "v", "invalid_request"),
        ({"created_at": 1e400}, "created_at", "invalid_request"),  # JSON's 1e400 is inf
    ],
)
def test_json_requests_are_held_to_the_same_rules_and_caps(change, field, code):
    payload = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    text = json.dumps(payload).replace('"created_at": Infinity', '"created_at": 1e400')
    for data, content_type in ((text.encode(), JSON), (msgpack.packb(payload), MSGPACK)):
        with pytest.raises(schema.InvalidRequest) as caught:
            schema.decode_request(data, max_prompt_tokens=8, content_type=content_type)
        assert (caught.value.field, caught.value.code) == (field, code), content_type
        assert caught.value.content_type == content_type  # its rejection goes out in it


@pytest.mark.parametrize(
    "data, reason",
    [
        (b'{"v": 1, "id": "r-1",', "not JSON"),
        (b"[1, 2]", "not a map: a JSON list"),
        (b'"r-1"', "not a map: a JSON str"),
        (b'{"v": NaN, "id": "r-1", "reply_topic": "t"}', "NaN is not JSON"),
        (b'{"v": 1, "id": "r-1", "reply_topic": "t", "x": ' + b"[" * 100_000, "not JSON"),
        (b'{"v": 1, "id": "r-1", "reply_topic": "t", "seed": ' + b"9" * 5000 + b"}", "not JSON"),
        (b'\xff{"v": 1}', "not JSON"),
        (b'{"v": 1, "id": "has space", "reply_topic": "t", "prompt": "p"}', "no usable id"),
        (b'{"v": 1, "id": "r-1", "prompt": "p"}', "no usable reply_topic"),
        (b" " * 65, "not JSON"),
    ],
)
def test_bad_json_is_undecodable(data, reason):
    with pytest.raises(schema.UndecodableMessage, match=reason):
        schema.decode_request(data, content_type=JSON)


def test_the_size_cap_is_the_same():
    data = as_json({**BASE, "prompt": "x" * 2000})
    with pytest.raises(schema.UndecodableMessage, match="over the 1000-byte limit"):
        schema.decode_request(data, max_bytes=1000, content_type=JSON)


def test_bad_utf8_inside_a_json_string_is_a_rejection_as_in_msgpack():
    data = b'{"v": 1, "id": "r-1", "reply_topic": "t", "prompt": "\xff"}'
    with pytest.raises(schema.InvalidRequest, match="prompt"):
        schema.decode_request(data, content_type=JSON)
    lone = b'{"v": 1, "id": "r-1", "reply_topic": "t", "prompt": "\\ud800"}'
    with pytest.raises(schema.InvalidRequest, match="prompt"):
        schema.decode_request(lone, content_type=JSON)


def test_an_unknown_content_type_is_undecodable_and_says_which_are_known():
    with pytest.raises(schema.UndecodableMessage, match="unsupported content-type 'text/csv'"):
        schema.decode_request(as_json(BASE), content_type="text/csv")
    # JSON without the header: msgpack is the default, and the reason says what was missing.
    with pytest.raises(schema.UndecodableMessage, match="content-type: application/json"):
        schema.decode_request(as_json(BASE))


@pytest.mark.parametrize(
    "headers, content_type",
    [
        (None, MSGPACK),
        ([], MSGPACK),
        ([("trace", b"x")], MSGPACK),
        ([("content-type", b"application/json")], JSON),
        ([("Content-Type", b"Application/JSON; charset=utf-8")], JSON),
        ([("content-type", b"application/msgpack")], MSGPACK),
        ([("content-type", b"application/msgpack"), ("content-type", b"application/json")], JSON),
        ([("content-type", b"text/csv")], "text/csv"),
        ([("content-type", None)], ""),
    ],
)
def test_the_content_type_header(headers, content_type):
    assert schema.content_type_of(headers) == content_type


def events() -> list:
    common = dict(id="r-1", attempt="a", seq=0)
    return [
        schema.StartedEvent(**common, worker="w", queue_s=0.5),
        schema.TokensEvent(**common, token_ids=[1, 2], text="h\u00e9", logprobs=None),
        schema.DoneEvent(
            **common,
            finish_reason="rejected",
            usage=schema.Usage(prompt_tokens=0, completion_tokens=0),
            timing=schema.Timing(queue_s=0.0, ttft_s=None, total_s=0.0),
            error=schema.ErrorInfo(code="overloaded", message="full"),
            metadata={"k": "v"},
        ),
    ]


@pytest.mark.parametrize("event", events(), ids=lambda e: e.type)
def test_events_round_trip_in_both_encodings_and_are_told_apart_by_their_first_byte(event):
    as_json_event = schema.encode_event(event, JSON)
    as_msgpack = schema.encode_event(event)
    assert json.loads(as_json_event) == msgpack.unpackb(as_msgpack)  # every field, nil as null
    for data, content_type in ((as_json_event, JSON), (as_msgpack, MSGPACK)):
        assert schema.sniff(data) == content_type
        assert schema.decode_event(data) == event
        assert schema.decode_event(data, content_type=content_type) == event
    assert schema.transcode_event(as_msgpack, MSGPACK, JSON) == as_json_event
    assert schema.transcode_event(as_json_event, JSON, JSON) is as_json_event


def test_cancels_may_be_json_too():
    assert schema.decode_cancel(b'{"v": 1, "id": "r-1"}') == schema.Cancel(id="r-1")
    assert schema.decode_cancel(schema.encode_cancel(schema.Cancel(id="r-1"), JSON)).id == "r-1"
    with pytest.raises(schema.UndecodableMessage, match="not JSON"):
        schema.decode_cancel(b'{"v": 1, "id": ')


# --------------------------------------------------------------------------- the worker


def header(out) -> bytes | None:
    return dict(out.headers or []).get("content-type")


def test_every_event_of_a_json_request_is_json_with_the_header():
    h = harness()
    sent, (admitted,) = h.feed(as_json(BASE), headers=JSON_HEADERS)
    sent += h.finish_admitted(admitted, tokens=2)
    assert [header(o) for o in sent] == [b"application/json"] * len(sent)
    evs = [json.loads(o.value) for o in sent]
    assert [e["type"] for e in evs] == ["started", "tokens", "done"]
    assert [e["seq"] for e in evs] == [0, 1, 2] and {o.topic for o in sent} == {REPLY}
    assert h.settled()


def test_a_msgpack_request_s_events_say_application_msgpack():
    h = harness()
    _, (admitted,) = h.feed(msgpack.packb(BASE))
    sent = h.finish_admitted(admitted)
    assert sent and [header(o) for o in sent] == [b"application/msgpack"] * len(sent)
    assert [msgpack.unpackb(o.value)["type"] for o in sent] == ["started", "tokens", "done"]


@pytest.mark.parametrize(
    "change", [{"temperature": -1}, {"max_tokens": 10**6}, {"tenant": "bad tenant"}]
)
def test_a_json_request_s_rejection_is_json(change):
    h = harness()
    sent, added = h.feed(as_json({**BASE, **change}), headers=JSON_HEADERS)
    assert not added and [o.topic for o in sent] == [REPLY] and header(sent[0]) == JSON.encode()
    done = json.loads(sent[0].value)
    assert done["type"] == "done" and done["finish_reason"] == "rejected"


def test_a_resubmission_gets_its_remembered_done_in_the_encoding_it_comes_in():
    h = harness()
    _, (admitted,) = h.feed(as_json(BASE), headers=JSON_HEADERS)
    (first,) = [o for o in h.finish_admitted(admitted) if json.loads(o.value)["type"] == "done"]
    again, added = h.feed(as_json(BASE), headers=JSON_HEADERS)
    assert not added and [(o.value, header(o)) for o in again] == [(first.value, JSON.encode())]
    # The same request as msgpack (same id and content): the same done, as msgpack.
    again, added = h.feed(msgpack.packb(BASE))
    assert not added and header(again[0]) == MSGPACK.encode()
    assert msgpack.unpackb(again[0].value) == json.loads(first.value)
    assert h.settled()


@pytest.mark.parametrize(
    "value, headers, reason",
    [
        (as_json(BASE), [("content-type", b"text/csv")], b"unsupported content-type 'text/csv'"),
        (b'{"v": 1, "id": "r-1", "reply_topic"', JSON_HEADERS, b"not JSON"),
        (as_json(BASE), [], b"content-type: application/json"),
    ],
)
def test_undecodable_json_and_unknown_content_types_are_dead_lettered(value, headers, reason):
    h = harness()
    sent, added = h.feed(value, headers=headers)
    assert not added and [o.topic for o in sent] == [DLQ] and sent[0].value == value
    assert reason in dict(sent[0].headers)["error"]
    assert h.settled()
