"""The package boundaries the design draws (docs/architecture.md): the wire contract is the one
package both sides share, the worker imports nothing from the client side, the contract and the
client import no torch, and a result becomes final only in worker/delivery/."""

from __future__ import annotations

import ast
import re
import importlib
import importlib.util
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.conftest import PACKAGE_FOLDERS

REPO = Path(__file__).resolve().parents[2]


def imported_modules(top: str) -> dict[str, set[str]]:
    """file -> the modules it imports (absolute names), for every .py under `top`."""
    out = {}
    for path in (REPO / top).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[path.relative_to(REPO).as_posix()] = names
    return out


def offenders(top: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{f}: {m}"
        for f, mods in imported_modules(top).items()
        for m in mods
        if m.removeprefix("inferline.").split(".")[0] in forbidden
    )


def test_the_worker_imports_nothing_from_the_client_side():
    assert offenders("worker", ("producer",)) == []


@pytest.mark.parametrize("top", ["contract", "producer"])
def test_the_contract_and_the_client_need_no_inference_stack(top):
    assert offenders(top, ("torch", "triton", "transformers", "worker", "kernels")) == []


def test_the_contract_needs_no_kafka_client():
    assert offenders("contract", ("aiokafka", "confluent_kafka")) == []


def test_only_the_delivery_path_commits_or_acknowledges():
    """Transactions and share acknowledgements are driven from worker/delivery/ (and the share
    intake that owns the share consumers): nothing else calls into them."""
    calls = ("commit_transaction", "send_offsets_to_transaction", "Final(")
    found = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "worker").rglob("*.py")
        if any(c in p.read_text() for c in calls)
    ]
    assert all(f.startswith("worker/delivery/") for f in found), found


def tracked_python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [REPO / f for f in out.stdout.split()]


def test_no_file_imports_a_package_folder_by_its_bare_name():
    """worker/, producer/, contract/, kernels/ and config/ install as inferline.<folder>: `import
    worker` would find a user's own worker.py, or load a second copy of ours."""
    bare = []
    for path in tracked_python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            bare += [
                f"{path.relative_to(REPO)}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] in PACKAGE_FOLDERS
            ]
    assert bare == []


@pytest.mark.parametrize("name", PACKAGE_FOLDERS)
def test_a_bare_name_never_finds_the_checkouts_folder(name):
    """The suite imports as an installed wheel would: `import worker` fails, and `kernels` is
    Hugging Face's distribution (which transformers imports) or nothing, never our folder."""
    spec = importlib.util.find_spec(name)
    assert spec is None or Path(spec.origin or "").resolve() != REPO / name / "__init__.py"


def package_folders_on_disk() -> set[str]:
    return {
        "inferline." + init.parent.relative_to(REPO).as_posix().replace("/", ".")
        for top in PACKAGE_FOLDERS
        for init in (REPO / top).rglob("__init__.py")
    }


def test_pyproject_lists_exactly_the_package_folders_on_disk():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == package_folders_on_disk()
    assert setuptools["package-dir"] == {f"inferline.{n}": n for n in PACKAGE_FOLDERS}


def test_the_installed_inferline_is_this_checkout():
    import inferline.worker

    assert Path(inferline.worker.__file__).resolve() == REPO / "worker" / "__init__.py"


# The GPU image (shared/FIELD-NOTES.md) has torch, triton, transformers, numpy, msgpack,
# safetensors and tokenizers, but none of these.
NOT_ON_THE_GPU_IMAGE = ("structlog", "pydantic", "pydantic_settings", "xgrammar")
KERNEL_MODULES = [
    "inferline.kernels",
    "inferline.kernels.attention",
    "inferline.kernels.backends",
    "inferline.kernels.fused",
    "inferline.kernels.cpu.build",
    "inferline.kernels.cpu.gemm",
    *(
        f"inferline.kernels.triton.{name}"
        for name in ("decode", "prefill", "store", "norm", "activation", "rotary", "variants")
    ),
]
ENGINE_MODULES = [
    f"inferline.worker.engine.{name}"
    for name in ("engine", "model_runner", "scheduler", "sampler", "spec_decode")
]


def test_the_kernels_and_the_engine_import_without_what_they_do_not_use(tmp_path):
    """The kernels need only torch and triton; xgrammar waits for the first constrained request
    (not the engine's imports nor its token bitmask, made at start-up)."""
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        blocked = set({NOT_ON_THE_GPU_IMAGE!r})

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in blocked:
                    raise ImportError(f"{{name}} is blocked")

        sys.meta_path.insert(0, Blocker())
        for name in {KERNEL_MODULES!r}:
            importlib.import_module(name)
        blocked = {{"xgrammar"}}
        for name in {ENGINE_MODULES!r}:
            importlib.import_module(name)
        import torch
        from inferline.worker.engine.structured_output import TokenBitmask

        TokenBitmask(300, torch.device("cpu"))
        assert "xgrammar" not in sys.modules
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]


def top_level_imports(top: str) -> dict[str, set[str]]:
    """file -> the third-party top-level packages its module body imports (not lazy ones)."""
    out = {}
    for path in (REPO / top).rglob("*.py"):
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        out[path.relative_to(REPO).as_posix()] = (
            names
            - set(sys.stdlib_module_names)
            - {
                "inferline",
                "__future__",
            }
        )
    return out


def declared(*extras: str) -> set[str]:
    """Distribution names pyproject declares: the core dependencies plus these extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [
        r for e in extras for r in project["optional-dependencies"][e]
    ]
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


# FastAPI's own types are Starlette's and AnyIO's: a FastAPI install always brings them.
FASTAPI_S_OWN = {"starlette": ["fastapi"], "anyio": ["fastapi"]}


@pytest.mark.parametrize("top", ["worker", "kernels", "config", "contract", "producer"])
def test_what_a_package_imports_is_declared_by_its_install(top):
    """`pip install 'inferline[worker]'` (the Docker image's install) must bring every package the
    worker imports: before, the group intake needed confluent-kafka, which only the `share` and
    `dev` extras named. The client side needs the core dependencies alone."""
    from importlib.metadata import packages_distributions

    providers = {**packages_distributions(), **FASTAPI_S_OWN}
    wanted = declared("worker") if top in ("worker", "kernels") else declared()
    missing = sorted(
        f"{f}: {name}"
        for f, names in top_level_imports(top).items()
        for name in names
        if not {d.lower().replace("_", "-") for d in providers.get(name, [name])} & wanted
    )
    assert missing == []
