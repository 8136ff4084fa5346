"""docs/ stays true to the code.

- docs/configuration.md is exactly what scripts/gen_config_docs.py writes from config/settings.py;
- every file path, module, class, `Class.member`, INFERLINE_* variable, `make` target, `inferline`
  subcommand, metric and relative link that README.md or a docs/*.md names exists (and a made-up
  one of each kind is caught);
- architecture.md's module map names every module; README's settings table shows the defaults;
- operations.md describes every metric the worker exports, with its type and labels.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from inferline.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings
from tests.unit.test_compose import is_settings_field
from tests.unit.test_dashboard import SUFFIXES, metric_families
from inferline.worker.service.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return load_script("gen_config_docs")


def settings_leaves(
    model: type[BaseModel] = Settings, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
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
    assert (DOCS / "configuration.md").read_text() == gen.render(), (
        "stale: run python scripts/gen_config_docs.py"
    )


def test_configuration_reference_has_every_setting():
    text = (DOCS / "configuration.md").read_text()
    leaves = settings_leaves()
    assert len(leaves) > 40
    missing = [env_name(p) for p in leaves if f"`{env_name(p)}`" not in text]
    assert not missing


def test_meanings_name_real_fields(gen):
    from inferline.config.settings import TenantLimit

    for key in gen.MEANINGS:
        head, *rest = key.split(".")
        parts = rest if head == "tenant" else [head, *rest]
        model = TenantLimit if head == "tenant" else Settings
        assert (
            is_settings_field(parts) if model is Settings else parts[0] in TenantLimit.model_fields
        ), key


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


# --------------------------------------------------------------------------- operations.md


def metric_table() -> dict[str, tuple[str, str]]:
    """name -> (type, labels) from the table in operations.md."""
    rows = re.findall(
        r"^\| `(inferline_\w+)` \| (\w+) \|([^|]*)\|", (DOCS / "operations.md").read_text(), re.M
    )
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


def test_operations_describes_every_metric():
    table = metric_table()
    metrics = Metrics()
    expected = {}
    for fam in metrics.registry.collect():
        exposed = fam.name + SUFFIXES[fam.type][0] if fam.type == "counter" else fam.name
        expected[exposed] = fam.type
    assert set(table) == set(expected), "the metric table and worker.metrics differ"
    labels_of = {
        getattr(m, "_name", None): getattr(m, "_labelnames", ()) for m in vars(metrics).values()
    }
    for name, (kind, labels) in table.items():
        assert kind == expected[name], name
        base = name.removesuffix("_total") if kind == "counter" else name
        assert {x.strip("` ") for x in labels.split(",") if x.strip()} == set(labels_of[base]), name
    assert set(metric_families())  # sanity: the registry is not empty


# --------------------------------------------------------------------------- names in the docs

# README.md and every docs/*.md: each file path, module, `Class.member`, class name, INFERLINE_*
# setting, `make` target, `inferline` subcommand and inferline_* metric a doc names must exist.
# test_the_name_check_catches_each_kind shows each check failing on a made-up name.

ALL_DOCS = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
SOURCE_DIRS = (
    "config",
    "contract",
    "worker",
    "producer",
    "kernels",
    "bench",
    "scripts",
    "tests",
    "deploy",
    "docs",
)
FILE_EXT = r"(?:py|md|yaml|yml|sh|c|h|toml|json|txt|in|properties|cfg|ini|gguf)"
# Files and names from outside the repository that the docs may name: Kafka's tools, what a
# benchmark writes (bench/results/ is its output folder), library and model names.
EXTERNAL_FILES = {"kafka-acls.sh", "kafka-console-consumer.sh", "bench.json"}
GENERATED_DIRS = ("bench/results/", ".cache/", ".venv/", ".kafka/")
EXTERNAL_NAMES = {
    "OpenAI",
    "SmolLM2",
    "SimpleQueue",
    "TimeoutExpired",
    "AnonHugePages",
    "KafkaConnectionError",
    "SecretStr",
    "StorageTool",
    "StandardAuthorizer",
    "AIOKafkaConsumer",
    "AIOKafkaProducer",
    "CUDAGraph",
}


def repo_paths() -> set[str]:
    """Every file and folder (folders with a trailing /) under the source folders, and root
    files."""
    out = {p.name for p in REPO.iterdir() if p.is_file()}
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if "__pycache__" not in path.parts and "results" not in path.parts:
                rel = path.relative_to(REPO).as_posix()
                out.add(rel + "/" if path.is_dir() else rel)
        out.add(top + "/")
    return out


def definitions() -> tuple[
    dict[str, set[str]], dict[str, list[str]], set[str], dict[str, set[str]]
]:
    """(class -> members, class -> base names, every top-level or class name, module -> top-level
    names) over the repository's Python. A member is a def, an annotated or plain assignment in
    the body, or a `self.x = ...` in a method."""
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    names: set[str] = set()
    modules: dict[str, set[str]] = {}
    for top in ("config", "contract", "worker", "producer", "kernels", "bench", "scripts", "tests"):
        for path in (REPO / top).rglob("*.py"):
            tree = ast.parse(path.read_text())
            module = (
                path.relative_to(REPO)
                .with_suffix("")
                .as_posix()
                .replace("/", ".")
                .removesuffix(".__init__")
            )
            modules[module] = {n for stmt in tree.body for n in bound_names(stmt)}
            names |= modules[module]
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    names.add(node.name)
                    body = members.setdefault(node.name, set())
                    bases.setdefault(node.name, []).extend(
                        ast.unparse(b).split(".")[-1] for b in node.bases
                    )
                    for stmt in node.body:
                        body |= bound_names(stmt)
                    for sub in ast.walk(node):
                        if (
                            isinstance(sub, ast.Attribute)
                            and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"
                        ):
                            body.add(sub.attr)
    return members, bases, names, modules


def bound_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    targets = (
        stmt.targets
        if isinstance(stmt, ast.Assign)
        else [stmt.target]
        if isinstance(stmt, ast.AnnAssign)
        else []
    )
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def has_member(cls: str, member: str, members, bases) -> bool:
    if member in members.get(cls, ()):
        return True
    # a member of a base class; a base from outside the repository (pydantic, Exception)
    # may hold any
    return any(
        b not in members or has_member(b, member, members, bases) for b in bases.get(cls, ())
    )


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def cli_commands() -> dict[str, set[str]]:
    """`inferline` subcommand -> its own subcommands (empty when it has none)."""
    import argparse

    from inferline.producer.cli import build_parser

    def subparsers(parser) -> dict[str, argparse.ArgumentParser]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(actions[0].choices) if actions else {}

    return {name: set(subparsers(p)) for name, p in subparsers(build_parser()).items()}


def console_scripts() -> set[str]:
    import tomllib

    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def known_metrics() -> set[str]:
    from inferline.producer.gateway.metrics import GatewayMetrics

    families = dict(metric_families())
    families |= {fam.name: fam.type for fam in GatewayMetrics().registry.collect()}
    return set(families) | {name + s for name, kind in families.items() for s in SUFFIXES[kind]}


def code_of(text: str) -> list[str]:
    """The fenced blocks and the inline code spans of a markdown text."""
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
    return fence.findall(text) + re.findall(r"`([^`\n]+)`", fence.sub("", text))


@dataclass
class Known:
    paths: set[str]
    members: dict[str, set[str]]
    bases: dict[str, list[str]]
    names: set[str]
    modules: dict[str, set[str]]
    make: set[str]
    cli: dict[str, set[str]]
    scripts: set[str]
    metrics: set[str]


@pytest.fixture(scope="module")
def known() -> Known:
    return Known(
        repo_paths(),
        *definitions(),
        make_targets(),
        cli_commands(),
        console_scripts(),
        known_metrics(),
    )


def unknown_names(text: str, folder: Path, known: Known, gen) -> dict[str, list[str]]:
    """kind -> the names of that kind in `text` (a doc in `folder`) that do not exist."""
    text = text.replace("\\_", "_")  # markdown's escaped underscores
    code = code_of(text)
    out = {
        "path": unknown_paths(text, folder, known),
        "variable": unknown_variables(text, gen),
        "make": sorted(
            {t for c in code for t in re.findall(r"\bmake ([a-z][\w-]*)", c)} - known.make
        ),
        "command": unknown_commands(code, known),
        "metric": sorted(set(re.findall(r"\binferline_[a-z0-9_]*[a-z0-9]", text)) - known.metrics),
        "code": unknown_code(text, code, known),
    }
    return {kind: names for kind, names in out.items() if names}


def unknown_paths(text: str, folder: Path, known: Known) -> list[str]:
    text = re.sub(r"\w+://\S+", "", text)
    found = re.findall(
        rf"(?<![\w./:~$<-])((?:[\w.-]+/)+[\w.-]*|[\w.-]+\.{FILE_EXT})(?![\w/])", text
    )
    tops = {p.split("/")[0] for p in known.paths}
    missing = set()
    for path in (p.rstrip(".") for p in found):
        if not (path.split("/")[0] in tops and "/" in path or re.search(rf"\.{FILE_EXT}$", path)):
            continue  # tokens/s, K/V, 4/16: not paths
        if path in EXTERNAL_FILES or path.startswith(GENERATED_DIRS):
            continue
        if (
            (folder / path).exists()
            or path in known.paths
            or any(p == path or p.endswith("/" + path) for p in known.paths)
        ):
            continue
        missing.add(path)
    return sorted(missing)


def unknown_variables(text: str, gen) -> list[str]:
    """Settings (INFERLINE_A__B), or, with one underscore, a variable a script, test or benchmark
    reads (INFERLINE_KAFKA_PORT of scripts/kafka.sh); `X_*` and `X__*` stand for a family."""
    settings = {env_name(p) for p in settings_leaves()}
    tools = set(gen.OTHER_VARIABLES) | {
        v
        for top in ("scripts", "tests", "bench")
        for path in (REPO / top).rglob("*")
        if path.suffix in (".py", ".sh")
        and path.name != Path(__file__).name  # not this file's made-up names
        for v in re.findall(r"INFERLINE_[A-Z0-9_]*[A-Z0-9]", path.read_text())
    }
    unknown = set()
    for name in re.findall(r"INFERLINE_[A-Z0-9_]*[A-Z0-9](?:__<NAME>__<FIELD>|__\*|_\*)?", text):
        base = re.sub(r"(__<NAME>__<FIELD>|_?_\*)$", "", name)
        parts = base[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
        if (
            name.endswith("__<NAME>__<FIELD>")
            or name.endswith("__*")
            and is_settings_field(parts, section=True)
        ):
            continue
        if name.endswith("_*"):
            if not any(v.startswith(base + "_") for v in settings | tools):
                unknown.add(name)
        elif not (is_settings_field(parts) if "__" in name else name in tools):
            unknown.add(name)
    return sorted(unknown)


def unknown_commands(code: list[str], known: Known) -> list[str]:
    """`inferline SUB [SUBSUB]` (also `inferline a/b/c`) and `inferline-*` scripts, where a command
    line or a code span starts with them."""
    unknown = set()
    lines = [re.sub(r"^\$ ", "", line.strip()) for c in code for line in c.splitlines()]
    for line in lines:
        m = re.match(r"inferline(-[\w-]+)?(?: +([a-z][\w/-]*))?(?: +([a-z][\w-]*))?", line)
        if not m:
            continue
        if m.group(1):
            script = "inferline" + m.group(1)
            if (
                script not in known.scripts
                and f'"{script}"' not in (REPO / "config/settings.py").read_text()
            ):
                unknown.add(script)  # a script, or a setting's value such as the group id
            continue
        for sub in (m.group(2) or "").split("/"):
            if sub and sub not in known.cli:
                unknown.add(f"inferline {sub}")
        if (
            m.group(2) in known.cli
            and known.cli[m.group(2)]
            and m.group(3)
            and m.group(3) not in known.cli[m.group(2)]
        ):
            unknown.add(f"inferline {m.group(2)} {m.group(3)}")
    return sorted(unknown)


def unknown_code(text: str, code: list[str], known: Known) -> list[str]:
    """Dotted module paths (bench.engine, producer.cli.main) anywhere; class names and
    `Class.member` inside code."""
    unknown = set()
    packages = "|".join(
        ("config", "contract", "worker", "producer", "kernels", "bench", "scripts", "tests")
    )
    for dotted in re.findall(rf"(?<![\w./-])((?:{packages})(?:\.\w+)+)", text):
        if not re.search(rf"\.{FILE_EXT}$", dotted) and not module_name_exists(dotted, known):
            unknown.add(dotted)
    for snippet in code:
        for cls, member in re.findall(r"\b([A-Z]\w*[a-z]\w*)\.([a-z_]\w*)", snippet):
            if re.fullmatch(FILE_EXT, member) or cls in EXTERNAL_NAMES:
                continue
            if cls not in known.members or not has_member(cls, member, known.members, known.bases):
                unknown.add(f"{cls}.{member}")
        for name in re.findall(r"\b(?:[A-Z][a-z0-9]+[A-Z]|[A-Z]{2,}[a-z])\w*", snippet):
            if (
                name not in known.names
                and name not in EXTERNAL_NAMES
                and not hasattr(builtins, name)
            ):
                unknown.add(name)
    return sorted(unknown)


def module_name_exists(dotted: str, known: Known) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in known.modules or f"{module.replace('.', '/')}/" in known.paths:
            rest = parts[i:]
            if not rest:
                return True
            if rest[0] not in known.modules.get(module, ()):
                return False
            return len(rest) == 1 or (
                len(rest) == 2
                and rest[0] in known.members
                and has_member(rest[0], rest[1], known.members, known.bases)
            )
    return False


# Known false names in a page another change is rewriting: each must still be there (delete the
# entry with the fix), and nothing else may be.
PENDING: dict = {}


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: p.name)
def test_every_name_in_the_docs_exists(doc, known, gen):
    unknown = unknown_names(doc.read_text(), doc.parent, known, gen)
    assert unknown == PENDING.get(doc.name, {}), (
        f"{doc.name} names what does not exist (or fix PENDING)"
    )


def test_the_name_check_catches_each_kind(known, gen):
    real = """See `worker/engine/scheduler.py`, [the design](design.md), kernels/backends.py,
