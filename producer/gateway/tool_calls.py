"""Tool calls out of a chat answer's text (INFERLINE_GATEWAY__TOOL_CALL_PARSER, as vLLM's
--tool-call-parser), in the formats of contract/tool_format.py:

- `hermes`: calls between `<tool_call>` and `</tool_call>`; the text around them is content.
- `llama3_json`: an answer that opens with `{` (or `<|python_tag|>`) is calls, JSON objects
  separated by `;`; any other answer is all content.
- `json` (not a setting): what the grammar forced for tool_choice `required` or a named function,
  one call object or an array of them.

A call is an object `{"name": ..., "arguments" or "parameters": {...}}` naming one of the
request's functions; anything else stays content. Streamed, a call's id and name are sent once
its name is read, then its arguments piece by piece as they arrive; text that may begin a call is
held back until the next piece tells.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from inferline.contract.tool_format import PYTHON_TAG, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from inferline.producer.gateway.reasoning import _partial_suffix

ToolParserName = Literal["hermes", "llama3_json"]
# The head of a call object, up to where its arguments (an object) begin.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_SEPARATORS = " \t\r\n;,[]"  # between the calls of a bare-JSON answer


@dataclass(frozen=True)
class ToolMode:
    """How one request's answers are read: `parser` (hermes, llama3_json or json), the
    request's function names, and whether more than one call is kept."""

    parser: str
    names: frozenset[str]
    parallel: bool = True


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class _Object:
    """A JSON object being read: its braces are counted outside strings."""

    raw: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    inner_ends: list[int] = field(default_factory=list)  # where a value at depth 1 ended

    def feed(self, text: str) -> int:
        """Reads `text` up to the object's end: how much of it was read."""
        for i, c in enumerate(text):
            self.raw += c
            if self.in_string:
                self.escaped, self.in_string = (
                    (False, True) if self.escaped else (c == "\\", c != '"')
                )
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self.inner_ends.append(len(self.raw))
                if self.depth == 0:
                    return i + 1
        return len(text)

    @property
    def closed(self) -> bool:
        return self.depth == 0 and bool(self.raw)


@dataclass
class _Call:
    obj: _Object = field(default_factory=_Object)
    name: str | None = None  # set once the head is read and names a function
    head_read: bool = False
    args_start: int = 0
    sent: int = 0  # of raw: the arguments sent so far end here

    def args_end(self) -> int:
        """Where the arguments end in raw, or its length while they go on."""
        ends = [e for e in self.obj.inner_ends if e > self.args_start]
        return ends[0] if ends else len(self.obj.raw)


