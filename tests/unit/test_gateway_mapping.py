"""The gateway's translation parts without a broker: OpenAI bodies -> contract fields, and the
stream follower across a worker's rerun (an attempt the real-broker tests cannot easily make)."""

from __future__ import annotations

import pytest

from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.gateway.follower import Diverged, TextFollower
from inferline.producer.gateway.openai_mapping import chat_request, completion_request
from inferline.producer.gateway.openai_responses import Shape
from inferline.contract.schema import (
    DoneEvent,
    Timing,
    TokenLogprob,
    TokensEvent,
    TopLogprob,
    Usage,
)


def tokens(attempt: str, seq: int, text: str) -> TokensEvent:
    return TokensEvent(id="r", attempt=attempt, seq=seq, token_ids=[1], text=text)


def done(attempt: str, seq: int, text: str | None = None) -> DoneEvent:
    return DoneEvent(
        id="r",
        attempt=attempt,
        seq=seq,
        finish_reason="stop",
        text=text,
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timing=Timing(queue_s=0, ttft_s=0, total_s=0),
    )


def test_chat_body_maps_to_contract_fields():
    m = chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stop": "x",
            "user": "u",
            "top_k": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert m.fields["messages"][0].content == "a\nb"
    assert m.fields["max_tokens"] == 7 and m.rename["max_tokens"] == "max_completion_tokens"
    assert (
        m.fields["stop"] == ["x"]
        and m.fields["metadata"] == {"user": "u"}
        and m.fields["top_k"] == 3
    )
    assert m.stream and m.include_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ],
)
def test_bad_chat_bodies_name_the_parameter(body, param):
    with pytest.raises(OpenAIError) as err:
        chat_request(body)
    assert err.value.status == 400 and err.value.param == param


def test_logprobs_are_asked_of_the_worker_with_tokens_events():
    chat = chat_request(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    )
    assert (chat.fields["logprobs"], chat.fields["top_logprobs"], chat.fields["stream"]) == (
        True,
        2,
        True,
    )
    assert chat.logprobs and not chat.stream  # the worker streams, the HTTP answer stays whole
    legacy = completion_request({"prompt": "x", "logprobs": 3})
    assert (legacy.fields["logprobs"], legacy.fields["top_logprobs"], legacy.fields["stream"]) == (
        True,
        3,
        True,
    )
    assert legacy.rename["top_logprobs"] == "logprobs"
    assert not chat_request({"messages": [{"role": "user", "content": "x"}]}).logprobs
    for bad in ({"logprobs": "yes"},):
        with pytest.raises(OpenAIError) as err:
            chat_request({"messages": [{"role": "user", "content": "x"}], **bad})
        assert err.value.param == "logprobs"
    for bad in (6, -1, True, "2"):
        with pytest.raises(OpenAIError) as err:
            completion_request({"prompt": "x", "logprobs": bad})
        assert err.value.param == "logprobs"


def test_logprobs_in_openai_shapes():
    entries = [
        TokenLogprob(
            token=" Par",
            logprob=-0.5,
            top_logprobs=[
                TopLogprob(token_id=1, token=" Par", logprob=-0.5),
                TopLogprob(token_id=2, token=" the", logprob=-1.5),
            ],
        ),
        TokenLogprob(
            token="is",
            logprob=-0.25,
            top_logprobs=[TopLogprob(token_id=3, token="is", logprob=-0.25)],
        ),
        TokenLogprob(token="\ufffd", logprob=-3.0),
    ]
    chat = Shape(True, "r", "m").logprobs(entries)
    assert [e["token"] for e in chat["content"]] == [" Par", "is", "\ufffd"]
    assert chat["content"][0]["bytes"] == list(b" Par") and chat["content"][2]["bytes"] is None
    assert chat["content"][0]["top_logprobs"] == [
        {"token": " Par", "logprob": -0.5, "bytes": list(b" Par")},
        {"token": " the", "logprob": -1.5, "bytes": list(b" the")},
    ]
    legacy = Shape(False, "r", "m").logprobs(entries, offset=10)
    assert legacy["tokens"] == [" Par", "is", "\ufffd"] and legacy["token_logprobs"] == [
        -0.5,
        -0.25,
        -3.0,
    ]
    assert legacy["top_logprobs"][0] == {" Par": -0.5, " the": -1.5} and legacy["text_offset"] == [
        10,
        14,
        16,
    ]


def test_completion_prompts():
    assert completion_request({"prompt": ["hi"]}).fields["prompt"] == "hi"
    assert completion_request({"prompt": [[1, 2]]}).fields["prompt_token_ids"] == [1, 2]
    with pytest.raises(OpenAIError):
        completion_request({"prompt": ["a", "b"]})


def test_follower_holds_a_rerun_back_until_it_passes_what_was_sent():
    f = TextFollower()
    assert f.feed(tokens("a1", 1, "Hello")) == "Hello"
    assert f.feed(tokens("a1", 2, " wor")) == " wor"
    assert f.feed(tokens("a2", 1, "Hel")) == ""  # the rerun catching up
    assert f.feed(tokens("a2", 2, "lo world")) == "ld"
    assert f.feed(done("a2", 3, "Hello world!")) == "!"  # done's whole text also fills a gap
    with pytest.raises(Diverged):
        f.feed(tokens("a3", 1, "Goodbye"))


