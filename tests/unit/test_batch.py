"""The batch format without a broker: input lines checked (errors name the line and the field),
duplicate custom_ids refused, request ids stable, output files read back and repaired, and the
answer an earlier run left on the reply topic chosen. On the broker: tests/kafka/test_batch.py."""

from __future__ import annotations

import json

import pytest

from inferline.contract.schema import DoneEvent, StartedEvent, Timing, Usage
from inferline.producer.batch.lines import (
    BATCH_PRIORITY,
    DuplicateCustomIds,
    error_line,
    failed,
    line_key,
    parse_line,
    parse_lines,
    request_id,
    response_line,
)
from inferline.producer.batch.local import State, read_output
from inferline.producer.batch.runner import _best_attempt


def line(custom_id="a", url="/v1/chat/completions", **body) -> str:
    body = body or {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize(
    "raw, problem",
    [
        ("{not json", "line 3: not valid JSON"),
        ("[1, 2]", "line 3: must be a JSON object"),
        (json.dumps({"method": "POST"}), "line 3: custom_id: required"),
        (json.dumps({"custom_id": "", "method": "POST"}), "line 3: custom_id: required"),
        (
            json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
            "line 3: method: must be POST",
        ),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}),
            "line 3: url: must be",
        ),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions"}),
            "line 3: body: required",
        ),
        (line(messages=[{"role": "user", "content": "x"}], stream=True), "line 3: body.stream:"),
        (line(messages=[]), "line 3: body.messages: must be a non-empty list"),
        (
            line(messages=[{"role": "user", "content": "x"}], max_tokens=0),
            "line 3: body.max_tokens: Input should be greater",
        ),
        (
            line(messages=[{"role": "user", "content": "x"}], top_p=2),
            "line 3: body.top_p: Input should be less",
        ),
        (
            line(messages=[{"role": "user", "content": "x"}], tools=[{}]),
            "line 3: body.tools is not supported in batch lines",
        ),
        (line(url="/v1/completions", prompt=["a", "b"]), "line 3: body.prompt: must be one string"),
        (
            line(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "line 3: body.messages.0.content: only text",
        ),
    ],
)
def test_bad_lines_name_the_line_and_the_field(raw, problem):
    parsed = parse_line(3, raw)
    assert parsed.error is not None and parsed.error.startswith(problem), parsed.error
    out = error_line(parsed, "invalid_request", parsed.error)
    assert out["response"] is None and out["error"] == {
        "code": "invalid_request",
        "message": parsed.error,
    }
    assert failed(out) and line_key(out) == parsed.key


def test_good_lines_map_like_the_gateway():
    chat, legacy = parse_lines(
        line("a") + "\n\n" + line("b", "/v1/completions", prompt="Once", max_tokens=3, seed=1)
    )
    assert (
        chat.error is None
        and chat.chat
        and chat.fields["max_tokens"] == 4
        and chat.fields["stream"] is False
    )
    assert (legacy.lineno, legacy.fields["prompt"], legacy.fields["seed"], legacy.chat) == (
        3,
        "Once",
        1,
        False,
    )
    # batch work never outranks interactive work: a line may only ask to be later
    assert chat.fields["priority"] == BATCH_PRIORITY
    (low,) = parse_lines(line(messages=[{"role": "user", "content": "x"}], priority=-5))
    (late,) = parse_lines(line(messages=[{"role": "user", "content": "x"}], priority=500))
    assert (low.fields["priority"], late.fields["priority"]) == (BATCH_PRIORITY, 500)
    (logprobs,) = parse_lines(line(messages=[{"role": "user", "content": "x"}], logprobs=True))
    assert logprobs.logprobs and logprobs.fields["stream"] is True  # logprobs ride on tokens events


def test_duplicate_custom_ids_are_refused_up_front():
    with pytest.raises(DuplicateCustomIds, match=r"'a' on lines 1, 3"):
        parse_lines("\n".join([line("a"), line("b"), line("a")]))
    # a bad line's custom_id counts too: two answers would share one key
    with pytest.raises(DuplicateCustomIds):
        parse_lines("\n".join([line("a"), json.dumps({"custom_id": "a", "method": "GET"})]))