class ToolCallParser:
    """Splits one choice's text, delta by delta, into content and tool-call deltas (OpenAI's
    `delta.tool_calls` entries, with `index`); `calls` holds the calls made, whole."""

    def __init__(self, mode: ToolMode, new_id: Callable[[], str] = new_call_id) -> None:
        self.mode, self._new_id = mode, new_id
        self.calls: list[dict] = []
        self._state = "text" if mode.parser == "hermes" else "start"
        self._held = ""
        self._call: _Call | None = None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool-call deltas) that `text` adds."""
        text, self._held = self._held + text, ""
        content, deltas = "", []
        while text and self._state != "done":
            if self._state == "content":
                content, text = content + text, ""
            elif self._call is not None:
                piece, text = self._in_call(text, deltas)
                content += piece
            elif self._state == "close":
                text = self._close(text)
            else:
                step = self._text if self.mode.parser == "hermes" else self._bare
                piece, text = step(text)
                content += piece
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back, once the text has ended: an unfinished call that was named is
        sent as it stands; other held text is content, but whitespace after calls."""
        held, self._held, deltas = self._held, "", []
        if self._call is not None:
            call, self._call = self._call, None
            if call.name is not None:
                self._send_args(call, len(call.obj.raw), deltas)
                return "", deltas
            held = self._region(call) + held
        between = _SEPARATORS if self._state == "calls" else None
        if self._state in ("done", "close") or (self.calls and not held.strip(between)):
            held = ""
        return held, deltas

    # --- outside a call ----------------------------------------------------------------------

    def _text(self, text: str) -> tuple[str, str]:
        """hermes: content up to a `<tool_call>`; a piece that may begin one is held."""
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._call = _Call()
            return self._content(text[:start], True), text[start + len(TOOL_CALL_OPEN) :]
        keep = _partial_suffix(text, TOOL_CALL_OPEN)
        self._held = text[len(text) - keep :]
        return self._content(text[: len(text) - keep], False), ""

    def _content(self, text: str, before_call: bool) -> str:
        # After a call, trailing whitespace is held until text follows: before a call or at the
        # end it is dropped.
        if not self.calls:
            return text
        body = text.rstrip()
        if not before_call:
            self._held = text[len(body) :] + self._held
        return body

    def _close(self, text: str) -> str:
        """hermes, after a call's object: its `</tool_call>`, if the model wrote it."""
        stripped = text.lstrip()
        if not stripped or TOOL_CALL_CLOSE.startswith(stripped):
            self._held = text
            return ""
        self._state = "text"
        return stripped[len(TOOL_CALL_CLOSE) :] if stripped.startswith(TOOL_CALL_CLOSE) else text

    def _bare(self, text: str) -> tuple[str, str]:
        """llama3_json and json: calls while the answer is JSON objects, then content."""
        between = self._state == "calls" or self.mode.parser == "json"
        rest = text.lstrip(_SEPARATORS if between else None)
        if self._state == "start" and self.mode.parser == "llama3_json":
            if rest and PYTHON_TAG.startswith(rest):
                self._held = text  # maybe the start of the tag
                return "", ""
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG) :].lstrip()
        if not rest:
            self._held = text  # not known yet
            return "", ""
        if rest[0] == "{":
            self._state, self._call = "calls", _Call()
            return "", rest
        first, self._state = self._state == "start", "content"
        return (text if first else rest), ""

    # --- inside a call -----------------------------------------------------------------------

    def _in_call(self, text: str, deltas: list[dict]) -> tuple[str, str]:
        """(content, rest of `text`): reads the call's object, sending what is known."""
        call = self._call
        if not call.obj.raw:
            stripped = text.lstrip()
            if not stripped:
                self._held = text
                return "", ""
            if stripped[0] != "{":  # hermes: the tags hold no call, so they are content
                self._call = None
                return TOOL_CALL_OPEN, text
            text = stripped
        used = call.obj.feed(text)
        if not call.head_read and (head := _HEAD.match(call.obj.raw)):
            call.head_read = True
            name = json.loads(head.group(1))
            if name in self.mode.names:
                call.name, call.args_start, call.sent = name, head.end(), head.end()
                deltas.append(self._header(name))
        if call.name is not None:
            self._send_args(call, call.args_end(), deltas)
        if not call.obj.closed:
            return "", ""
        self._call = None
        return self._end_call(call, deltas), text[used:]

    def _end_call(self, call: _Call, deltas: list[dict]) -> str:
        """A call's object closed; one not named by its head is read whole. Not a call of the
        request's functions: it is content."""
        if call.name is None:
            parsed = _call_of(call.obj.raw, self.mode.names)
            if parsed is None:
                self._state = "text" if self.mode.parser == "hermes" else "content"
                return self._region(call)
            deltas.append(self._header(parsed[0]))
            self.calls[-1]["function"]["arguments"] = parsed[1]
            deltas.append(self._args_delta(parsed[1]))
        if self.mode.parser == "hermes":
            self._state = "close"
        if not self.mode.parallel:
            self._state = "done"
        return ""

    def _region(self, call: _Call) -> str:
        return (TOOL_CALL_OPEN if self.mode.parser == "hermes" else "") + call.obj.raw

    def _header(self, name: str) -> dict:
        call_id = self._new_id()
        function = {"name": name, "arguments": ""}
        self.calls.append({"id": call_id, "type": "function", "function": dict(function)})
        return {
            "index": len(self.calls) - 1,
            "id": call_id,
            "type": "function",
            "function": function,
        }

    def _send_args(self, call: _Call, end: int, deltas: list[dict]) -> None:
        piece = call.obj.raw[call.sent : end]
        if piece:
            call.sent = end
            self.calls[-1]["function"]["arguments"] += piece
            deltas.append(self._args_delta(piece))

    def _args_delta(self, piece: str) -> dict:
        return {"index": len(self.calls) - 1, "function": {"arguments": piece}}


def _call_of(raw: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object written whole, or None."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def parse(text: str, mode: ToolMode, new_id: Callable[[], str] = new_call_id) -> tuple[str, list]:
    """(content, calls) of a whole answer: calls as `message.tool_calls` entries."""
    parser = ToolCallParser(mode, new_id)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return content + rest, parser.calls