@pytest.mark.parametrize("tenant, forwarded", [("ops", True), ("acme", False), (None, False)])
def test_priority_is_forwarded_only_for_keys_allowed_to_set_it(tenant, forwarded):
    """A body's `priority` reaches Kafka only from an API key whose tenant is in
    INFERLINE_GATEWAY__PRIORITY_TENANTS; from any other caller it is dropped (issue 38)."""
    import asyncio

    from inferline.config.settings import Settings
    from inferline.producer.gateway.auth import ApiKeys
    from inferline.producer.gateway.metrics import GatewayMetrics
    from inferline.producer.gateway.service import Gateway

    class Pool:
        sent: list = []

        async def submit(self, tenant, fields):
            self.sent.append(fields)

    settings = Settings(
        gateway={"api_keys": {"k1": "ops", "k2": "acme"}, "priority_tenants": ["ops"]}
    )
    pool = Pool()
    gateway = Gateway(settings, ApiKeys({"k1": "ops", "k2": "acme"}), pool, GatewayMetrics())
    mapped = chat_request({"messages": [{"role": "user", "content": "hi"}], "priority": -1000})
    asyncio.run(gateway._submit(tenant, mapped))
    assert ("priority" in pool.sent[-1]) is forwarded


CHAT_BODY = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    "extra, field, value",
    [
        ({"guided_regex": "a+"}, "structured", {"regex": "a+"}),
        ({"guided_choice": ["yes", "no"]}, "structured", {"choice": ["yes", "no"]}),
        ({"guided_grammar": "root ::= [a-z]+"}, "structured", {"grammar": "root ::= [a-z]+"}),
        (
            {"guided_json": {"type": "object"}},
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "guided_json", "schema": {"type": "object"}},
            },
        ),
        (
            {"guided_json": '{"type": "object"}'},
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "guided_json", "schema": {"type": "object"}},
            },
        ),
        ({"structured_outputs": {"regex": "a+"}}, "structured", {"regex": "a+"}),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured", {"choice": ["a", "b"]}),
        ({"structured_outputs": {"json_object": True}}, "response_format", {"type": "json_object"}),
        (
            {"structured_outputs": {"json": {"type": "integer"}}},
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "structured_outputs", "schema": {"type": "integer"}},
            },
        ),
    ],
)
def test_vllm_guided_extras_become_the_contracts_constraints(extra, field, value):
    """vLLM's guided_* and structured_outputs reach the worker as the contract's constraint
    (issue 50, item 5), on both endpoints, and a rule the contract breaks names the parameter."""
    for request in (
        chat_request({**CHAT_BODY, **extra}),
        completion_request({"prompt": "x", **extra}),
    ):
        assert request.fields[field] == value
        assert request.rename[field] == next(iter(extra))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_bad_or_unsupported_constraints_name_the_parameter(extra, param):
    with pytest.raises(OpenAIError) as err:
        chat_request({**CHAT_BODY, **extra})
    assert err.value.status == 400 and err.value.param == param and param in err.value.message


def test_response_format_works_on_legacy_completions():
    m = completion_request({"prompt": "x", "response_format": {"type": "json_object"}})
    assert m.fields["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),  # deprecated: tools instead
        ({"function_call": "auto"}, "function_call"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"allowed_token_ids": [1]}, "allowed_token_ids"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"chat_template": "{{x}}"}, "chat_template"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"a_field_nobody_knows": 1}, "a_field_nobody_knows"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"echo": True}, "echo"),  # a legacy field on the chat endpoint
    ],
)
def test_every_field_the_gateway_does_not_implement_is_refused_by_name(extra, param):
    """Nothing silently dropped (issue 50, item 5): a field the gateway does not honour is a 400
    naming it, whatever it asks for."""
    with pytest.raises(OpenAIError) as err:
        chat_request({**CHAT_BODY, **extra})
    assert err.value.status == 400 and err.value.param == param
    assert param in err.value.message


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": "end"}, "suffix"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"top_logprobs": 2}, "top_logprobs"),  # a chat field: legacy's `logprobs` is the count
        ({"use_beam_search": True}, "use_beam_search"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ],
)
def test_legacy_fields_not_implemented_are_refused_by_name(extra, param):
    with pytest.raises(OpenAIError) as err:
        completion_request({"prompt": "x", **extra})
    assert err.value.status == 400 and err.value.param == param


def test_fields_that_ask_for_nothing_are_accepted():
    """Nulls, and the values that mean "the default" for fields that are otherwise refused."""
    chat_request({**CHAT_BODY, "tools": [], "tool_choice": "none", "logit_bias": None, "n": None})
    completion_request({"prompt": "x", "echo": False, "best_of": 1, "suffix": None})


def test_a_text_response_format_goes_with_a_guided_extra():
    m = chat_request({**CHAT_BODY, "response_format": {"type": "text"}, "guided_regex": "a"})
    assert m.fields["structured"] == {"regex": "a"} and "response_format" not in m.fields