def test_request_ids_are_the_batch_and_the_line():
    a, b = parse_lines("\n".join([line("a"), line("b")]))
    (a_again,) = parse_lines(line("a"))
    assert request_id("batch_1", a) == request_id("batch_1", a_again) != request_id("batch_2", a)
    assert request_id("batch_1", a) != request_id("batch_1", b)
    (changed,) = parse_lines(line("a", messages=[{"role": "user", "content": "other"}]))
    assert request_id("batch_1", changed) != request_id(
        "batch_1", a
    )  # a changed line is a new request
    assert len(request_id("batch_" + "f" * 16, a)) <= 128


def test_output_lines_and_reading_them_back(tmp_path):
    a, b = parse_lines("\n".join([line("a"), "{bad"]))
    ok = response_line(a, "rid", 200, {"object": "chat.completion"})
    assert not failed(ok) and failed(response_line(a, "rid", 429, {"error": {}}))
    path = tmp_path / "out.jsonl"
    bad = error_line(b, "invalid_request", b.error)
    path.write_text(
        json.dumps(ok)
        + "\n"
        + json.dumps(bad)
        + "\n"
        + '{"id": "batch_req_x", "custom_id": "c", "resp'
    )
    assert set(read_output(path)) == {"a", "line:2"}
    assert path.read_text().endswith(
        "}\n"
    )  # the line cut short by a kill is gone; appending goes on
    assert read_output(tmp_path / "missing.jsonl") == {}


def test_state_file_keeps_the_batch_id_and_the_sends(tmp_path):
    path = tmp_path / "out.jsonl.state"
    state, resumed = State.load_or_create(path, "sha")
    assert not resumed and state.batch_id.startswith("batch_")
    with state.open():
        state.record_sent("r1")
        state.record_sent("r2")
    with path.open("a") as f:
        f.write('{"sent": "r3"')  # cut short
    again, resumed = State.load_or_create(path, "sha")
    assert resumed and again.batch_id == state.batch_id and again.sent == {"r1", "r2"}


def _done(attempt: str, reason: str, seq: int = 1) -> DoneEvent:
    return DoneEvent(
        id="r",
        attempt=attempt,
        seq=seq,
        finish_reason=reason,
        text="t",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timing=Timing(queue_s=0, ttft_s=0, total_s=0),
    )


def test_the_answer_an_earlier_run_left_behind():
    started = StartedEvent(id="r", attempt="a1", seq=0, worker="w", queue_s=0.0)
    assert _best_attempt([]) is None and _best_attempt([started]) is None  # still running
    assert _best_attempt([started, _done("a1", "requeued")]) is None
    # a line answered twice (sent twice): a success wins over a refusal, whichever came last
    assert _best_attempt([_done("a1", "stop"), _done("a2", "rejected")]) == "a1"
    assert _best_attempt([_done("a1", "rejected"), _done("a2", "length")]) == "a2"
    assert _best_attempt([_done("a1", "timeout")]) == "a1"


def test_multipart_upload_is_parsed_without_python_multipart():
    from inferline.producer.gateway.errors import OpenAIError
    from inferline.producer.gateway.files import parse_upload

    body = (
        b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XX\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b'Content-Type: application/jsonl\r\n\r\n{"a": 1}\n{"b": 2}\n\r\n--XX--\r\n'
    )
    assert parse_upload("multipart/form-data; boundary=XX", body) == (
        b'{"a": 1}\n{"b": 2}\n',
        "in.jsonl",
        "batch",
    )
    with pytest.raises(OpenAIError, match="purpose: must be batch"):
        parse_upload(
            "multipart/form-data; boundary=XX", body.replace(b"\r\nbatch\r\n", b"\r\nfine-tune\r\n")
        )
    with pytest.raises(OpenAIError, match="multipart"):
        parse_upload("application/json", b"{}")
