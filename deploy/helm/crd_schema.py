"""CustomResourceDefinition YAML -> kubeconform's JSON schemas, one file per version.

    python deploy/helm/crd_schema.py OUT_DIR CRD.yaml [CRD.yaml ...]

writes OUT_DIR/<group>/<kind>_<version>.json (lower-case kind), the layout of kubeconform's
`-schema-location 'OUT_DIR/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json'`. Like
kubeconform's own openapi2jsonschema.py: an object with `properties` and no
`additionalProperties` refuses unknown keys (a typo in a ScaledObject fails, as the API server
would prune or reject it), `x-kubernetes-int-or-string` takes either type, `nullable` adds null.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def strict(schema: dict) -> dict:
    """A copy of an openAPIV3Schema node as a closed JSON schema."""
    out = {k: strict_value(k, v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def strict_value(key: str, value):
    if key in ("properties", "patternProperties"):
        return {name: strict(sub) for name, sub in value.items()}
    if key in ("items", "additionalProperties", "not") and isinstance(value, dict):
        return strict(value)
    if key in ("allOf", "anyOf", "oneOf"):
        return [strict(sub) for sub in value]
    return value


def convert(crd: dict, out_dir: Path) -> list[Path]:
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"].lower()
    written = []
    for version in spec["versions"]:
        schema = strict(version["schema"]["openAPIV3Schema"])
        path = out_dir / group / f"{kind}_{version['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(schema, indent=1, sort_keys=True))
        written.append(path)
    return written


def main(argv: list[str]) -> None:
    out_dir, files = Path(argv[0]), argv[1:]
    for name in files:
        for crd in yaml.safe_load_all(Path(name).read_text()):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                for path in convert(crd, out_dir):
                    print(f"crd_schema: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
