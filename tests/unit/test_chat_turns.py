"""Conversations keep their turns (issue 50, item 2): an assistant turn's tool calls, a tool
turn's call id and a speaker's name cross the contract and reach the chat template, as
transformers' templates read them (arguments as an object); a turn field the contract does not
know is refused by name, never dropped."""

from __future__ import annotations

import msgpack
import pytest

from inferline.config.settings import Settings
from inferline.contract.schema import (
    MAX_TOOL_CALLS,
    InvalidRequest,
    decode_request,
    encode_request,
    Request,
)
from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.gateway.openai_mapping import chat_request
from inferline.worker.app import engine_settings
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.request_tracker import engine_request

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURNS = [
    {"role": "user", "content": "Weather in Paris?", "name": "ada"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"},
]
# A template that renders every turn field, as tool-calling models' templates do.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}>"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}: {{ m.content }}>"
    "{% else %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}: {{ m.content }}>"
    "{% endif %}{% endfor %}<assistant:"
)


def request(messages) -> Request:
    return Request(id="r1", reply_topic="inferline.reply.t", messages=messages)


def test_the_turns_cross_the_wire_and_reach_the_chat_template(model_runner, monkeypatch):
    mapped = chat_request({"model": "m", "messages": TURNS})
    req = decode_request(encode_request(request(mapped.fields["messages"])), 1 << 20, 2048)
    engine = LLMEngine(model_runner, engine_settings(Settings()))
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)
    ids = engine.tokenize(engine_request(req, "a1", 8, 0.0, None))
    text = engine.tokenizer.decode(ids)
    assert text == (
        "<user ada: Weather in Paris?>"
        '<call call_1 get_weather {"city": "Paris"}>'
        "<result call_1: 18C, sunny><assistant:"
    )


@pytest.mark.parametrize(
    "turn, said",
    [
        ({"role": "user", "content": "x", "refusal": "no"}, "messages.0.refusal"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [CALL] * (MAX_TOOL_CALLS + 1)}, "128"),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{**CALL, "function": {"name": "get weather", "arguments": "{}"}}],
            },
            "messages.0.tool_calls.0.function.name",
        ),
    ],
)
def test_a_turn_the_contract_cannot_carry_whole_is_refused_by_name(turn, said):
    with pytest.raises(OpenAIError) as err:  # at the gateway: a 400 naming it
        chat_request({"model": "m", "messages": [turn]})
    assert said in str(err.value.message)
    raw = {"v": 1, "id": "r1", "reply_topic": "inferline.reply.t", "messages": [turn]}
    with pytest.raises(InvalidRequest) as bad:  # at the worker, from any producer
        decode_request(msgpack.packb(raw), 1 << 20, 2048)
    assert bad.value.field.startswith("messages")


def test_chat_template_kwargs_reach_the_template(model_runner, monkeypatch):
    mapped = chat_request(
        {
            "messages": [{"role": "user", "content": "2+2?"}],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    req = decode_request(
        encode_request(
            request(mapped.fields["messages"]).model_copy(
                update={"chat_template_kwargs": mapped.fields["chat_template_kwargs"]}
            )
        ),
        1 << 20,
        2048,
    )
    engine = LLMEngine(model_runner, engine_settings(Settings()))
    template = "{{ messages[0].content }}{% if enable_thinking %}<think>{% else %}<no>{% endif %}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    ids = engine.tokenize(engine_request(req, "a1", 8, 0.0, None))
    assert engine.tokenizer.decode(ids) == "2+2?<no>"
    with pytest.raises(ValueError, match="tokenize: an argument of the worker"):
        request([{"role": "user", "content": "x"}]).model_validate(
            {
                **request([{"role": "user", "content": "x"}]).model_dump(),
                "chat_template_kwargs": {"tokenize": False},
            }
        )
