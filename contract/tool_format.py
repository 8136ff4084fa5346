"""How a model writes function calls, by `tool_format` (docs/gateway.md, "Tool calling"). The
worker uses it to show a model the tools where its chat template does not render them; the
gateway's parsers read calls written this way.

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `llama3_json`: the answer is the calls themselves, JSON objects `{"name": ..., "parameters":
  {...}}` separated by `;`.
"""

from __future__ import annotations

import json

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call, dropped when read

_INTRO = "You may call functions to answer. The functions, as JSON schemas:\n"
_HOW = {
    "hermes": (
        "To call a function, write a JSON object with its name and arguments between "
        f"{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}, one pair of tags per call:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
        f"\n{TOOL_CALL_CLOSE}"
    ),
    "llama3_json": (
        "To call a function, answer with nothing but a JSON object "
        '{"name": <function name>, "parameters": <arguments as a JSON object>}; for several '
        "calls, separate the objects with ;."
    ),
}


def renders_tools(chat_template: object) -> bool:
    """Whether a chat template shows the `tools` passed to apply_chat_template."""
    return isinstance(chat_template, str) and "tools" in chat_template


def fallback_messages(messages: list[dict], tools: list[dict], fmt: str) -> list[dict]:
    """`messages` for a chat template that does not render tools: the tools and the call format
    in the system turn, earlier calls written in the format, tool results as user turns."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = f"{_INTRO}{listing}\n{_HOW[fmt]}"
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return [_plain_turn(m, fmt) for m in out]


def format_calls(calls: list[dict], fmt: str) -> str:
    """An assistant turn's `tool_calls` as the model would have written them."""
    objs = [_call_object(c["function"], fmt) for c in calls]
    if fmt == "hermes":
        return "\n".join(f"{TOOL_CALL_OPEN}\n{o}\n{TOOL_CALL_CLOSE}" for o in objs)
    return "; ".join(objs)


def _call_object(function: dict, fmt: str) -> str:
    args = function["arguments"]
    if isinstance(args, str):  # not a JSON object: kept as the model wrote it
        args = json.loads(args) if _is_json(args) else args
    key = "arguments" if fmt == "hermes" else "parameters"
    return json.dumps({"name": function["name"], key: args}, ensure_ascii=False)


def _plain_turn(turn: dict, fmt: str) -> dict:
    if turn.get("tool_calls"):
        calls = format_calls(turn["tool_calls"], fmt)
        content = f"{turn['content']}\n{calls}" if turn.get("content") else calls
        return {"role": "assistant", "content": content}
    if turn.get("role") == "tool":  # as Hermes-style templates show a result
        return {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
    return {k: v for k, v in turn.items() if k in ("role", "content")}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
