"""prometheus and promtool for the tests: from the PATH, or where deploy/prometheus/tools.sh
(`make prometheus-tools`, run by `make test`) caches Debian's package. A test that needs one
skips, saying why, when neither has it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "tools.sh"


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`; skips the calling test when there is none."""
    done = subprocess.run([str(TOOLS), "--paths"], capture_output=True, text=True, check=True)
    for path in done.stdout.split():
        if Path(path).name == name and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found is None:
        pytest.skip(
            f"{name} is missing: deploy/prometheus/tools.sh (make prometheus-tools) "
            "could not install it"
        )
    return found
