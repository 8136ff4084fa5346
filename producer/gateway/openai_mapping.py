"""OpenAI request bodies -> the contract's request fields. Only shapes are handled here: values
fail the contract's own validation, by the same rule as on Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from inferline.producer.gateway.errors import bad_request
from inferline.producer.gateway.guided import CONSTRAINTS, constraint
from inferline.producer.gateway.tool_calls import ToolMode
from inferline.producer.gateway.tool_choice import tool_fields
from inferline.contract.schema import ChatMessage

# Passed through unchanged: OpenAI's sampling fields and vLLM's extras (top level, where the
# openai SDK sends `extra_body`).
PASSTHROUGH = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "priority",
    "stop_token_ids",
)
# Every field either endpoint honours; any other is refused by name, never silently ignored.
COMMON = (
    "model",
    *PASSTHROUGH,
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "user",
    "stream",
    "stream_options",
    *CONSTRAINTS,
)
CHAT_FIELDS = frozenset(
    (
        *COMMON,
        "messages",
        "logprobs",
        "top_logprobs",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
)
LEGACY_FIELDS = frozenset((*COMMON, "prompt", "logprobs"))
# Fields the gateway does not implement, accepted only with the value that asks for nothing.
# (`functions` and `function_call`, deprecated at OpenAI: `tools` instead.)
NO_OP = {"functions": [], "echo": False, "best_of": 1}
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' `logprobs` cap at OpenAI


@dataclass
class Mapped:
    """What one OpenAI request asks of the fleet."""

    fields: dict[str, Any]  # InferenceClient.submit's keyword arguments
    stream: bool
    include_usage: bool
    # contract field -> the OpenAI parameter it came from, for error messages
    rename: dict[str, str] = field(default_factory=dict)
    logprobs: bool = False  # the answer carries logprobs
    tools: ToolMode | None = None  # how tool calls are read from the answer


def chat_request(body: dict, tool_parser: str = "hermes") -> Mapped:
    """POST /v1/chat/completions; `tool_parser`: the format the model writes calls in."""
    mapped = _common(body, CHAT_FIELDS)
    tools, mapped.tools = tool_fields(body, tool_parser)
    if "response_format" in tools:  # tool_choice required or named: the grammar forces a call
        if "response_format" in mapped.fields or "structured" in mapped.fields:
            raise bad_request("tool_choice", "tool_choice: forces calls, so no output constraint")
        mapped.rename["response_format"] = "tool_choice"
    mapped.fields.update(tools)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs", "logprobs: must be a boolean")
    if logprobs or body.get("top_logprobs") is not None:  # the contract checks the pair
        _ask_logprobs(mapped, bool(logprobs), body.get("top_logprobs"))
    mapped.fields["messages"] = _messages(body.get("messages"))
    if body.get("chat_template_kwargs") is not None:  # the contract bounds them
        mapped.fields["chat_template_kwargs"] = body["chat_template_kwargs"]
    return mapped


def completion_request(body: dict) -> Mapped:
    """POST /v1/completions (legacy)."""
    mapped = _common(body, LEGACY_FIELDS)
    top = body.get("logprobs")  # legacy: the number of alternatives
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_LEGACY_LOGPROBS:
            raise bad_request(
                "logprobs", f"logprobs: must be an integer from 0 to {MAX_LEGACY_LOGPROBS}"
            )
        _ask_logprobs(mapped, True, top)
        mapped.rename["top_logprobs"] = "logprobs"
    mapped.fields.update(_prompt(body.get("prompt")))
    mapped.rename["prompt_token_ids"] = "prompt"
    return mapped


def _ask_logprobs(mapped: Mapped, logprobs: bool, top: Any) -> None:
    # Logprobs travel in `tokens` events only, so a whole answer is streamed from the worker too.
    mapped.fields.update(logprobs=logprobs, stream=True)
    if top is not None:
        mapped.fields["top_logprobs"] = top
    mapped.logprobs = True


def _refuse_unknown(body: dict, known: frozenset[str]) -> None:
    """A 400 naming the first field that asks for something the gateway does not do."""
    for name, value in body.items():
        if name in known or value is None:  # null: the field is not set
            continue
        if name in NO_OP and type(value) is type(NO_OP[name]) and value == NO_OP[name]:
            continue
        raise bad_request(name, f"{name} is not supported")


def _common(body: dict, known: frozenset[str]) -> Mapped:
    _refuse_unknown(body, known)
    fields = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}
    rename = {}
    if (found := constraint(body)) is not None:
        fields[found[0]], rename[found[0]] = found[2], found[1]
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins, as at OpenAI
        if body.get(name) is not None:
            fields["max_tokens"], rename["max_tokens"] = body[name], name
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    if body.get("user") is not None:
        fields["metadata"] = {"user": body["user"]}
        rename["metadata"] = "user"
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("stream", "stream: must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options", "stream_options: must be an object")
    unknown = [k for k in options if k != "include_usage"]
    if unknown:
        raise bad_request("stream_options", f"stream_options.{unknown[0]} is not supported")
    # No tokens events for a whole answer: it arrives in `done`, one event instead of many.
    fields["stream"] = stream
    return Mapped(fields, stream, stream and bool(options.get("include_usage")), rename)


def _messages(messages: Any) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages: must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request("messages", f"messages.{i}: must be an object with role and content")
        # Every field goes to the contract, which refuses one it does not know by name (a
        # conversation replayed without its tool calls would mislead the model); null is absent.
        turn = {k: v for k, v in m.items() if v is not None}
        turn["content"] = _content(m.get("content"), i)
        try:  # the contract's message rules, located in the list
            out.append(ChatMessage.model_validate(turn))
        except ValidationError as exc:
            err = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in (i, *err["loc"]))
            raise bad_request("messages", f"messages.{where}: {err['msg']}") from None
    return out


def _content(content: Any, i: int) -> Any:
    if content is None:  # an assistant turn that only called tools
        return ""
    if not isinstance(content, list):
        return content  # a str, or a wrong type the contract names
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise bad_request("messages", f"messages.{i}.content: only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(prompt: Any) -> dict[str, Any]:
    # One prompt per request: a string, token ids, or a list holding exactly one of either.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    raise bad_request(
        "prompt", "prompt: must be one string or one list of token ids (batches are not supported)"
    )
