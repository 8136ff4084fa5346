"""The kernels a model runs (attention, linear, fused ops), chosen once at load into a frozen
KernelBackends; an impossible explicit choice raises BackendUnavailable.
design: docs/architecture.md#kernels
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
    triton_target: str | None = None  # "cuda" or "interpreter"


@dataclass(frozen=True)
class ModelShape:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int


def select_backends(
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    shape: ModelShape,
    attention: str = "auto",
    linear: str = "auto",
    fused_ops: str = "auto",
) -> KernelBackends:
    """The model settings' backends resolved for this device, dtypes and shape; raises
    BackendUnavailable for an explicit impossible one."""
    chosen = select_attention(device, dtype, kv_dtype, shape, attention)
    target = None if chosen != "triton" else "cuda" if device.type == "cuda" else "interpreter"
    return KernelBackends(
        chosen,
        select_linear(device, dtype, linear),
        select_fused_ops(device, dtype, fused_ops, chosen),
        target,
    )


def select_attention(device, dtype, kv_dtype, shape: ModelShape, setting: str = "auto") -> str:
    if setting == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if _cpu_attention_fits(device, dtype, kv_dtype, shape) else "torch"
    if setting == "triton":
        _require(
            device.type == "cuda" or interpreting(),
            "attention_backend=triton on the CPU needs TRITON_INTERPRET=1 in the environment "
            "(the Triton interpreter, for tests); set INFERLINE_MODEL__ATTENTION_BACKEND=auto",
        )
        _require(
            kv_dtype == dtype,
            f"attention_backend=triton needs the K/V cache in the model's dtype "
            f"({dtype}), not {kv_dtype}; set INFERLINE_CACHE__DTYPE=auto",
        )
        return "triton"
    if setting == "cpu":
        _require(
            build.available(),
            "attention_backend=cpu but the C kernels did not build (no C compiler, "
            "or the build failed: see the log); set INFERLINE_MODEL__ATTENTION_BACKEND=auto",
        )
        _require(
            _cpu_attention_fits(device, dtype, kv_dtype, shape),
            "attention_backend=cpu takes fp32 models on the CPU with head_dim a multiple of 16 "
            f"up to 256 (this one: {dtype} on {device.type}, head_dim {shape.head_dim}, "
            f"K/V {kv_dtype}); "
            f"set INFERLINE_MODEL__ATTENTION_BACKEND=auto",
        )
        return "cpu"
    assert setting == "torch", (
        f"attention backend must be auto, triton, cpu or torch, got {setting!r}"
    )
    return "torch"


def _cpu_attention_fits(device, dtype, kv_dtype, shape: ModelShape) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not cpu_attention.supports(shape.head_dim, shape.num_heads, shape.block_size):
        return False
    if kv_dtype != dtype and not (
        kv_dtype == torch.float16 and cpu_attention.supports_kv_half(shape.head_dim)
    ):
        return False
    return build.available()


def select_linear(device, dtype, setting: str = "auto") -> str:
    """c or onednn pack the weights for CPU fp32; torch is F.linear."""
    if device.type != "cpu" or dtype != torch.float32 or setting == "torch":
        _require(
            setting in ("auto", "torch"),
            f"cpu_linear={setting} is for fp32 models on the CPU "
            f"(this one: {dtype} on {device.type}); set INFERLINE_MODEL__CPU_LINEAR=auto",
        )
        return "torch"
    if setting == "auto":
        if gemm.preferred():
            return "c"
        return "onednn" if onednn_available() else "c" if gemm.available() else "torch"
    if setting == "c":
        _require(
            gemm.available(),
            "cpu_linear=c but the C kernels did not build (no C compiler, or the build "
            "failed: see the log); set INFERLINE_MODEL__CPU_LINEAR=auto",
        )
        return "c"
    assert setting == "onednn", f"cpu_linear must be auto, c, onednn or torch, got {setting!r}"
    _require(
        onednn_available(),
        "cpu_linear=onednn but this PyTorch has no oneDNN linear; "
        "set INFERLINE_MODEL__CPU_LINEAR=auto",
    )
    return "onednn"


def linear_candidates(device, dtype, setting: str = "auto") -> tuple[str, ...]:
    """The linear backends `setting` may run here: for `auto` on CPU fp32 every packed one that
    runs (timed at load), select_linear's rule first; else select_linear's one."""
    chosen = select_linear(device, dtype, setting)
    if setting != "auto" or chosen == "torch":
        return (chosen,)
    others = [
        b
        for b, ok in (("c", gemm.available()), ("onednn", onednn_available()))
        if ok and b != chosen
    ]
    return (chosen, *others)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def select_fused_ops(device, dtype, setting: str = "auto", attention: str = "torch") -> str:
    """`auto`: Triton with the Triton attention, the C kernels for CPU fp32, else PyTorch."""
    if setting != "auto":
        return "torch"
    if attention == "triton":
        return "triton"
    return "c" if device.type == "cpu" and dtype == torch.float32 and build.available() else "torch"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BackendUnavailable(message)
