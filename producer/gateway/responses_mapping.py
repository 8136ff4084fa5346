"""OpenAI's Responses API (`/v1/responses`) over the chat mapping: a Responses body becomes a chat
body (openai_mapping.chat_request maps it on), and a chat answer becomes a response object and
its output items (responses_events.py streams them). design: docs/gateway.md#responses-api
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from inferline.contract.schema import MAX_MESSAGES
from inferline.producer.gateway.errors import bad_request
from inferline.producer.gateway.openai_mapping import PASSTHROUGH

# Every field honoured; any other is refused by name. `store`, `previous_response_id` and
# `background` are the store's (responses_store.py).
FIELDS = frozenset(
    (
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "stream",
        "store",
        "previous_response_id",
        "background",
        "metadata",
        "user",
        *PASSTHROUGH,
    )
)
# Not implemented: accepted only with the value that asks for nothing (the Agents SDK sends some).
NO_OP = {"truncation": "disabled", "include": [], "n": 1, "reasoning": {}, "service_tier": "auto"}
# Chat parameter -> the Responses parameter it came from, for the errors chat's mapping raises.
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "stream_options": "stream",
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_PAIRS = 16


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# --- request ------------------------------------------------------------------------------


def chat_body(body: dict, history: list[dict]) -> dict:
    """The chat body that asks what the Responses `body` asks; `history`: the stored
    conversation of previous_response_id, in chat turns, put before the input."""
    _refuse_unknown(body)
    chat = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}
    chat["messages"] = [*_instructions(body), *history, *input_messages(body.get("input"))]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("stream", "user", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    # A forced call (tool_choice required or named) writes no text for text.format to shape: the
    # call's grammar stands alone (instructor sends both, the tool's schema in each).
    if response_format is not None and not _forces_call(chat.get("tool_choice")):
        chat["response_format"] = response_format
    return chat


def _refuse_unknown(body: dict) -> None:
    for name, value in body.items():
        if name in FIELDS or value is None or (name in NO_OP and value == NO_OP[name]):
            continue
        raise bad_request(name, f"{name} is not supported")
    if "n" in body and body["n"] not in (None, 1):
        raise bad_request("n", "n is not supported")
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata: Any) -> None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_PAIRS
        and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise bad_request(
            "metadata", "metadata: at most 16 string pairs, keys up to 64 characters, values 512"
        )


def _instructions(body: dict) -> list[dict]:
    text = body.get("instructions")
    if text is None:
        return []
    if not isinstance(text, str):
        raise bad_request("instructions", "instructions: must be a string")
    return [{"role": "system", "content": text}]


def input_messages(items: Any) -> list[dict]:
    """Input items -> chat turns: a function call joins the assistant turn before it, a call's
    output is a tool turn, a reasoning item is dropped (templates drop past thinking)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input", "input: must be a string or a non-empty list of items")
    if len(items) > MAX_MESSAGES:
        raise bad_request("input", f"input: {len(items)} items, at most {MAX_MESSAGES}")
    turns: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request("input", f"input.{i}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message(item, i))
        elif kind == "function_call":
            _add_call(turns, item, i)
        elif kind == "function_call_output":
            turns.append(_call_output(item, i))
        elif kind != "reasoning":
            raise bad_request("input", f"input.{i}.type: {kind!r} is not supported")
    return turns


def _message(item: dict, i: int) -> dict:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise bad_request("input", f"input.{i}.role: must be one of {', '.join(ROLES)}")
    return {"role": role, "content": _text(item.get("content"), f"input.{i}.content")}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [None]
    if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in parts):
        raise bad_request("input", f"{where}: a string or text parts (input_text, output_text)")
    if not all(isinstance(p.get("text"), str) for p in parts):
        raise bad_request("input", f"{where}: a text part's text must be a string")
    return "\n".join(p["text"] for p in parts)


def _add_call(turns: list[dict], item: dict, i: int) -> None:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, args, call_id)):
        raise bad_request("input", f"input.{i}: a function_call needs call_id, name, arguments")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    if not turns or turns[-1]["role"] != "assistant":
        turns.append({"role": "assistant", "content": ""})
    turns[-1].setdefault("tool_calls", []).append(call)


def _call_output(item: dict, i: int) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise bad_request("input", f"input.{i}.call_id: must be a string")
    return {"role": "tool", "tool_call_id": call_id, "content": _text(output, f"input.{i}.output")}


def _tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request("tools", f"tools.{i}: only function tools are supported, not {kind!r}")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise bad_request(
        "tool_choice",
        'tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...}',
    )


def _forces_call(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _text_format(text: Any) -> dict | None:
    """`text.format` -> chat's response_format (json_schema: the contract's constraint)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or not isinstance(fmt, (dict, type(None))):
        raise bad_request("text", "text: must be an object with `format`")
    unknown = [k for k, v in text.items() if k != "format" and v is not None]
    if unknown:  # `verbosity`, ...
        raise bad_request("text", f"text.{unknown[0]} is not supported")
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request("text", f"text.format.type: {kind!r} is not supported")
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def param_of(chat_param: str | None) -> str | None:
    """The Responses parameter that a chat error's `param` stands for."""
    return PARAMS.get(chat_param, chat_param)


# --- response -----------------------------------------------------------------------------


def response_object(body: dict, resp_id: str, model: str, status: str = "in_progress") -> dict:
    """A response object, its output still empty: what the request set, echoed as OpenAI does."""
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": bool(body.get("background")),
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store") is not False,
        "temperature": body.get("temperature"),
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    inp, out = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def finish(response: dict, output: list[dict], finish_reason: str | None, chat_usage) -> dict:
    """`response` completed with its output (incomplete when max_output_tokens cut it)."""
    cut = finish_reason == "length"
    response.update(
        status="incomplete" if cut else "completed",
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        output=output,
        usage=usage(chat_usage),
    )
    return response


def output_items(message: dict) -> list[dict]:
    """A chat answer's message -> output items: reasoning, message, function calls."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        f = call["function"]
        items.append(call_item(call["id"], f["name"], f["arguments"]))
    return items


def reasoning_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)],
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_turn(output: list[dict]) -> dict:
    """The chat turn that output items make, as a stored conversation keeps it."""
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )
    turn: dict = {"role": "assistant", "content": text}
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }
        for it in output
        if it["type"] == "function_call"
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn
