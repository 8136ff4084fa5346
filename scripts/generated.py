"""The command line every generator of a checked-in file shares: write the file, or `--check` it.

python scripts/gen_x.py           # rewrite the file
python scripts/gen_x.py --check   # exit 1 (and say how to fix it) if the checked-in file is stale

`cli_files` does the same for a folder of generated files (one left there that is no longer
generated makes it stale too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def _check_flag(description: str) -> bool:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the checked-in file is stale"
    )
    return parser.parse_args().check


def stale_files(folder: Path, files: dict[str, str], pattern: str) -> list[str]:
    """Names in `folder` (matching `pattern`) that differ from `files`, are missing or extra."""
    there = {p.name for p in folder.glob(pattern)} if folder.is_dir() else set()
    wrong = [n for n, text in files.items() if n not in there or (folder / n).read_text() != text]
    return sorted(set(wrong) | (there - set(files)))


def cli_files(
    folder: Path, render: Callable[[], dict[str, str]], pattern: str, description: str, script: str
) -> int:
    """`cli` for a folder: `render` gives each file's name and text."""
    check, files = _check_flag(description), render()
    stale = stale_files(folder, files, pattern)
    if check:
        if stale:
            where = f"{folder.relative_to(REPO)}: {', '.join(stale)}"
            print(f"{where} stale: run python scripts/{script}", file=sys.stderr)
        return 1 if stale else 0
    folder.mkdir(parents=True, exist_ok=True)
    for name in stale:
        if name in files:
            (folder / name).write_text(files[name])
        else:
            (folder / name).unlink()
        print(f"wrote {(folder / name).relative_to(REPO)}")
    return 0


def cli(out: Path, render: Callable[[], str], description: str, script: str) -> int:
    check = _check_flag(description)
    text = render()
    if check:
        stale = not out.exists() or out.read_text() != text
        if stale:
            print(f"{out.relative_to(REPO)} is stale: run python scripts/{script}", file=sys.stderr)
        return 1 if stale else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out.relative_to(REPO)}")
    return 0
