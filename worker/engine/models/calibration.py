"""INFERLINE_MODEL__CPU_LINEAR=auto: the linear backends timed on this model at load, the fastest
kept and cached per machine and shapes. design: docs/architecture.md#the-model
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from inferline.config.paths import cache_dir
from inferline.kernels.cpu import build
from inferline.worker.engine.models.linear import Linear, linear, pack_weight

log = structlog.get_logger(__name__)

CACHE_NAME = "linear_calibration.json"
ROWS = (16, 128)
SAMPLE_LAYERS = 4
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 12, 2.0


@dataclass(frozen=True)
class Calibration:
    """The backend chosen, each candidate's estimated seconds per row of a step's linears, whether
    it came from the cache file, and its key."""

    backend: str
    seconds: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    key: dict = field(default_factory=dict)


def choose_linear_backend(
    model,
    candidates: tuple[str, ...],
    codes: bool,
    timer: Callable[[], float] = time.perf_counter,
    path: Path | None = None,
) -> Calibration:
    """The fastest of `candidates` for `model`'s linear layers on this machine (cached)."""
    assert candidates, "no candidate backend"
    if len(candidates) == 1:
        return Calibration(candidates[0])
    key = calibration_key(model, candidates, codes)
    path = path or cache_dir() / CACHE_NAME
    entry = read_cache(path).get(key_id(key))
    if entry and entry.get("backend") in candidates:
        return Calibration(entry["backend"], entry.get("seconds", {}), True, key)
    seconds = measure(model, candidates, codes, timer)
    assert seconds, f"none of {candidates} could pack this model's weights"
    backend = min(seconds, key=lambda c: seconds[c])  # ties: the first candidate
    write_cache(path, key_id(key), {"backend": backend, "seconds": seconds, **key})
    log.info(
        "linear backend calibrated",
        backend=backend,
        cpu=key["cpu"],
        threads=key["threads"],
        us_per_row={c: round(s * 1e6, 2) for c, s in seconds.items()},
        cache=str(path),
    )
    return Calibration(backend, seconds, False, key)


def calibration_key(model, candidates: tuple[str, ...], codes: bool) -> dict:
    shapes = sorted(
        {tuple(w.shape) for w in _layer_weights(model)} | {tuple(model.lm_head_weight().shape)}
    )
    return {
        "cpu": cpu_model(),
        "cpu_flags": hashlib.sha256(build.cpu_flags().encode()).hexdigest()[:12],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "candidates": list(candidates),
        "codes": codes,
        "num_layers": len(model.layers),
        "shapes": [list(s) for s in shapes],
        "gemm_c": _source_hash(build.CSRC / "gemm.c"),
        "sample": [SAMPLE_LAYERS, list(ROWS)],
    }


def _source_hash(path: Path) -> str:
    # A new GEMM is timed again, not trusted to the old choice.
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cpu_model() -> str:
    """/proc/cpuinfo's model name (the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- timing -------------------------------------------------------------------------------------


def _layer_weights(model, num_layers: int | None = None) -> list[torch.Tensor]:
    layers = list(model.layers)[:num_layers]
    return [m.weight for layer in layers for m in layer.modules() if isinstance(m, Linear)]


@torch.inference_mode()
def measure(
    model, candidates: tuple[str, ...], codes: bool, timer: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Per candidate: the median estimated seconds per row of one step's linears, over ROWS."""
    sample = min(SAMPLE_LAYERS, len(model.layers))
    scale = len(model.layers) / sample
    weights = _layer_weights(model, sample)
    head = model.lm_head_weight()
    packed = {
        c: ([(w, pack_weight(w, c, codes)) for w in weights], [(head, pack_weight(head, c, codes))])
        for c in candidates
    }
    packed = {c: ops for c, ops in packed.items() if all(p is not None for _, p in ops[0] + ops[1])}
    candidates = tuple(c for c in candidates if c in packed)  # one that cannot pack here is out
    gen = torch.Generator().manual_seed(0)
    inputs = {
        rows: {
            n: torch.randn(rows, n, generator=gen) for n in {w.shape[1] for w in weights + [head]}
        }
        for rows in ROWS
    }
    estimates: dict[str, list[float]] = {c: [] for c in candidates}
    start = timer()
    for r in range(MAX_ROUNDS + 1):
        for c in candidates if r % 2 == 0 else candidates[::-1]:
            layers_s, head_s = (
                sum(_pass_seconds(ops, inputs[rows], timer) / rows for rows in ROWS)
                for ops in packed[c]
            )
            if r:  # round 0 warms up
                estimates[c].append(scale * layers_s + head_s)
        if r >= MIN_ROUNDS and timer() - start > BUDGET_S:
            break
    return {c: statistics.median(ts) for c, ts in estimates.items()}


def _pass_seconds(ops, x_by_in: dict[int, torch.Tensor], timer: Callable[[], float]) -> float:
    t0 = timer()
    for w, p in ops:
        linear(x_by_in[w.shape[1]], w, packed=p)
    return timer() - t0


# ---- the cache file -----------------------------------------------------------------------------


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, entry_id: str, entry: dict) -> None:
    """Adds one entry, written to a temporary name and renamed: no start reads half a file."""
    data = read_cache(path)
    data[entry_id] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # read-only cache: measured at every start
        log.warning("linear calibration not cached", path=str(path), error=str(exc))
