"""The gateway's translation parts without a broker: OpenAI bodies -> contract fields, and the
stream follower across a worker's rerun (an attempt the real-broker tests cannot easily make)."""
from __future__ import annotations

import pytest

from producer.gateway.errors import OpenAIError
from producer.gateway.follower import Diverged, TextFollower
from producer.gateway.openai_mapping import chat_request, completion_request
from producer.schema import DoneEvent, Timing, TokensEvent, Usage


def tokens(attempt: str, seq: int, text: str) -> TokensEvent:
    return TokensEvent(id="r", attempt=attempt, seq=seq, token_ids=[1], text=text)


def done(attempt: str, seq: int, text: str | None = None) -> DoneEvent:
    return DoneEvent(id="r", attempt=attempt, seq=seq, finish_reason="stop", text=text,
                     usage=Usage(prompt_tokens=1, completion_tokens=1), timing=Timing(queue_s=0, ttft_s=0, total_s=0))


def test_chat_body_maps_to_contract_fields():
    m = chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "user": "u", "top_k": 3,
                      "stream": True, "stream_options": {"include_usage": True}})
    assert m.fields["messages"][0].content == "a\nb"
    assert m.fields["max_tokens"] == 7 and m.rename["max_tokens"] == "max_completion_tokens"
    assert m.fields["stop"] == ["x"] and m.fields["metadata"] == {"user": "u"} and m.fields["top_k"] == 3
    assert m.stream and m.include_usage


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_bad_chat_bodies_name_the_parameter(body, param):
    with pytest.raises(OpenAIError) as err:
        chat_request(body)
    assert err.value.status == 400 and err.value.param == param


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
