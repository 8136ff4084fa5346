#!/usr/bin/env python3
"""Writes docs/schemas/*.schema.json: the JSON Schema (draft-07) of each message of the wire
contract, one file per message, for producers and consumers that speak JSON (docs/protocol.md,
Encodings): a schema registry, Kafka Connect's JSON converters, ksqlDB, a validator in any language.

    python scripts/gen_json_schemas.py           # rewrite docs/schemas/
    python scripts/gen_json_schemas.py --check   # exit 1 if a checked-in file is stale

Each file is the message's payload schema from docs/asyncapi.yaml (scripts/gen_asyncapi.py, from
the pydantic models in contract/schema.py) with the parts it refers to under `definitions`, so it
stands alone. tests/unit/test_json_schemas.py checks them against the decoder.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("scripts") is None:  # run as a script, not imported by the suite
    sys.path.append(str(REPO))  # after site-packages: HF `kernels` stays first

from inferline.contract import schema  # noqa: E402
from scripts.gen_asyncapi import JSON_SCHEMA_FILES, REF, schemas  # noqa: E402
from scripts.generated import cli_files  # noqa: E402

OUT = REPO / "docs" / "schemas"
COMPONENTS = REF.format(model="")  # "#/components/schemas/"
DEFINITIONS = "#/definitions/"


def _refs(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(COMPONENTS) :]} if "$ref" in node else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*map(_refs, node))
    return set()


def _relinked(node):
    if isinstance(node, dict):
        return {
            k: v.replace(COMPONENTS, DEFINITIONS) if k == "$ref" else _relinked(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_relinked(v) for v in node]
    return node


def standalone(name: str, components: dict[str, dict]) -> dict:
    """components[name] as a JSON Schema of its own: what it refers to under `definitions`."""
    wanted, seen = _refs(components[name]), set()
    while wanted - seen:
        part = min(wanted - seen)
        seen.add(part)
        wanted |= _refs(components[part])
    out = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": f"urn:inferline:wire:v{schema.PROTOCOL_VERSION}:{name}",
        "title": f"inferline {name} (protocol v{schema.PROTOCOL_VERSION})",
        **_relinked(copy.deepcopy(components[name])),
    }
    if seen:
        out["definitions"] = {part: _relinked(components[part]) for part in sorted(seen)}
    return out


def render() -> dict[str, str]:
    components = schemas()
    return {
        file: json.dumps(standalone(name, components), indent=2, ensure_ascii=False) + "\n"
        for name, file in JSON_SCHEMA_FILES.items()
    }


def main() -> int:
    description = __doc__.splitlines()[0]
    return cli_files(OUT, render, "*.schema.json", description, "gen_json_schemas.py")


if __name__ == "__main__":
    sys.exit(main())
