"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` -> the contract's `tools` and
`tool_format`, and for `required` or a named function a JSON schema the grammar engine forces:
the answer is then one call object `{"name": ..., "parameters": {...}}` (an array of them for
`required` with parallel calls), its arguments valid against the function's schema. The key is
`parameters`, not `arguments`: the contract sorts a schema's keys, and the name must come first
for a streamed call to be sent as it is written.
"""

from __future__ import annotations

from typing import Any

from inferline.producer.gateway.errors import bad_request
from inferline.producer.gateway.tool_calls import ToolMode

ANY_OBJECT = {"type": "object"}


def tool_fields(body: dict, parser: str) -> tuple[dict[str, Any], ToolMode | None]:
    """(contract fields, how answers are read) of a chat body's tools; a 400 naming the
    parameter at fault. No tools, or tool_choice `none`: nothing (the model is not shown them)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", "parallel_tool_calls: must be a boolean")
    parallel = parallel is not False
    tools, choice = body.get("tools") or None, body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice: needs tools")
        return {}, None
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return {}, None
    fields: dict[str, Any] = {"tools": tools, "tool_format": parser}
    names = frozenset(functions)
    if choice == "auto":
        return fields, ToolMode(parser, names, parallel)
    if choice == "required":
        one = {"anyOf": [_call_schema(n, p) for n, p in functions.items()]}
        schema = {"type": "array", "minItems": 1, "items": one} if parallel else one
        mode = ToolMode("json", names, parallel)
    else:
        name = _named(choice, functions)
        schema, mode = (
            _call_schema(name, functions[name]),
            ToolMode("json", frozenset({name}), False),
        )
    fields["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "tool_call", "schema": schema, "strict": True},
    }
    return fields, mode


def _functions(tools: Any) -> dict[str, dict]:
    """Function name -> its parameters' schema; the contract checks the rest."""
    if not isinstance(tools, list):
        raise bad_request("tools", "tools: must be a list of tools")
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise bad_request(
                "tools", f'tools.{i}: must be {{"type": "function", "function": {{...}}}}'
            )
        name = function.get("name")
        if isinstance(name, str):
            out[name] = function.get("parameters") or ANY_OBJECT
    return out


def _named(choice: Any, functions: dict[str, dict]) -> str:
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if name is None:
        raise bad_request(
            "tool_choice",
            'tool_choice: must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    if name not in functions:
        raise bad_request("tool_choice", f"tool_choice: no function {name!r} in tools")
    return name


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
