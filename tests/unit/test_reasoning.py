"""The gateway's reasoning parser (producer/gateway/reasoning.py): whole answers, and the same
split when the text arrives in any pieces (tags cut anywhere)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from inferline.producer.gateway.openai_responses import Shape
from inferline.producer.gateway.reasoning import ReasoningSplitter, split


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("think", "<think>2+2</think>\n4", ("2+2", "\n4")),
        ("think", "  <think>a</think>b", ("a", "b")),
        ("think", "4", (None, "4")),
        ("think", "no <think> first", (None, "no <think> first")),
        ("think", "<think>cut off", ("cut off", "")),
        ("deepseek_r1", "2+2</think>4", ("2+2", "4")),
        ("deepseek_r1", "<think>2+2</think>4", ("2+2", "4")),
        ("deepseek_r1", "never closed", ("never closed", "")),
        ("", "<think>a</think>b", (None, "<think>a</think>b")),
    ],
)
def test_a_whole_answer_splits_into_reasoning_and_content(parser, text, expected):
    assert split(text, parser) == expected


@given(
    st.sampled_from(["think", "deepseek_r1"]),
    st.lists(st.sampled_from(["<", "<th", "ink>", "</", "think>", "a", " ", "\n", "b</thi"])),
    st.data(),
)
def test_any_pieces_split_as_the_whole(parser, words, data):
    text = "".join(words)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoning, content = reasoning + r, content + c
    whole = split(text, parser)
    assert (reasoning, content) == (whole[0] or "", whole[1])


def test_the_chat_answer_carries_reasoning_content_only_with_a_parser():
    body = Shape(True, "r", "m", "think").whole("<think>x</think>y", "stop", None)
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "y",
        "reasoning_content": "x",
    }
    plain = Shape(True, "r", "m").whole("<think>x</think>y", "stop", None)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}
