"""Running a tests/*_cases.py script under the Triton interpreter, in a subprocess: TRITON_INTERPRET
must be set before triton is first imported, which pytest's process has done already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cases(script: str, *args: str, timeout: float = 1500) -> list[dict]:
    """The JSON lines `script` (under tests/) printed; fails the test if it did not exit 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
