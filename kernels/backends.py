"""The kernels a model runs, chosen once when it loads into one frozen KernelBackends, validated
then and logged once by the runner.

    attention   triton | cpu | torch   store_kv, paged decode and prefill attention
    linear      c | onednn | torch     the linear layers (c and onednn: CPU fp32 only)
    fused_ops   c | triton | torch     norms, SiLU-and-mul, rope + K/V store (c: CPU fp32 only;
                                       triton: with the Triton attention)

`auto` picks Triton on CUDA (the fused ops follow the attention onto Triton, under the
interpreter too), and on a CPU in fp32 the C kernels where they built (attention:
also the shape and K/V dtype must suit them), else PyTorch; for the linear layers on a CPU in
fp32 it is a rule here (the C GEMM on AVX2 without AVX-512, else oneDNN) that ModelRunner replaces
by timing every candidate on the model at load (linear_candidates; models/calibration.py). An explicit choice this machine cannot
run raises BackendUnavailable with one line that says why and what to set instead: the worker
stops at start-up, never failing every request later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inferline.kernels.cpu import attention as cpu_attention
from inferline.kernels.cpu import build, gemm
from inferline.kernels.triton.launch import interpreting


class BackendUnavailable(RuntimeError):
    """An explicit backend that cannot run on this machine, device, dtype or shape."""


@dataclass(frozen=True)
class KernelBackends:
    attention: str
    linear: str
    fused_ops: str
    triton_target: str | None = None  # what Triton compiles for: "cuda" or "interpreter"


@dataclass(frozen=True)
class ModelShape:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int


def select_backends(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, shape: ModelShape,
                    attention: str = "auto", linear: str = "auto", fused_ops: str = "auto") -> KernelBackends:
    """The settings (INFERLINE_MODEL__ATTENTION_BACKEND, __CPU_LINEAR, __CPU_FUSED_OPS) resolved
    for this device, dtypes and shape; raises BackendUnavailable for an explicit impossible one."""
    chosen = select_attention(device, dtype, kv_dtype, shape, attention)
    target = None if chosen != "triton" else "cuda" if device.type == "cuda" else "interpreter"
    return KernelBackends(chosen, select_linear(device, dtype, linear),
                          select_fused_ops(device, dtype, fused_ops, chosen), target)


def select_attention(device, dtype, kv_dtype, shape: ModelShape, setting: str = "auto") -> str:
    if setting == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if _cpu_attention_fits(device, dtype, kv_dtype, shape) else "torch"
    if setting == "triton":
        _require(device.type == "cuda" or interpreting(),
                 "attention_backend=triton on the CPU needs TRITON_INTERPRET=1 in the environment "
                 "(the Triton interpreter, for tests); set INFERLINE_MODEL__ATTENTION_BACKEND=auto")
        _require(kv_dtype == dtype, f"attention_backend=triton needs the K/V cache in the model's dtype "
                                    f"({dtype}), not {kv_dtype}; set INFERLINE_CACHE__DTYPE=auto")
        return "triton"
    if setting == "cpu":
        _require(build.available(), "attention_backend=cpu but the C kernels did not build (no C compiler, "
                                    "or the build failed: see the log); set INFERLINE_MODEL__ATTENTION_BACKEND=auto")
        _require(_cpu_attention_fits(device, dtype, kv_dtype, shape),
                 f"attention_backend=cpu takes fp32 models on the CPU with head_dim a multiple of 16 up to 256 "
                 f"(this one: {dtype} on {device.type}, head_dim {shape.head_dim}, K/V {kv_dtype}); "
                 f"set INFERLINE_MODEL__ATTENTION_BACKEND=auto")
        return "cpu"
    assert setting == "torch", f"attention backend must be auto, triton, cpu or torch, got {setting!r}"
    return "torch"


def _cpu_attention_fits(device, dtype, kv_dtype, shape: ModelShape) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not cpu_attention.supports(shape.head_dim, shape.num_heads, shape.block_size):
        return False
    if kv_dtype != dtype and not (kv_dtype == torch.float16 and cpu_attention.supports_kv_half(shape.head_dim)):
        return False
    return build.available()


def select_linear(device, dtype, setting: str = "auto") -> str:
    """c or onednn pack the weights for CPU fp32 (worker/engine/models/linear.py); torch is F.linear."""
    if device.type != "cpu" or dtype != torch.float32 or setting == "torch":
        _require(setting in ("auto", "torch"), f"cpu_linear={setting} is for fp32 models on the CPU "
                                               f"(this one: {dtype} on {device.type}); set INFERLINE_MODEL__CPU_LINEAR=auto")
        return "torch"
    if setting == "auto":
        if gemm.preferred():
            return "c"
        return "onednn" if onednn_available() else "c" if gemm.available() else "torch"
    if setting == "c":
        _require(gemm.available(), "cpu_linear=c but the C kernels did not build (no C compiler, or the build "
                                   "failed: see the log); set INFERLINE_MODEL__CPU_LINEAR=auto")
        return "c"
    assert setting == "onednn", f"cpu_linear must be auto, c, onednn or torch, got {setting!r}"
    _require(onednn_available(), "cpu_linear=onednn but this PyTorch has no oneDNN linear; "
                                 "set INFERLINE_MODEL__CPU_LINEAR=auto")
    return "onednn"


def linear_candidates(device, dtype, setting: str = "auto") -> tuple[str, ...]:
    """The linear backends `setting` may run here: for `auto` on a CPU in fp32, every packed one
    that runs (ModelRunner times them on the model and keeps the fastest:
    worker/engine/models/calibration.py), select_linear's rule first; else select_linear's one."""
    chosen = select_linear(device, dtype, setting)
    if setting != "auto" or chosen == "torch":
        return (chosen,)
    others = [b for b, ok in (("c", gemm.available()), ("onednn", onednn_available())) if ok and b != chosen]
    return (chosen, *others)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def select_fused_ops(device, dtype, setting: str = "auto", attention: str = "torch") -> str:
    """`auto`: Triton with the Triton attention (what a GPU runs; the interpreter runs it too), the
    C kernels for CPU fp32, else PyTorch; `torch` always PyTorch."""
    if setting != "auto":
        return "torch"
    if attention == "triton":
        return "triton"
    return "c" if device.type == "cpu" and dtype == torch.float32 and build.available() else "torch"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BackendUnavailable(message)
