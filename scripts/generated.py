"""The command line every generator of a checked-in file shares: write the file, or `--check` it.

python scripts/gen_x.py           # rewrite the file
python scripts/gen_x.py --check   # exit 1 (and say how to fix it) if the checked-in file is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def cli(out: Path, render: Callable[[], str], description: str, script: str) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the checked-in file is stale"
    )
    args = parser.parse_args()
    text = render()
    if args.check:
        stale = not out.exists() or out.read_text() != text
        if stale:
            print(f"{out.relative_to(REPO)} is stale: run python scripts/{script}", file=sys.stderr)
        return 1 if stale else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out.relative_to(REPO)}")
    return 0
