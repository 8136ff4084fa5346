"""The v1 wire contract (PROTOCOL.md): every rule of the request table, good and bad, the events
and the codec's limits."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inferline.contract.schema import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ERROR_CODES,
    FINISH_REASONS,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_LOGIT_BIAS,
    MAX_TEMPLATE_KWARGS,
    MAX_GRAMMAR_BYTES,
    MAX_TOOL_DESCRIPTION_LEN,
    MAX_TOOLS,
    MAX_TEMPLATE_VALUE_LEN,
    MAX_METADATA_KEYS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_REPLY_PARTITION,
    MAX_ROLE_LEN,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_STOP_TOKEN_IDS,
    MAX_TENANT_LEN,
    MAX_TIMEOUT_S,
    MAX_TOKEN_ID,
    PRIORITY_RANGE,
    PROTOCOL_VERSION,
    SEED_RANGE,
    Cancel,
    ChatMessage,
    DoneEvent,
    ErrorInfo,
    InvalidRequest,
    Request,
    StartedEvent,
    Timing,
    TokensEvent,
    UndecodableMessage,
    Usage,
    decode_cancel,
    decode_event,
    decode_request,
    encode_cancel,
    encode_event,
    encode_request,
    metadata_bytes,
)

BASE = {"v": 1, "id": "req-1", "reply_topic": "replies", "prompt": "Hello"}


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def request(**changes) -> dict:
    """BASE with changes; a value of `...` removes the key."""
    out = {**BASE, **changes}
    return {k: v for k, v in out.items() if v is not ...}


def reject(field: str, **changes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_request(pack(request(**changes)))
    assert info.value.field == field, info.value.message
    assert info.value.message.startswith(field), info.value.message
    assert info.value.request_id == request(**changes)["id"]
    return info.value


def dead_letter(data: bytes, **kw) -> UndecodableMessage:
    with pytest.raises(UndecodableMessage) as info:
        decode_request(data, **kw)
    assert info.value.reason
    return info.value


def test_constants():
    assert PROTOCOL_VERSION == 1
    assert FINISH_REASONS == (
        "stop",
        "length",
        "cancelled",
        "timeout",
        "rejected",
        "requeued",
        "error",
    )
    assert ERROR_CODES == (
        "invalid_request",
        "prompt_too_long",
        "rate_limited",
        "overloaded",
        "timeout",
        "cancelled",
        "internal",
        "answered_before",
    )


def test_defaults_are_the_contracts():
    req = decode_request(pack(BASE))
    assert (req.v, req.id, req.reply_topic, req.prompt) == (1, "req-1", "replies", "Hello")
    assert req.reply_partition is None and req.messages is None and req.prompt_token_ids is None
    # max_tokens None: what the model length leaves after the prompt (issue 50)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.min_p) == (
        None,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (req.repetition_penalty, req.presence_penalty, req.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (
        req.seed is None and req.stop == [] and req.stop_token_ids == [] and req.ignore_eos is False
    )
    assert req.priority == 0 and req.timeout_s is None and req.created_at is None
    assert req.tenant == "default" and req.stream is True and req.metadata == {}
    assert req.logit_bias is None


# --- v, id, reply_topic, reply_partition -------------------------------------------------------


@pytest.mark.parametrize("v", [2, 0, "1", 1.0, True, None, ...])
def test_v_must_be_1(v):
    reject("v", v=v)


@pytest.mark.parametrize("rid", ["a", "A.b_c:d-9", "x" * 128, "0"])
def test_good_ids(rid):
    assert decode_request(pack(request(id=rid))).id == rid


@pytest.mark.parametrize("rid", ["", "x" * 129, "a b", "a/b", "é", 7, b"abc", None, ..., ["a"]])
def test_unusable_id_is_dead_lettered(rid):
    assert "id" in dead_letter(pack(request(id=rid))).reason


@pytest.mark.parametrize("topic", ["r", "a.b_c-D9", "t" * 249, "..."])
def test_good_reply_topics(topic):
    assert decode_request(pack(request(reply_topic=topic))).reply_topic == topic


@pytest.mark.parametrize(
    "topic", ["", ".", "..", "t" * 250, "a b", "a/b", "a:b", 5, b"replies", None, ...]
)
def test_unusable_reply_topic_is_dead_lettered(topic):
    assert "reply_topic" in dead_letter(pack(request(reply_topic=topic))).reason


@pytest.mark.parametrize("part", [0, 7, None])
def test_good_reply_partition(part):
    assert decode_request(pack(request(reply_partition=part))).reply_partition == part


@pytest.mark.parametrize("part", [-1, "0", 1.0, True])
def test_bad_reply_partition(part):
    err = reject("reply_partition", reply_partition=part)
    assert err.reply_partition is None  # the reply then goes by key


def test_invalid_request_carries_the_reply_route():
    err = reject("temperature", temperature=-1, reply_partition=3)
    assert (err.request_id, err.reply_topic, err.reply_partition, err.code) == (
        "req-1",
        "replies",
        3,
        "invalid_request",
    )


# --- prompt, messages, prompt_token_ids --------------------------------------------------------


def test_exactly_one_prompt_field():
    assert decode_request(
        pack(request(prompt=..., messages=[{"role": "user", "content": "hi"}]))
    ).messages == [ChatMessage(role="user", content="hi")]
    assert decode_request(pack(request(prompt=..., prompt_token_ids=[1, 2]))).prompt_token_ids == [
        1,
        2,
    ]
    # nil counts as absent
    assert decode_request(pack(request(messages=None, prompt_token_ids=None))).prompt == "Hello"


def test_no_prompt_field():
    reject("prompt", prompt=...)
    reject("prompt", prompt=None)


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"prompt_token_ids": [1]}, "prompt_token_ids"),
    ],
)
def test_two_prompt_fields(extra, field):
    assert "only one of" in reject(field, **extra).message


@pytest.mark.parametrize(
    "prompt", ["", 5, b"Hello", ["Hello"], "\udcff".encode("utf-8", "surrogateescape")]
)
def test_bad_prompt(prompt):
    reject("prompt", prompt=prompt)


def test_prompt_bad_utf8_is_rejected_not_dead_lettered():
    raw = b"\x84\xa1v\x01\xa2id\xa1x\xabreply_topic\xa1t\xa6prompt\xa2\xff\xfe"
    err = decode_request_err(raw)
    assert err.field == "prompt"


def decode_request_err(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_request(raw)
    return info.value


def test_unicode_prompt_ok():
    assert decode_request(pack(request(prompt="héllo 🌍 日本"))).prompt == "héllo 🌍 日本"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user"}],
        [{"content": "x"}],
        [{"role": "", "content": "x"}],
        [{"role": "user", "content": b"x"}],
        [{"role": 1, "content": "x"}],
        ["user: x"],
        {"role": "user", "content": "x"},
        "hi",
    ],
)
def test_bad_messages(messages):
    err = reject("messages", prompt=..., messages=messages)
    assert err.path.startswith("messages")


def test_messages_extra_keys_ignored():
    req = decode_request(
        pack(request(prompt=..., messages=[{"role": "system", "content": "", "name": "x"}]))
    )
    assert req.messages[0].role == "system" and req.messages[0].content == ""


@pytest.mark.parametrize("ids", [[], [-1], [1.0], [True], ["1"], "1 2", [[1]]])
def test_bad_prompt_token_ids(ids):
    reject("prompt_token_ids", prompt=..., prompt_token_ids=ids)


def test_prompt_token_ids_limit():
    data = pack(request(prompt=..., prompt_token_ids=[1] * 11))
    assert len(decode_request(data, max_prompt_tokens=11).prompt_token_ids) == 11
    with pytest.raises(InvalidRequest) as info:
        decode_request(data, max_prompt_tokens=10)
    assert (info.value.field, info.value.code) == ("prompt_token_ids", "prompt_too_long")


def test_million_token_prompt_is_cheap_to_reject():
    data = pack(request(prompt=..., prompt_token_ids=[5] * 1_000_000))
    assert len(data) < DEFAULT_MAX_MESSAGE_BYTES
    with pytest.raises(InvalidRequest) as info:
        decode_request(data, max_prompt_tokens=2048)
    assert info.value.code == "prompt_too_long"


# --- caps on every list and string (issue 25) ---------------------------------------------------


def chat(n: int, role: str = "user") -> list[dict]:
    return [{"role": role, "content": ""}] * n


def bias(n: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(n)}


def tools(n: int, **function) -> dict:
    """A chat request offering `n` functions (tools need messages)."""
    fns = [{"type": "function", "function": {"name": f"f{i}", **function}} for i in range(n)]
    return {"prompt": ..., "messages": chat(1), "tools": fns}


def keys(n: int) -> dict[str, str]:
    return {f"k{i}": "" for i in range(n)}


# (field, changes at the cap, the same one over it): the first accepted, the second rejected.
CAPS = [
    (
        "reply_partition",
        {"reply_partition": MAX_REPLY_PARTITION},
        {"reply_partition": MAX_REPLY_PARTITION + 1},
    ),
    (
        "messages",
        {"prompt": ..., "messages": chat(MAX_MESSAGES)},
        {"prompt": ..., "messages": chat(MAX_MESSAGES + 1)},
    ),
    (
        "messages",
        {"prompt": ..., "messages": chat(1, "r" * MAX_ROLE_LEN)},
        {"prompt": ..., "messages": chat(1, "r" * (MAX_ROLE_LEN + 1))},
    ),
    (
        "prompt_token_ids",
        {"prompt": ..., "prompt_token_ids": [1] * MAX_PROMPT_TOKEN_IDS},
        {"prompt": ..., "prompt_token_ids": [1] * (MAX_PROMPT_TOKEN_IDS + 1)},
    ),
    (
        "prompt_token_ids",
        {"prompt": ..., "prompt_token_ids": [MAX_TOKEN_ID]},
        {"prompt": ..., "prompt_token_ids": [MAX_TOKEN_ID + 1]},
    ),
    ("stop", {"stop": ["s"] * MAX_STOP}, {"stop": ["s"] * (MAX_STOP + 1)}),
    ("stop", {"stop": ["s" * MAX_STOP_LEN]}, {"stop": ["s" * (MAX_STOP_LEN + 1)]}),
    (
        "stop_token_ids",
        {"stop_token_ids": [7] * MAX_STOP_TOKEN_IDS},
        {"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
    ),
    ("stop_token_ids", {"stop_token_ids": [MAX_TOKEN_ID]}, {"stop_token_ids": [MAX_TOKEN_ID + 1]}),
    ("priority", {"priority": PRIORITY_RANGE[1]}, {"priority": PRIORITY_RANGE[1] + 1}),
    ("priority", {"priority": PRIORITY_RANGE[0]}, {"priority": PRIORITY_RANGE[0] - 1}),
    ("timeout_s", {"timeout_s": MAX_TIMEOUT_S}, {"timeout_s": MAX_TIMEOUT_S + 0.5}),
    ("tenant", {"tenant": "t" * MAX_TENANT_LEN}, {"tenant": "t" * (MAX_TENANT_LEN + 1)}),
    ("metadata", {"metadata": keys(MAX_METADATA_KEYS)}, {"metadata": keys(MAX_METADATA_KEYS + 1)}),
    (
        "metadata",
        {"metadata": {"k": "x" * (MAX_METADATA_BYTES - 1)}},
        {"metadata": {"k": "x" * MAX_METADATA_BYTES}},
    ),
    ("logit_bias", {"logit_bias": bias(MAX_LOGIT_BIAS)}, {"logit_bias": bias(MAX_LOGIT_BIAS + 1)}),
    ("logit_bias", {"logit_bias": {"1": 100}}, {"logit_bias": {"1": 100.01}}),
    ("logit_bias", {"logit_bias": {"1": -100}}, {"logit_bias": {"1": -100.01}}),
    (
        "chat_template_kwargs",
        {"chat_template_kwargs": {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS)}},
        {"chat_template_kwargs": {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}},
    ),
    (
        "chat_template_kwargs",
        {"chat_template_kwargs": {"x": "y" * MAX_TEMPLATE_VALUE_LEN}},
        {"chat_template_kwargs": {"x": "y" * (MAX_TEMPLATE_VALUE_LEN + 1)}},
    ),
    (
        "chat_template_kwargs",
        {"chat_template_kwargs": {"a" * 64: 1}},
        {"chat_template_kwargs": {"a" * 65: 1}},
    ),
    (
        "chat_template_kwargs",
        {"chat_template_kwargs": {"enable": 1}},
        {"chat_template_kwargs": {"tokenize": 1}},
    ),
    ("logit_bias", {"logit_bias": {str(MAX_TOKEN_ID): 1}}, {"logit_bias": {str(2**31): 1}}),
    ("tools", tools(MAX_TOOLS), tools(MAX_TOOLS + 1)),
    (
        "tools",
        tools(1, description="d" * MAX_TOOL_DESCRIPTION_LEN),
        tools(1, description="d" * (MAX_TOOL_DESCRIPTION_LEN + 1)),
    ),
    (
        "tools",
        tools(1, parameters={"description": "d" * (MAX_GRAMMAR_BYTES - 18)}),
        tools(1, parameters={"description": "d" * (MAX_GRAMMAR_BYTES - 17)}),
    ),
    ("tools", tools(1), {**tools(1), "tools": tools(1)["tools"] * 2}),  # names distinct
    ("tools", tools(1), {**tools(1), "messages": None, "prompt": "x"}),  # with messages only
    ("tool_format", {"tool_format": "llama3_json"}, {"tool_format": "mistral"}),
]
# The longest prompt_token_ids at the cap is a few bytes over the default message size.
BIG = 4 * DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    "field,at_cap,over", CAPS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(CAPS)]
)
def test_at_the_cap_accepted_one_over_rejected(field, at_cap, over):
    assert decode_request(pack(request(**at_cap)), max_bytes=BIG) is not None
    with pytest.raises(InvalidRequest) as info:
        decode_request(pack(request(**over)), max_bytes=BIG)
    assert info.value.field == field and info.value.message.startswith(field), info.value.message
    assert len(info.value.message) < 300


def test_every_list_and_string_field_has_a_cap():
    # prompt (and message content) are bounded by the message size alone; id and reply_topic by
    # their patterns (a request without them is dead-lettered, not rejected).
    by_size = {"prompt", "id", "reply_topic"}
    capped = {field for field, _, _ in CAPS}
    for field, prop in Request.model_json_schema()["properties"].items():
        kinds = {alt.get("type") for alt in prop.get("anyOf", [prop])}
        if kinds & {"array", "string", "object"} and field not in by_size:
            assert field in capped, f"{field}: no cap, or no test of it in CAPS"


def test_seed_range_is_what_msgpack_and_torch_take():
    for seed in SEED_RANGE:
        assert decode_request(pack(request(seed=seed))).seed == seed
    # One past either end cannot be packed; a Python-side construction is refused.
    for seed in (SEED_RANGE[0] - 1, SEED_RANGE[1] + 1):
        with pytest.raises(ValidationError) as info:
            Request(id="a", reply_topic="t", prompt="x", seed=seed)
        assert info.value.errors()[0]["loc"] == ("seed",)


def test_reply_partition_over_the_cap_replies_by_key():
    assert (
        reject("reply_partition", reply_partition=MAX_REPLY_PARTITION + 1).reply_partition is None
    )


def test_million_stop_token_ids_are_rejected_by_count():
    data = pack(request(stop_token_ids=[5] * 1_000_000))
    assert len(data) < DEFAULT_MAX_MESSAGE_BYTES
    with pytest.raises(InvalidRequest) as info:
        decode_request(data)
    assert info.value.field == "stop_token_ids" and "1000000 ids" in info.value.message


@pytest.mark.parametrize(
    "field,value",
    [
        ("messages", chat(50_000)),
        ("stop", ["s"] * 200_000),
        ("metadata", keys(100_000)),
    ],
    ids=["messages", "stop", "metadata"],
)
def test_huge_lists_are_rejected_by_count(field, value):
    changes = {field: value, **({"prompt": ...} if field == "messages" else {})}
    data = pack(request(**changes))
    assert len(data) < DEFAULT_MAX_MESSAGE_BYTES
    with pytest.raises(InvalidRequest) as info:
        decode_request(data)
    assert info.value.field == field and f"{len(value)} " in info.value.message


# --- sampling parameters -----------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")

GOOD = [
    ("max_tokens", [None, 1, 256, 100_000]),
    ("temperature", [0, 0.0, 0.7, 2, 100.0]),
    ("top_p", [1e-9, 0.5, 1, 1.0]),
    ("top_k", [0, 1, 50]),
    ("min_p", [0, 0.0, 0.5, 1, 1.0]),
    ("repetition_penalty", [1e-6, 1, 1.3]),
    ("presence_penalty", [-2, -2.0, 0, 1.5, 2]),
    ("frequency_penalty", [-2, 0.0, 2.0]),
    ("seed", [None, 0, -1, 2**63 - 1, 2**64 - 1]),
    ("stop", [[], ["\n"], ["a"] * 16, ["</s>", "User:"]]),
    ("stop_token_ids", [[], [0], [2, 49152]]),
    ("ignore_eos", [False, True]),
    ("priority", [0, -5, 10]),
    ("timeout_s", [None, 0.001, 30, 600.0]),
    ("created_at", [None, 0, 1_700_000_000.5]),
    ("tenant", ["default", "acme", "t" * 256, "a.b_c:d-9"]),
    ("stream", [True, False]),
    ("metadata", [{}, {"k": "v"}, {"a": "x" * 4095}, {"é": "x" * 4094}]),
    (
        "logit_bias",
        [None, {}, {"0": 1}, {"50256": -100}, {"1": 100.0, "2": -0.5}, {"2147483647": 0}],
    ),
]

BAD = [
    ("max_tokens", [0, -1, 1.0, "5", True]),
    ("temperature", [-0.1, -1, NAN, INF, "1", True, None]),
    ("top_p", [0, 0.0, -0.5, 1.0001, 2, NAN, True, None]),
    ("top_k", [-1, 1.0, "1", True]),
    ("min_p", [-0.01, 1.01, NAN, INF, False]),
    ("repetition_penalty", [0, 0.0, -1, INF, NAN, True]),
    ("presence_penalty", [-2.01, 2.01, NAN, -INF, True]),
    ("frequency_penalty", [-3, 3, NAN, INF, False]),
    ("seed", [1.0, "1", True]),
    ("stop", [["a"] * 17, [""], [1], [b"x"], "\n", None]),
    ("stop_token_ids", [[-1], [1.0], [True], "1", None]),
    ("ignore_eos", [0, 1, "true", None]),
    ("priority", [1.0, "0", True, None]),
    ("timeout_s", [0, 0.0, -1, NAN, INF, "10", True]),
    ("created_at", [-1, NAN, INF, "now", True]),
    ("tenant", ["", 5, b"acme", "t" * 257, None, "a b", "a/b", "é", "acme\n"]),
    ("stream", [0, 1, "false", None]),
    (
        "metadata",
        [
            {"a": "x" * 4096},
            {"é": "x" * 4095},
            {"k": 1},
            {"k": None},
            {"k": b"v"},
            ["k", "v"],
            None,
        ],
    ),
    (
        "logit_bias",
        [{"a": 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {"1": NAN}, {"1": True}, {"1": "1"}]
        + [{"2147483648": 1}, {"1x": 1}, {"": 1}, [[1, 1]], {"1": None}, {"1" * 11: 1}],
    ),
]


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in GOOD for v in vs])
def test_good_value(field, value):
    req = decode_request(pack(request(**{field: value})))
    assert getattr(req, field) == value


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD for v in vs], ids=repr)
def test_bad_value(field, value):
    reject(field, **{field: value})


def test_ints_accepted_as_floats_stay_floats():
    req = decode_request(pack(request(temperature=0, top_p=1, timeout_s=5)))
    assert (
        type(req.temperature) is float and type(req.top_p) is float and type(req.timeout_s) is float
    )


def test_metadata_size_counts_utf8_keys_and_values():
    assert metadata_bytes({"é": "ab", "k": ""}) == 2 + 2 + 1
    # a non-str metadata key (int) is rejected by msgpack's strict_map_key before any rule
    with pytest.raises(UndecodableMessage):
        decode_request(pack(request(metadata={1: "v"})))


def test_metadata_bin_key_rejected():
    reject("metadata", metadata={b"k": "v"})


def test_unknown_fields_are_ignored():
    req = decode_request(pack(request(future_field={"x": [1, 2]}, another=None)))
    assert req.prompt == "Hello" and not hasattr(req, "future_field")


def test_non_str_top_level_key_ignored():
    data = pack({**BASE, b"prompt": "bytes key"})
    assert decode_request(data).prompt == "Hello"


def test_error_message_does_not_echo_input():
    err = reject("prompt", prompt=["A" * 10_000])
    assert len(err.message) < 300


# --- codec limits and garbage ------------------------------------------------------------------


def test_size_limit_checked_before_decoding():
    data = pack(request(prompt="x" * 2000))
    assert decode_request(data, max_bytes=len(data)).prompt == "x" * 2000
    assert "limit" in dead_letter(data, max_bytes=len(data) - 1).reason


def test_100mb_message_is_rejected_before_decoding(monkeypatch):
    """Cheap whatever the size: the limit is a len(), checked before msgpack sees a byte."""
    data = b"\xc6" + (100 * 2**20).to_bytes(4, "big") + bytes(100 * 2**20)

    def unpackb(*args, **kw):
        raise AssertionError("decoded a message over the limit")

    monkeypatch.setattr(msgpack, "unpackb", unpackb)
    assert "limit" in dead_letter(data).reason


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"not msgpack at all",
        pack([BASE]),
        pack("a string"),
        pack(42),
        pack(None),
        pack(BASE) + b"\x00",  # trailing data
        pack(BASE)[:-3],  # truncated
        b"\x91" * 5000 + b"\xc0",  # absurdly deep nesting
        b"\xdf\xff\xff\xff\xff",  # claims 4 billion map entries
        b"\xdd\xff\xff\xff\xff",  # claims 4 billion array entries
        b"\xdb\xff\xff\xff\xff",  # claims a 4 GiB string
        b"\x81\x91\x01\x01",  # array as map key
    ],
)
def test_garbage_is_dead_lettered(data):
    dead_letter(data)


def test_none_and_non_bytes_are_dead_lettered():
    for data in (None, "text", 12):
        with pytest.raises(UndecodableMessage):
            decode_request(data)


def test_deep_nesting_in_unknown_field():
    # 1000 levels is within msgpack's stack: ignored as an unknown field
    raw = b"\x85" + pack("v") + pack(1) + pack("id") + pack("a") + pack("reply_topic") + pack("t")
    raw += pack("prompt") + pack("p") + pack("deep") + b"\x91" * 1000 + b"\xc0"
    assert decode_request(raw).prompt == "p"


def test_deep_nesting_in_known_field():
    raw = b"\x84" + pack("v") + pack(1) + pack("id") + pack("a") + pack("reply_topic") + pack("t")
    raw += pack("prompt") + b"\x91" * 1000 + b"\xc0"
    assert decode_request_err(raw).field == "prompt"


def test_text_is_str_never_bin():
    data = encode_request(
        Request(id="a", reply_topic="t", prompt="héllo", stop=["x"], metadata={"k": "v"})
    )
    assert msgpack.unpackb(data, raw=True)[b"prompt"] == "héllo".encode()  # str type, not bin
    assert b"\xc4" not in data and b"\xc5" not in data and b"\xc6" not in data


# --- request round trip and Python-side construction --------------------------------------------


def test_request_round_trip():
    req = Request(
        id="r:1",
        reply_topic="t",
        reply_partition=2,
        messages=[ChatMessage(role="user", content="x")],
        max_tokens=5,
        temperature=0,
        seed=3,
        stop=["\n"],
        stop_token_ids=[2],
        ignore_eos=True,
        priority=-1,
        timeout_s=2.5,
        created_at=time.time(),
        tenant="acme",
        stream=False,
        metadata={"k": "v"},
    )
    assert decode_request(encode_request(req)) == req


def test_encode_request_omits_none_fields():
    obj = msgpack.unpackb(encode_request(Request(id="a", reply_topic="t", prompt="x")))
    assert obj["v"] == 1 and "seed" not in obj and "messages" not in obj and "timeout_s" not in obj


def test_request_constructor_validates():
    with pytest.raises(ValidationError):
        Request(id="a", reply_topic="t")
    with pytest.raises(ValidationError):
        Request(id="a", reply_topic="t", prompt="x", prompt_token_ids=[1])
    with pytest.raises(ValidationError):
        Request(v=True, id="a", reply_topic="t", prompt="x")
    with pytest.raises(ValidationError):
        Request(id="a b", reply_topic="t", prompt="x")


# --- events and cancel -------------------------------------------------------------------------


def done(**kw) -> DoneEvent:
    base = dict(
        id="r",
        attempt="w1-0",
        seq=5,
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=4),
        timing=Timing(queue_s=0.01, ttft_s=0.2, total_s=1.5),
        text="hello",
        metadata={"k": "v"},
    )
    return DoneEvent(**{**base, **kw})


EVENTS = [
    StartedEvent(id="r", attempt="w1-0", seq=0, worker="host:1", queue_s=0.5),
    TokensEvent(id="r", attempt="w1-0", seq=1, token_ids=[1, 2, 3], text="abc"),
    TokensEvent(id="r", attempt="w1-0", seq=2, token_ids=[], text=""),
    done(),
    done(
        finish_reason="rejected",
        error=ErrorInfo(code="prompt_too_long", message="prompt_token_ids: too long"),
        timing=Timing(queue_s=0, ttft_s=None, total_s=0),
        text=None,
    ),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_event_round_trip(event):
    data = encode_event(event)
    back = decode_event(data)
    assert back == event and type(back) is type(event)
    obj = msgpack.unpackb(data)
    assert {"v", "type", "id", "attempt", "seq"} <= obj.keys() and obj["v"] == 1


def test_done_writes_nil_not_omitted():
    obj = msgpack.unpackb(
        encode_event(done(text=None, timing=Timing(queue_s=0, ttft_s=None, total_s=0)))
    )
    assert "error" in obj and obj["error"] is None
    assert "text" in obj and obj["text"] is None
    assert "ttft_s" in obj["timing"] and obj["timing"]["ttft_s"] is None


def test_event_type_discriminates():
    obj = msgpack.unpackb(encode_event(EVENTS[1]))
    assert isinstance(decode_event(pack(obj)), TokensEvent)


@pytest.mark.parametrize(
    "obj",
    [
        {"v": 1, "type": "nope", "id": "r", "attempt": "a", "seq": 0},
        {
            "v": 2,
            "type": "started",
            "id": "r",
            "attempt": "a",
            "seq": 0,
            "worker": "w",
            "queue_s": 0,
        },
        {
            "v": 1,
            "type": "started",
            "id": "r",
            "attempt": "a",
            "seq": -1,
            "worker": "w",
            "queue_s": 0,
        },
        {"v": 1, "type": "started", "id": "r", "seq": 0, "worker": "w", "queue_s": 0},
        {
            "v": 1,
            "type": "done",
            "id": "r",
            "attempt": "a",
            "seq": 0,
            "finish_reason": "bogus",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            "timing": {"queue_s": 0, "ttft_s": None, "total_s": 0},
        },
        {
            "v": 1,
            "type": "tokens",
            "id": "r",
            "attempt": "a",
            "seq": 0,
            "token_ids": [1],
            "text": b"bin",
        },
        [1, 2],
    ],
)
def test_bad_events_are_undecodable(obj):
    with pytest.raises(UndecodableMessage):
        decode_event(pack(obj))


def test_event_extra_fields_ignored():
    obj = {**msgpack.unpackb(encode_event(EVENTS[0])), "new_field": 1}
    assert decode_event(pack(obj)) == EVENTS[0]


@pytest.mark.parametrize("code", ERROR_CODES)
def test_every_error_code(code):
    ev = done(finish_reason="error", error=ErrorInfo(code=code, message="m"))
    assert decode_event(encode_event(ev)).error.code == code


@pytest.mark.parametrize("reason", FINISH_REASONS)
def test_every_finish_reason(reason):
    assert decode_event(encode_event(done(finish_reason=reason))).finish_reason == reason


def test_cancel_round_trip():
    data = encode_cancel(Cancel(id="abc"))
    assert msgpack.unpackb(data) == {"v": 1, "id": "abc"}
    assert decode_cancel(data) == Cancel(id="abc")


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",
        pack({"v": 1}),
        pack({"v": 1, "id": "a b"}),
        pack({"v": 2, "id": "a"}),
        pack(["a"]),
        b"x" * 100_000,
    ],
)
def test_bad_cancel(data):
    with pytest.raises(UndecodableMessage):
        decode_cancel(data)


# --- properties --------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_contract_errors(data):
    try:
        decode_request(data)
    except (UndecodableMessage, InvalidRequest):
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = list(Request.model_fields)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), msgpack_values, max_size=8))
def test_arbitrary_maps_with_routing_raise_only_invalid_request(fields):
    obj = {**fields, "id": "r1", "reply_topic": "t"}
    try:
        req = decode_request(pack(obj))
    except InvalidRequest as err:
        assert err.field in FIELDS or err.field == "request"
        assert err.request_id == "r1" and err.reply_topic == "t"
    else:
        assert decode_request(encode_request(req)) == req
        assert all(math.isfinite(x) for x in (req.temperature, req.top_p, req.min_p))
