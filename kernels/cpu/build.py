"""Builds kernels/cpu/csrc/ into one cached library with the system C compiler on first use,
called through ctypes. design: docs/architecture.md#kernels
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from inferline.config.paths import cache_dir

# The stdlib logger (config/logging.py renders it like structlog's): the kernels import only torch
# and triton, so the GPU image runs them without structlog or the settings' pydantic.
log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_decode_attention.c",
    CSRC / "attention_any_head_dim.c",
    CSRC / "fused_ops.c",
    CSRC / "gemm.c",
    CSRC / "codes.c",
)
HEADERS = (CSRC / "vec.h", CSRC / "attention.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=c11")
# Seconds the build may take before the PyTorch path is used: far past a normal build.
BUILD_TIMEOUT_S = 300
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# name: (argtypes, restype) of each exported function
_FUNCTIONS = {
    "paged_attention_f32": ([_PTR] * 7 + [_I64] * 9 + [_F32, _INT, _INT, _I64, _F32, _PTR], _INT),
    "rms_norm_f32": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT], None),
    "fused_add_rms_norm_f32": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], None),
    "silu_and_mul_f32": ([_PTR, _I64, _PTR, _I64, _I64, _INT], None),
    "kv_half_supported": ([], _INT),
    "gemm_panel_width": ([], _I64),
    "gemm_f32": ([_PTR, _I64, _PTR, _PTR, _PTR] + [_I64] * 4 + [_INT], None),
    "gemm_codes_block": ([], _I64),
    "gemm_codes_f32": ([_PTR, _I64, _PTR, _PTR, _PTR] + [_I64] * 4 + [_INT], _INT),
    "gemm_codes_search": ([_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR], _I64),
    "rope_store_kv_f32": (
        [_PTR, _I64, _PTR, _PTR] + [_I64] * 4 + [_PTR, _PTR, _PTR, _I64, _INT, _INT],
        _INT,
    ),
}


def available() -> bool:
    """The compiled kernels can be called (built now if needed; False after a failed build)."""
    return _load() is not None


_profiler_enabled = torch._C._autograd._profiler_enabled


def call(function: str, *args):
    """lib().<function>(*args), labelled `inferline::<function>` in torch.profiler tables while a
    profiler runs."""
    fn = getattr(_lib if _lib is not None else lib(), function)
    if _profiler_enabled():
        with torch.profiler.record_function("inferline::" + function):
            return fn(*args)
    return fn(*args)


def lib() -> ctypes.CDLL:
    """The loaded library, once available() said True; no lock after loading (~150 calls a step)."""
    loaded = _lib if _lib is not None else _load()
    assert loaded is not None, (
        "the CPU kernels are not built: check kernels.cpu.build.available() first"
    )
    return loaded


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build_and_open()
        return _lib


def _build_and_open() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("cpu kernels off: no C compiler found (cc/gcc); using the PyTorch path")
        return None
    target = cache_dir() / "kernels" / f"inferline_cpu-{_build_key(compiler)}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("cpu kernels off: build failed; using the PyTorch path: %s", detail[-2000:])
        return None
    for name, (argtypes, restype) in _FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    lib.kv_half = bool(lib.kv_half_supported())  # asked once; checked every layer
    return lib


def _build_key(compiler: str) -> str:
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join((compiler,) + FLAGS).encode())
    h.update(platform.machine().encode() + cpu_flags().encode())
    return h.hexdigest()[:16]


def cpu_flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo; the platform elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        commands = [
            [compiler, *FLAGS, "-I", str(CSRC), "-c", str(src), "-o", str(obj)]
            for src, obj in zip(SOURCES, objects)
        ]
        _run_all(commands, Path(tmp), deadline)
        library = Path(tmp) / target.name
        _run_all(
            [[compiler, *FLAGS, "-shared", *map(str, objects), "-o", str(library), "-lm"]],
            Path(tmp),
            deadline,
        )
        os.replace(library, target)
        log.info("cpu kernels built: %s", target)


def _run_all(commands: list[list[str]], tmp: Path, deadline: float) -> None:
    """Runs the commands at once; raises like subprocess.run(check=True), or TimeoutExpired past
    the deadline. Output goes to files: unread warnings must not fill a pipe."""
    logs = [tmp / f"log{i}.txt" for i in range(len(commands))]
    jobs = []
    try:
        for command, path in zip(commands, logs):
            with path.open("w") as out:
                jobs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        for job, path in zip(jobs, logs):
            job.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if job.returncode != 0:
                raise subprocess.CalledProcessError(
                    job.returncode, job.args, stderr=path.read_text()
                )
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
