"""The package boundaries the design draws (docs/architecture.md): the wire contract is the one
package both sides share, the worker imports nothing from the client side, the contract and the
client import no torch, and a result becomes final only in worker/delivery/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    return sorted(f"{f}: {m}" for f, mods in imported_modules(top).items() for m in mods
                  if m.split(".")[0] in forbidden or m in forbidden)


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
    found = [p.relative_to(REPO).as_posix() for p in (REPO / "worker").rglob("*.py")
             if any(c in p.read_text() for c in calls)]
    assert all(f.startswith("worker/delivery/") for f in found), found


@pytest.mark.parametrize("top", ["worker", "producer", "contract", "kernels", "config"])
def test_no_installed_distribution_claims_our_top_level_packages(top):
    """Two distributions with one top-level name overwrite each other in site-packages, and an
    import finds whichever comes first on sys.path (transformers 5.25 required Hugging Face's
    `kernels`, and its `import kernels` found ours: pyproject.toml pins it below)."""
    import importlib.metadata

    claimants = set(importlib.metadata.packages_distributions().get(top, [])) - {"inferline"}
    assert claimants == set(), f"{sorted(claimants)} install a top-level `{top}` package as inferline does"
