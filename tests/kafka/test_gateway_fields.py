"""Nothing silently dropped at the gateway (issue 50, item 5), through a running gateway and a
worker on the real broker: logit_bias, vLLM's guided extras, response_format on /v1/completions,
the max_tokens default and refusals, a field the gateway does not implement, and a named tool
call that the grammar engine forces (issue 50, item 1)."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.gateway_fixtures import shallow_fleet  # noqa: F401 - fixture
from tests.kafka.test_gateway_tools import function

pytestmark = pytest.mark.kafka

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Is the sky blue?"}]
CITIES = ["Paris", "Oslo"]
MAX_MODEL_LEN = 512  # tests.worker_fixtures.worker_config


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="sk-acme", max_retries=0)


async def refused(create, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        await create(model=MODEL, **kw)
    return err.value


async def test_logit_bias_forces_a_token_and_is_bounded(shallow_fleet, shallow_runner):
    aio = client(shallow_fleet.url)
    forced = 1000
    out = await aio.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert out.choices[0].text == shallow_runner.tokenizer.decode([forced] * 3)
    vocab = shallow_runner.config.vocab_size
    for bias in ({str(vocab): 1}, {"5": 101}, {"x": 1}):  # the worker's vocab, the contract's range
        err = await refused(aio.chat.completions.create, messages=CHAT, logit_bias=bias)
        assert err.param == "logit_bias" and "logit_bias" in err.message


async def test_guided_extras_and_response_format_constrain_the_output(shallow_fleet):
    aio = client(shallow_fleet.url)
    chat = await aio.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    legacy = await aio.completions.create(
        model=MODEL,
        prompt="Three digits:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch("[0-9]{3}", legacy.choices[0].text)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
    legacy = await aio.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=16,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    assert isinstance(json.loads(legacy.choices[0].text)["a"], bool)
    err = await refused(aio.chat.completions.create, messages=CHAT, extra_body={"guided_regex": ""})
    assert err.param == "guided_regex"


async def test_fields_not_implemented_are_refused_by_name(shallow_fleet):
    aio = client(shallow_fleet.url)
    for extra in ({"min_tokens": 2}, {"tool_choice": "auto"}, {"guided_decoding_backend": "x"}):
        err = await refused(aio.chat.completions.create, messages=CHAT, extra_body=extra)
        assert err.param == next(iter(extra)) and err.param in err.message


async def test_max_tokens_defaults_to_what_the_model_length_leaves(shallow_fleet):
    """Left out, max_tokens is what the model length leaves after the prompt (the worker's cap,
    1024, is above it); one that cannot fit, or is over the cap, is a 400 naming it (as vLLM)."""
    aio = client(shallow_fleet.url)
    prompt = list(range(1000, 1000 + MAX_MODEL_LEN - 4))
    out = await aio.completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (4, "length")
    err = await refused(aio.completions.create, prompt=prompt, max_tokens=5)
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert "max_tokens: 5 does not fit" in err.message
    err = await refused(aio.chat.completions.create, messages=CHAT, max_completion_tokens=600)
    assert err.param == "max_completion_tokens"
    err = await refused(aio.chat.completions.create, messages=CHAT, max_tokens=2000)
    assert err.param == "max_tokens" and "INFERLINE_LIMITS__MAX_TOKENS_CAP" in err.message


async def test_a_named_call_from_the_real_worker_follows_the_schema(shallow_fleet):
    """The grammar engine, not the model, makes the call: the shallow model's arguments are
    valid against the function's schema (its template shows the tools by the fallback prompt)."""
    aio = client(shallow_fleet.url)
    out = await aio.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[function("get_weather", CITIES), function("get_time", CITIES)],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=40,
    )
    ((name, args),) = [
        (c.function.name, json.loads(c.function.arguments))
        for c in out.choices[0].message.tool_calls
    ]
    assert name == "get_time" and args["city"] in ("Paris", "Oslo")
    assert out.choices[0].finish_reason == "tool_calls"


async def test_responses_text_format_from_the_real_worker_follows_the_schema(shallow_fleet):
    """/v1/responses' json_schema `text.format` is the contract's constraint: the grammar engine
    holds the shallow model's answer to the schema, whole and streamed."""
    aio = client(shallow_fleet.url)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": CITIES}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    kw = {"model": MODEL, "input": "Where?", "text": {"format": fmt}, "temperature": 0}
    out = await aio.responses.create(**kw, max_output_tokens=24)
    assert json.loads(out.output_text)["city"] in CITIES and out.status == "completed"
    async with aio.responses.stream(**kw, max_output_tokens=24, store=False) as events:
        final = await events.get_final_response()
    assert json.loads(final.output_text)["city"] in CITIES and final.usage.output_tokens > 0
