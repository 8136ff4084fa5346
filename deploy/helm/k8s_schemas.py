"""The Kubernetes JSON schemas of one version, from the kubernetes-validate wheel (PyPI), for
kubeconform.

    python deploy/helm/k8s_schemas.py WHEEL v1.33.0-local-strict OUT_DIR

The wheel vendors, per Kubernetes version, one schema per kind (`statefulset-apps-v1.json`: the
file names kubeconform's `{{.ResourceKind}}{{.KindSuffix}}.json` asks for) whose references point
into a shared `_definitions.json` at its own registry root. kubeconform compiles one file at a
time and does not follow those, so each file is written self-contained: the definitions it
reaches, under its own `$defs`. The `-strict` variant refuses unknown keys.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

REF = re.compile(r'"\$ref": "(?:/api/_definitions\.json)?#/\$defs/([^"]+)"')


def local_refs(text: str) -> str:
    return REF.sub(lambda m: f'"$ref": "#/$defs/{m.group(1)}"', text)


def reached(text: str, needs: dict[str, set[str]]) -> set[str]:
    todo, seen = list(REF.findall(text)), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += needs[name]
    return seen


def main(wheel: str, folder: str, out: Path) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{folder}/"
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".json")]
        assert names, f"{folder} is not in {wheel}"
        defs = json.loads(z.read(prefix + "_definitions.json"))["$defs"]
        texts = {n[len(prefix) :]: z.read(n).decode() for n in names}
    needs = {name: set(REF.findall(json.dumps(d))) for name, d in defs.items()}
    out.mkdir(parents=True, exist_ok=True)
    for file, text in texts.items():
        if file in ("_definitions.json", "all.json"):
            continue
        schema = json.loads(local_refs(text))
        schema["$defs"] = {
            n: json.loads(local_refs(json.dumps(defs[n]))) for n in sorted(reached(text, needs))
        }
        (out / file).write_text(json.dumps(schema, separators=(",", ":")))
    print(f"k8s tools: {len(texts) - 2} Kubernetes schemas in {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
