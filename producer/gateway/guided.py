"""OpenAI's `response_format` and vLLM's guided extras (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `structured_outputs`) -> the contract's one output constraint:
`response_format` or `structured` (docs/protocol.md, "Structured outputs and logprobs").
"""

from __future__ import annotations

import json
from typing import Any

from inferline.producer.gateway.errors import bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINTS = ("response_format", *GUIDED, "structured_outputs")
# structured_outputs' keys that map onto the contract; vLLM's others are refused by name.
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def constraint(body: dict) -> tuple[str, str, Any] | None:
    """(contract field, OpenAI parameter, value) of the body's output constraint, or None; a 400
    naming the parameter when more than one is set or one has the wrong shape."""
    given = [p for p in CONSTRAINTS if body.get(p) is not None]
    # response_format `text` constrains nothing: it may come with a guided extra.
    asks = [p for p in given if body[p] != {"type": "text"}]
    if len(asks) > 1:
        raise bad_request(asks[1], f"{asks[1]}: only one of {', '.join(asks)} may be set")
    if not given:
        return None
    param = (asks or given)[0]
    value = body[param]
    if param == "response_format":
        return "response_format", param, value
    if param == "structured_outputs":
        return _structured_outputs(value)
    if param == "guided_json":
        return "response_format", param, _json_schema(param, _schema(param, value))
    kind = param.removeprefix("guided_")
    if not isinstance(value, list if kind == "choice" else str):
        what = "a list of strings" if kind == "choice" else "a string"
        raise bad_request(param, f"{param}: must be {what}")
    return "structured", param, {kind: value}


def _structured_outputs(value: Any) -> tuple[str, str, Any]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(param, f"{param}: must be an object")
    keys = [k for k, v in value.items() if v is not None]
    unknown = [k for k in keys if k not in _STRUCTURED_KEYS]
    if unknown:
        raise bad_request(param, f"{param}.{unknown[0]} is not supported")
    if len(keys) != 1:
        raise bad_request(param, f"{param}: exactly one of {', '.join(_STRUCTURED_KEYS)}")
    key = keys[0]
    if key == "json":
        return "response_format", param, _json_schema(param, _schema(f"{param}.json", value[key]))
    if key == "json_object":
        if value[key] is not True:
            raise bad_request(param, f"{param}.json_object: must be true")
        return "response_format", param, {"type": "json_object"}
    return "structured", param, {key: value[key]}


def _schema(where: str, value: Any) -> Any:
    # vLLM takes a schema as an object or as its JSON text.
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise bad_request(where.split(".")[0], f"{where}: not valid JSON") from None


def _json_schema(name: str, schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
