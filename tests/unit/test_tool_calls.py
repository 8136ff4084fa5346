"""Tool calling (issue 50, item 1) without a broker: the gateway's tool-call parsers
(producer/gateway/tool_calls.py), whole and in any pieces; the mapping of `tools` and
`tool_choice` onto the contract (a grammar for `required` and a named function); and the worker
showing the tools to the model, through its chat template or the fallback system prompt."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from inferline.config.settings import Settings
from inferline.contract.schema import decode_request, encode_request, Request
from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.gateway.openai_mapping import chat_request
from inferline.producer.gateway.openai_responses import Shape
from inferline.producer.gateway.tool_calls import ToolCallParser, ToolMode, parse
from inferline.worker.app import engine_settings
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.request_tracker import engine_request

NAMES = frozenset({"get_weather", "get_time"})
HERMES, LLAMA = ToolMode("hermes", NAMES), ToolMode("llama3_json", NAMES)
WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\""}}'
TIME = '{"arguments": {"tz": "CET"}, "name": "get_time"}'  # arguments first: read whole


def calls_of(mode: ToolMode, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse(text, mode)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(
    "mode, text, expected",
    [
        (
            HERMES,
            f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>\n",
            (
                "Let me look.\n",
                [("get_weather", '{"city": "Pa}ris \\"x\\""}'), ("get_time", '{"tz": "CET"}')],
            ),
        ),
        (HERMES, "No call: a <tool_ call.", ("No call: a <tool_ call.", [])),
        (  # a function the request does not offer: content
            HERMES,
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
        ),
        (HERMES, "<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
        (
            LLAMA,
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}',
            ("", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
        ),
        (LLAMA, '{"answer": 4}', ('{"answer": 4}', [])),
        (LLAMA, "It is 4.", ("It is 4.", [])),
        (
            ToolMode("json", NAMES),
            '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"x"}}]',
            ("", [("get_time", "{}"), ("get_weather", '{"city":"x"}')]),
        ),
        (  # parallel_tool_calls false: the first call only
            ToolMode("hermes", NAMES, parallel=False),
            f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>",
            ("", [("get_weather", '{"city": "Pa}ris \\"x\\""}')]),
        ),
    ],
)
def test_a_whole_answer_splits_into_content_and_calls(mode, text, expected):
    assert calls_of(mode, text) == expected


def test_ids_are_openai_shaped_and_distinct():
    _, calls = parse(f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>", HERMES)
    ids = [c["id"] for c in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert {c["type"] for c in calls} == {"function"}


WORDS = {
    "hermes": ["<tool_call>", "<tool", "_call>", "</tool_call>", WEATHER, TIME, "\n", "Hi ", "{"],
    "llama3_json": [
        "<|python_tag|>",
        "<|py",
        '{"name": "get_time", "parameters": {"tz": "a"}}',
        WEATHER,
        "; ",
        "[",
        "\n",
        "Hi",
    ],
    "json": ["[", '{"name":"get_time","parameters":{"tz":"}"}}', ",", "]", " "],  # forced
}


@settings(max_examples=300)
@given(st.sampled_from(sorted(WORDS)), st.data())
def test_any_pieces_parse_as_the_whole(parser, data):
    text = "".join(data.draw(st.lists(st.sampled_from(WORDS[parser]), max_size=6)))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=10)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    mode = ToolMode(parser, NAMES)
    stream, content, calls = ToolCallParser(mode), "", {}
    for piece in [*pieces, None]:
        text_delta, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += text_delta
        for d in deltas:  # as the openai SDK's stream helpers assemble them
            if "id" in d:
                assert d["index"] == len(calls) and d["function"]["name"]
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    assert calls_of(mode, text) == (content, [tuple(c) for c in calls.values()])


def test_arguments_are_sent_as_they_arrive():
    stream = ToolCallParser(HERMES)
    out = [stream.feed(p)[1] for p in ["<tool_call>", '{"name": "get_time", "arguments": {"t', "z"]]
    assert out[1][0]["function"] == {"name": "get_time", "arguments": ""}
    assert [d["function"]["arguments"] for d in out[1][1:] + out[2]] == ['{"t', "z"]


# --------------------------------------------------------------------------- mapping

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def mapped(**body):
    return chat_request({"messages": CHAT, "tools": [WEATHER_TOOL, TIME_TOOL], **body})


def test_auto_offers_the_tools_and_parses_with_the_setting():
    out = mapped()
    assert out.fields["tools"] == [WEATHER_TOOL, TIME_TOOL]
    assert "response_format" not in out.fields and out.tools.parser == "hermes"
    llama = chat_request({"messages": CHAT, "tools": [TIME_TOOL]}, "llama3_json")
    assert (llama.fields["tool_format"], llama.tools.parser) == ("llama3_json", "llama3_json")
    none = mapped(tool_choice="none")
    assert "tools" not in none.fields and none.tools is None


def test_a_named_function_is_forced_by_a_schema():
    out = mapped(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = out.fields["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["parameters"] == WEATHER_TOOL["function"]["parameters"]
    assert out.tools == ToolMode("json", frozenset({"get_weather"}), parallel=False)
    assert out.rename["response_format"] == "tool_choice"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_any_of_the_functions(parallel):
    out = mapped(tool_choice="required", parallel_tool_calls=parallel)
    schema = out.fields["response_format"]["json_schema"]["schema"]
    one = schema["items"] if parallel else schema
    assert [s["properties"]["name"]["const"] for s in one["anyOf"]] == ["get_weather", "get_time"]
    assert (schema.get("type"), out.tools.parallel) == (
        ("array", True) if parallel else (None, False)
    )
    Request(id="r", reply_topic="t", **out.fields)  # the contract takes it


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_a_bad_tool_request_is_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        mapped(**body)
    assert err.value.param == param


# --------------------------------------------------------------------------- worker side

TOOL_TEMPLATE = (
    "{% for t in tools %}<tool {{ t.function.name }}>{% endfor %}"
    "{% for m in messages %}<{{ m.role }}: {{ m.content }}>{% endfor %}"
)


def prompt_text(model_runner, monkeypatch, template, messages, fmt="hermes") -> str:
    out = chat_request({"messages": messages, "tools": [WEATHER_TOOL]}, fmt)
    req = Request(id="r1", reply_topic="inferline.reply.t", **out.fields)
    req = decode_request(encode_request(req), 1 << 20, 2048)
    engine = LLMEngine(model_runner, engine_settings(Settings()))
    if template is not None:
        monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    return engine.tokenizer.decode(engine.tokenize(engine_request(req, "a1", 8, 0.0, None)))


def test_a_template_that_renders_tools_gets_them(model_runner, monkeypatch):
    text = prompt_text(model_runner, monkeypatch, TOOL_TEMPLATE, CHAT)
    assert text == "<tool get_weather><user: Weather in Paris?>"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_template_without_tools_gets_the_fallback_prompt(model_runner, monkeypatch, fmt):
    turns = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    ]
    text = prompt_text(model_runner, monkeypatch, None, turns, fmt)  # SmolLM2's own template
    assert json.dumps(WEATHER_TOOL["function"]["parameters"]) in text
    key = "arguments" if fmt == "hermes" else "parameters"
    call = f'{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}'
    assert (f"<tool_call>\n{call}\n</tool_call>" if fmt == "hermes" else call) in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_a_whole_chat_answer_carries_the_calls_after_the_reasoning():
    shape = Shape(True, "r1", "m", "think", HERMES)
    text = f"<think>Paris, then.</think>\n<tool_call>{WEATHER}</tool_call>"
    (choice,) = shape.whole(text, "stop", None)["choices"]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris, then.", None)
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == "tool_calls"
    (choice,) = shape.whole("No call.", "stop", None)["choices"]  # no calls: as before
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
