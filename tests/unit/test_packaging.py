"""The wheel as a user installs it: one top-level package, `inferline`, that imports beside Hugging
Face's `kernels`, the newest transformers and an application's own config.py and worker.py."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import PACKAGE_FOLDERS

REPO = Path(__file__).resolve().parents[2]


def source_copy(dst: Path) -> Path:
    """What an sdist holds (pyproject, README, the packages): pip builds there, not in the
    checkout."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dst / name)
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for folder in folders.values():
        shutil.copytree(
            REPO / folder, dst / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    return dst


def run(*argv, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp / "dist"),
        str(source_copy(tmp / "src")),
    )
    (built,) = (tmp / "dist").glob("inferline-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package_with_the_folders_on_disk(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "inferline",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    on_disk = {
        "inferline." + i.parent.relative_to(REPO).as_posix().replace("/", ".")
        for top in PACKAGE_FOLDERS
        for i in (REPO / top).rglob("__init__.py")
    }
    assert packages == on_disk
    assert any(n.startswith("inferline/kernels/cpu/csrc/") and n.endswith(".c") for n in names)


IMPORTS = """
import config, worker  # the application's own modules, first on sys.path
assert config.MINE == worker.MINE == "app"
import kernels, transformers
from transformers import AutoConfig
import inferline.producer.client, inferline.worker.app, inferline.kernels.backends
site = os.path.realpath(sys.argv[1])
assert os.path.realpath(inferline.worker.app.__file__).startswith(site), (
    inferline.worker.app.__file__
)
assert hasattr(kernels, "get_kernel"), kernels.__file__  # Hugging Face's distribution, not ours
print("ok", transformers.__version__)
"""


def test_the_wheel_imports_beside_hf_kernels_transformers_and_an_apps_own_modules(wheel, tmp_path):
    """A fresh venv with the wheel; the suite's venv (torch, transformers, Hugging Face's `kernels`)
    comes after it through a .pth line, so nothing of the checkout is on the path."""
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        str(wheel),
    )
    fresh_site = run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    fresh_site = Path(fresh_site.stdout.strip())
    (fresh_site / "suite_venv.pth").write_text(site.getsitepackages()[0] + "\n")
    app = tmp_path / "app"
    app.mkdir()
    for name in ("config", "worker"):
        (app / f"{name}.py").write_text('MINE = "app"\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run(str(python), "-c", "import os, sys\n" + IMPORTS, str(fresh_site), cwd=app, env=env)
    assert done.stdout.startswith("ok"), done.stdout
    # The console script too, from the application's folder: a bad setting exits 2 with one line.
    env["INFERLINE_SCHEDULER__MAX_NUM_SEQS"] = "zero"
    bad = subprocess.run(
        [str(venv / "bin" / "inferline-worker")],
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "INFERLINE_SCHEDULER__MAX_NUM_SEQS" in bad.stderr, bad.stderr
