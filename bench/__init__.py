"""Benchmarks, run from the repository root as `python -m bench.NAME`.

The checkout stays off sys.path: `python -m` puts it first, where its kernels/ would shadow Hugging
Face's `kernels` (transformers looks for it). `bench`, `tests` and `scripts` are found by name
instead, and a bare copy of the tree (the GPU image runs one, nothing installed) gets `inferline.*`
mapped onto this checkout's folders. tests/conftest.py runs this file too."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `tests`, `bench` and `scripts` in this checkout, and nothing else there."""

    NAMES = ("tests", "bench", "scripts")

    def find_spec(self, name, path=None, target=None):
        if path is None and name in self.NAMES:
            return importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])
        return None


sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
if not any(type(f).__name__ == "CheckoutFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, CheckoutFinder())
if importlib.util.find_spec("inferline") is None:
    _inferline = types.ModuleType("inferline")
    _inferline.__path__ = [str(ROOT)]  # inferline.kernels is kernels/, and so on
    sys.modules["inferline"] = _inferline
