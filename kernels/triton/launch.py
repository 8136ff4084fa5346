"""A Triton launch: a Target (a GPU, or the interpreter running an H200's plans) and a LaunchPlan
from a pure function; every launcher goes through `launch`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

# Called before every launch with (kernel, plan, args); empty while serving.
OBSERVERS: list[Callable] = []
_running = 0  # launches under way: the interpreter's torch calls happen inside one


@dataclass(frozen=True)
class Target:
    arch: int = 90  # major * 10 + minor: 80 (A100), 90 (H100/H200), 100 (B200)
    num_sms: int = 132
    interpreter: bool = False

    @property
    def name(self) -> str:
        return "interpreter" if self.interpreter else f"sm_{self.arch}"


INTERPRETER = Target(interpreter=True)  # an H200's plans, interpreted


def interpreting() -> bool:
    """Triton runs on CPU tensors only under its interpreter, switched on before the import."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def target_of(device: torch.device) -> Target:
    """The CUDA GPU of `device`, or the interpreter for CPU tensors."""
    if device.type != "cuda":
        assert interpreting(), (
            "Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
        return INTERPRETER
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    return Target(props.major * 10 + props.minor, props.multi_processor_count)


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str  # the @triton.jit function's name
    grid: tuple[int, ...]
    constexprs: tuple[tuple[str, object], ...]  # (name, value) pairs: hashable, frozen
    num_warps: int = 4
    num_stages: int = 2

    def options(self) -> dict:
        """Keyword arguments of the launch: the constexprs and the compile options."""
        return {**dict(self.constexprs), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def constexpr(self, name: str):
        return dict(self.constexprs)[name]


def dot_in_fp32(dtype: torch.dtype, target: Target) -> bool:
    """Upcast dot operands to fp32? Under the interpreter (its bf16 math is wrong) and for fp32
    inputs; on a GPU 16-bit operands stay 16-bit for the tensor cores."""
    return target.interpreter or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 x fp32 must not silently become tf32 (1e-3 error): the fp32 tolerance is 1e-4.
    return "ieee" if dtype == torch.float32 else "tf32"


def launch(kernel, plan: LaunchPlan, *args) -> None:
    """kernel[plan.grid](*args, **plan.options()), seen first by every observer."""
    global _running
    for observe in OBSERVERS:
        observe(kernel, plan, args)
    _running += 1
    try:
        kernel[plan.grid](*args, **plan.options())
    finally:
        _running -= 1


def launching() -> bool:
    """Inside a launch (under the interpreter the kernel's own work runs here)."""
    return _running > 0
