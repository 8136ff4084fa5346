"""OpenAI's batch format, line by line: input lines checked into BatchLines, each line's request
id, and output lines (formats: docs/batch.md#input and docs/batch.md#output).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from inferline.contract.schema import Request
from inferline.producer.gateway.errors import OpenAIError, bad_request, from_validation
from inferline.producer.gateway.openai_mapping import chat_request, completion_request

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
MAX_CUSTOM_ID = 512  # characters; a line key should not be a document
# Batch work's priority class (docs/batch.md, "Priorities").
BATCH_PRIORITY = 100


class DuplicateCustomIds(ValueError):
    """The input names a custom_id more than once: refused before anything is sent."""


@dataclass
class BatchLine:
    """One input line, checked: ``fields`` for InferenceClient.submit, or ``error`` saying why it
    cannot be sent."""

    lineno: int
    custom_id: str | None = None
    url: str = CHAT_URL
    fields: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    logprobs: bool = False
    error: str | None = None
    digest: str = ""  # of custom_id and request: part of its request id

    @property
    def key(self) -> str:
        """What marks the line answered in an output file: its custom_id, or its line number."""
        return self.custom_id if self.custom_id is not None else f"line:{self.lineno}"

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL


def parse_lines(text: str, *, priority: int = BATCH_PRIORITY) -> list[BatchLine]:
    """Every non-blank line of a batch input file, checked; raises DuplicateCustomIds."""
    lines = [
        parse_line(n, raw, priority=priority)
        for n, raw in enumerate(text.splitlines(), 1)
        if raw.strip()
    ]
    check_unique(lines)
    return lines


def check_unique(lines: list[BatchLine]) -> None:
    counts = Counter(ln.custom_id for ln in lines if ln.custom_id is not None)
    dups = [cid for cid, k in counts.items() if k > 1]
    if dups:
        where = {cid: [ln.lineno for ln in lines if ln.custom_id == cid] for cid in dups[:5]}
        shown = "; ".join(
            f"{cid!r} on lines {', '.join(map(str, ns))}" for cid, ns in where.items()
        )
        more = f" (and {len(dups) - 5} more)" if len(dups) > 5 else ""
        raise DuplicateCustomIds(f"duplicate custom_id: {shown}{more}; each line needs its own")


def parse_line(lineno: int, raw: str, *, priority: int = BATCH_PRIORITY) -> BatchLine:
    line = BatchLine(lineno)
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return _bad(line, f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return _bad(line, "must be a JSON object with custom_id, method, url and body")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return _bad(line, f"custom_id: required, a string of 1-{MAX_CUSTOM_ID} characters")
    line.custom_id = cid
    problem = _envelope_problem(obj)
    if problem:
        return _bad(line, problem)
    line.url, body = obj["url"], obj["body"]
    try:
        _map_body(line, body, priority)
    except OpenAIError as exc:
        return _bad(line, "body." + _located(exc))
    line.digest = _digest(cid, line.url, body)
    return line


def _envelope_problem(obj: dict) -> str | None:
    if obj.get("method") != "POST":
        return "method: must be POST"
    if obj.get("url") not in URLS:
        return f"url: must be {CHAT_URL} or {COMPLETIONS_URL}"
    if not isinstance(obj.get("body"), dict):
        return "body: required, a JSON object (the request of the url)"
    if obj["body"].get("stream"):
        return "body.stream: a batch line is answered whole; leave stream out or false"
    return None


def _map_body(line: BatchLine, body: dict, priority: int) -> None:
    """The gateway's mapping and the contract's rules, so a line fails where the same HTTP request
    would (OpenAIError naming the field)."""
    if body.get("tools"):  # output lines do not read tool calls out of the answer (yet)
        raise bad_request("tools", "tools is not supported in batch lines")
    mapped = (chat_request if line.chat else completion_request)(body)
    fields = dict(mapped.fields)
    # Batch work never outranks interactive work: a line may ask to be later, not sooner.
    asked = fields.get("priority", 0)
    if type(asked) is int:  # otherwise the contract's check names it
        fields["priority"] = max(asked, priority)
    try:
        Request(id="x", reply_topic="x", **fields)
    except ValidationError as exc:
        raise from_validation(exc, mapped.rename) from None
    model = body.get("model")
    line.fields, line.logprobs, line.model = (
        fields,
        mapped.logprobs,
        model if isinstance(model, str) else None,
    )


def _located(exc: OpenAIError) -> str:
    # The gateway's messages start with the parameter's path ("messages.0.role: ...").
    if exc.param and not exc.message.startswith(exc.param):
        return f"{exc.param}: {exc.message}"
    return exc.message


def _bad(line: BatchLine, problem: str) -> BatchLine:
    line.error = f"line {line.lineno}: {problem}"
    return line


def _digest(custom_id: str, url: str, body: dict) -> str:
    canonical = json.dumps(
        [custom_id, url, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# Request ids and output lines


def request_id(batch_id: str, line: BatchLine) -> str:
    """The line's Kafka request id: the same in every run, so a line sent twice is answered once."""
    assert line.digest, "a bad line is never sent"
    return f"{batch_id}-{line.digest}"


def _line_id(line: BatchLine) -> str:
    return f"batch_req_{line.digest or f'line{line.lineno}'}"


def response_line(line: BatchLine, request_id: str, status: int, body: dict) -> dict:
    """The output line of an answered (``status`` 200) or refused line."""
    return {
        "id": _line_id(line),
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(line: BatchLine, code: str, message: str) -> dict:
    """The output line of a line that got no response."""
    return {
        "id": _line_id(line),
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def line_key(out: dict) -> str | None:
    """The key (BatchLine.key) of an output line."""
    if isinstance(out.get("custom_id"), str):
        return out["custom_id"]
    oid = out.get("id")
    if isinstance(oid, str) and oid.startswith("batch_req_line"):
        return f"line:{oid.removeprefix('batch_req_line')}"
    return None


def failed(out: dict) -> bool:
    response = out.get("response")
    return out.get("error") is not None or not response or response.get("status_code") != 200
