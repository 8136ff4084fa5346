"""docs/ stays true to the code.

- docs/configuration.md is exactly what scripts/gen_config_docs.py writes from config/settings.py;
- every INFERLINE_* variable, metric name, file path, `Class.member` and relative link that
  architecture.md, operations.md and configuration.md mention exists;
- operations.md describes every metric the worker exports, with its type and labels.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from config.settings import ENV_DELIMITER, ENV_PREFIX, Settings
from tests.test_compose import is_settings_field
from tests.test_dashboard import SUFFIXES, exported_series_names, metric_families
from worker.metrics import Metrics

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
OWN_DOCS = [DOCS / "architecture.md", DOCS / "operations.md", DOCS / "configuration.md", DOCS / "security.md"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return load_script("gen_config_docs")


def settings_leaves(model: type[BaseModel] = Settings, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += settings_leaves(ann, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def env_name(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + ENV_DELIMITER.join(p.upper() for p in path)


# --------------------------------------------------------------------------- configuration.md

def test_configuration_reference_is_up_to_date(gen):
    assert (DOCS / "configuration.md").read_text() == gen.render(), \
        "stale: run python scripts/gen_config_docs.py"


def test_configuration_reference_has_every_setting():
    text = (DOCS / "configuration.md").read_text()
    leaves = settings_leaves()
    assert len(leaves) > 40
    missing = [env_name(p) for p in leaves if f"`{env_name(p)}`" not in text]
    assert not missing


def test_meanings_name_real_fields(gen):
    from config.settings import TenantLimit

    for key in gen.MEANINGS:
        head, *rest = key.split(".")
        parts = rest if head == "tenant" else [head, *rest]
        model = TenantLimit if head == "tenant" else Settings
        assert is_settings_field(parts) if model is Settings else parts[0] in TenantLimit.model_fields, key


def test_documented_rules_hold():
    with pytest.raises(ValidationError):
        Settings(cache={"block_size": 24})  # "a power of two"
    assert Settings(cache={"block_size": 32}).cache.block_size == 32


def test_the_lower_casing_of_tenant_names_is_real(monkeypatch):
    monkeypatch.setenv("INFERLINE_LIMITS__TENANTS__ACME__REQUESTS_PER_S", "5")
    assert list(Settings().limits.tenants) == ["acme"]
    monkeypatch.setenv("INFERLINE_LIMITS__TENANTS", '{"Acme": {"requests_per_s": 5}}')
    monkeypatch.delenv("INFERLINE_LIMITS__TENANTS__ACME__REQUESTS_PER_S")
    assert list(Settings().limits.tenants) == ["Acme"]


# --------------------------------------------------------------------------- names in the docs

def is_model_path(parts: list[str]) -> bool:
    """A section or dict of the tree (for names like INFERLINE_LIMITS__DEFAULT_TENANT__*)."""
    model: type[BaseModel] = Settings
    for part in parts:
        field = model.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        if typing.get_origin(ann) is dict:
            return True
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return False
        model = ann
    return True


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_every_variable_mentioned_is_real(doc, gen):
    unknown = []
    for name in set(re.findall(r"INFERLINE_[A-Z0-9_]*[A-Z0-9](?:__<NAME>__<FIELD>|__\*|_\*)?", doc.read_text())):
        if name in gen.OTHER_VARIABLES or name == "INFERLINE_KAFKA_*":  # scripts/kafka.sh's own
            continue
        base = re.sub(r"(__<NAME>__<FIELD>|__\*)$", "", name)
        parts = base[len(ENV_PREFIX):].lower().split(ENV_DELIMITER)
        ok = is_model_path(parts) if base != name else is_settings_field(parts)
        if not ok:
            unknown.append(name)
    assert not unknown, f"{doc.name} mentions unknown variables: {sorted(unknown)}"


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_every_metric_mentioned_is_exported(doc):
    names = set(re.findall(r"\binferline_[a-z0-9_]+", doc.read_text()))
    known = exported_series_names() | set(metric_families())  # a histogram by its family name too
    assert not names - known, f"{doc.name}: {sorted(names - known)}"


def metric_table() -> dict[str, tuple[str, str]]:
    """name -> (type, labels) from the table in operations.md."""
    rows = re.findall(r"^\| `(inferline_\w+)` \| (\w+) \|([^|]*)\|", (DOCS / "operations.md").read_text(), re.M)
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


def test_operations_describes_every_metric():
    table = metric_table()
    metrics = Metrics()
    expected = {}
    for fam in metrics.registry.collect():
        exposed = fam.name + SUFFIXES[fam.type][0] if fam.type == "counter" else fam.name
        expected[exposed] = fam.type
    assert set(table) == set(expected), "the metric table and worker.metrics differ"
    labels_of = {getattr(m, "_name", None): getattr(m, "_labelnames", ()) for m in vars(metrics).values()}
    for name, (kind, labels) in table.items():
        assert kind == expected[name], name
        base = name.removesuffix("_total") if kind == "counter" else name
        assert {x.strip("` ") for x in labels.split(",") if x.strip()} == set(labels_of[base]), name
    assert set(metric_families())  # sanity: the registry is not empty


# --------------------------------------------------------------------------- paths, code, links

def classes() -> dict[str, set[str]]:
    """Class name -> names defined in its body, over the packages."""
    out: dict[str, set[str]] = {}
    for folder in ("config", "worker", "producer", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    body = out.setdefault(node.name, set())
                    for stmt in node.body:
                        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            body.add(stmt.name)
                        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                            body.add(stmt.target.id)
    return out


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_paths_and_code_names_exist(doc):
    text = doc.read_text()
    code = re.findall(r"`([^`\n]+)`", text)
    paths = [c for c in code if re.fullmatch(r"(?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:py|yaml|yml|json|md|sh)", c)]
    missing = [p for p in paths if not (REPO / p).exists() and not (DOCS / p).exists()]
    assert not missing, f"{doc.name}: no such file {missing}"
    known = classes()
    for ref in code:
        m = re.fullmatch(r"([A-Z]\w+)\.(\w+)(?:\(\))?", ref)
        if m and m.group(1) in known:
            assert m.group(2) in known[m.group(1)], f"{doc.name}: {ref}"
    for func in re.findall(r"`(config\.settings\.\w+)\(\)`", text):
        import config.settings as cs

        assert hasattr(cs, func.rsplit(".", 1)[1]), func


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_log_events_named_in_the_docs_exist():
    source = "\n".join(p.read_text() for p in (REPO / "worker").rglob("*.py"))
    for event in ("request.reply_undeliverable", "model ready"):
        assert f'"{event}"' in source, event
