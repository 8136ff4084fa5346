"""Every line of Python in the repository fits in 100 columns (ruff, configured in pyproject.toml;
`ruff format` keeps code there, comments and strings are wrapped by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_line_fits_in_100_columns():
    # ruff from the dev extra (`make install`), run as a module of this interpreter
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
