"""Every line of Python in the repository fits in 100 columns (ruff, configured in pyproject.toml;
`ruff format` keeps code there, comments and strings are wrapped by hand)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_line_fits_in_100_columns():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: `make install` installs it with the dev extra"
    done = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