`INFERLINE_CACHE__BLOCK_SIZE`, `INFERLINE_KAFKA_PORT`, `make test`,
`inferline topics create --partitions 8`, `inferline_preemptions_total`, `Scheduler.schedule`,
`python -m bench.engine`, `LLMEngine`, 100 tokens/s, K/V.
```
$ inferline submit "hi"
```"""
    assert unknown_names(real, DOCS, known, gen) == {}
    made_up = """See `worker/engine/paged_attention.py`, FIELD-NOTES.md,
`INFERLINE_CACHE__BLOCKSIZE`, INFERLINE_KAFKA_PROT, `make benchmark`, `inferline stream`,
`inferline topics drop`, `inferline_preemption_total`, `Scheduler.update()`,
`python -m bench.engines`, a `WaitingPool`.
```
$ inferline-stream
```"""
    assert unknown_names(made_up, DOCS, known, gen) == {
        "path": ["FIELD-NOTES.md", "worker/engine/paged_attention.py"],
        "variable": ["INFERLINE_CACHE__BLOCKSIZE", "INFERLINE_KAFKA_PROT"],
        "make": ["benchmark"],
        "command": ["inferline stream", "inferline topics drop", "inferline-stream"],
        "metric": ["inferline_preemption_total"],
        "code": ["Scheduler.update", "WaitingPool", "bench.engines"],
    }


def test_the_readme_settings_table_shows_the_defaults(monkeypatch):
    for var in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(var)  # the defaults, not this machine's settings
    rows = re.findall(
        r"^\| `INFERLINE_(\w+)` \| `([^`|]*)` \|", (REPO / "README.md").read_text(), re.M
    )
    assert len(rows) > 10
    for name, shown in rows:
        value = Settings()
        for part in name.lower().split(ENV_DELIMITER):
            value = getattr(value, part)
        assert str(value) == shown, f"README: INFERLINE_{name} defaults to {value!r}, not {shown}"


def test_the_module_map_covers_every_module():
    """Every module of the five packages is in architecture.md's module map, by path or folder."""
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("## Modules") : text.index("\n## ", text.index("## Modules") + 1)]
    named = set(re.findall(r"`((?:[\w.]+/)+[\w.]*)`", table))
    missing = []
    for top in ("config", "contract", "worker", "producer", "kernels"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            folders = {rel.rsplit("/", k)[0] + "/" for k in range(1, rel.count("/") + 1)}
            if path.name == "__init__.py" and path.stat().st_size == 0:
                continue
            if rel not in named and not folders & (named - {f"{top}/"}):
                missing.append(rel)
    assert not missing, f"architecture.md's module map lacks {missing}"


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_log_events_named_in_the_docs_exist():
    source = "\n".join(p.read_text() for p in (REPO / "worker").rglob("*.py"))
    for event in ("request.reply_undeliverable", "model ready"):
        assert f'"{event}"' in source, event
