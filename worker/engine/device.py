"""Where the runner's tensors live and in what types: each GPU-or-CPU choice is a pure function
of plain values, tested on the CPU (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import gc
import math
import mmap
from dataclasses import dataclass

import torch

from inferline.kernels.backends import BackendUnavailable


def pick_device(name: str, cuda_available: bool | None = None) -> torch.device:
    """settings.model.device: `auto` is CUDA when there is one."""
    if name == "auto":
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        name = "cuda" if cuda_available else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """settings.model.dtype: `auto` is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        # CPU bf16 matmuls are far slower than fp32 (docs/benchmarks.md).
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def pick_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's element type: the model's, or fp16 for an fp32 model on the CPU."""
    if name == "auto" or getattr(torch, name) == model_dtype:
        return model_dtype
    if device.type != "cpu" or model_dtype != torch.float32:
        raise ValueError(
            f"cache.dtype={name} is for fp32 models on the CPU (this one: {model_dtype} on "
            f"{device.type}); set INFERLINE_CACHE__DTYPE=auto"
        )
    return getattr(torch, name)


def pick_cuda_graphs(name: str, device_type: str, attention: str) -> str:
    """settings.model.cuda_graphs resolved: `capture`, `eager` or `off`; an explicit `on` without
    CUDA and the Triton attention raises BackendUnavailable."""

    if name == "off" or name == "eager":
        return name
    capturable = device_type == "cuda" and attention == "triton"
    if name == "auto":
        return "capture" if capturable else "off"
    assert name == "on", f"cuda_graphs must be auto, on, eager or off, got {name!r}"
    if not capturable:
        raise BackendUnavailable(
            f"model.cuda_graphs=on captures on CUDA with the Triton attention (this runner: "
            f"{device_type}, attention {attention}); set INFERLINE_MODEL__CUDA_GRAPHS=eager "
            f"for the padded decode steps without capture, or auto"
        )
    return "capture"


# ---- KV cache size and memory --------------------------------------------------------------------


def kv_cache_budget(
    device_type: str, kv_memory_gb: float, gpu_memory_utilization: float, free_bytes: int | None
) -> float:
    """Bytes the KV cache may take: on CUDA `gpu_memory_utilization` of the memory free after the
    model loaded (docs/gpu.md), elsewhere `kv_memory_gb` (10^9 bytes)."""
    if device_type == "cuda":
        assert free_bytes is not None, "the CUDA budget is a share of the free device memory"
        return free_bytes * gpu_memory_utilization
    return kv_memory_gb * 1e9


def num_kv_blocks(
    bytes_per_block: int,
    device_type: str,
    *,
    num_blocks: int | None,
    kv_memory_gb: float,
    gpu_memory_utilization: float,
    free_bytes: int | None,
) -> int:
    """settings.cache.num_blocks when set, else the whole blocks the budget holds; at least one."""
    assert bytes_per_block > 0 and 0 < gpu_memory_utilization <= 1
    if num_blocks:
        return num_blocks
    budget = kv_cache_budget(device_type, kv_memory_gb, gpu_memory_utilization, free_bytes)
    return max(1, int(budget // bytes_per_block))


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device, measured now; None elsewhere. The allocator's unused blocks are
    released first: the driver counts them as taken."""
    if device.type != "cuda":
        return None
    gc.collect()  # tensors only a reference cycle holds
    torch.cuda.empty_cache()  # CUDA only
    return torch.cuda.mem_get_info(device)[0]  # CUDA only


def kv_cache_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The whole KV cache as one tensor: on the CPU in huge pages, written once."""
    if device.type == "cpu":
        return huge_page_tensor(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own mapping advised onto 2 MB pages (decode attention reads
    blocks scattered over the cache: TLB misses), every page written now so a host short of memory
    fails at start-up (docs/operations.md#process-memory-on-the-cpu)."""
    # Private: with MAP_SHARED (shmem) THP follows another setting.
    buf = mmap.mmap(
        -1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return (
        torch.frombuffer(buf, dtype=dtype).view(shape).zero_()
    )  # the tensor keeps the mapping alive


# ---- host-to-device copies -----------------------------------------------------------------------


@dataclass(frozen=True)
class HostCopy:
    """How a tensor built on the host from Python lists reaches the device."""

    pin_memory: bool  # page-locked (needs CUDA)
    non_blocking: bool  # enqueue and return at once


def host_copy(device_type: str) -> HostCopy:
    # From pinned memory a CUDA copy is a true async DMA; from pageable it waits for the host.
    on_cuda = device_type == "cuda"
    return HostCopy(pin_memory=on_cuda, non_blocking=on_cuda)


def host_to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(data) on `device`."""
    copy = host_copy(device.type)
    host = torch.tensor(data, dtype=dtype, pin_memory=copy.pin_memory)  # pinned: CUDA only
    return host.to(device, non_blocking=copy.non_blocking)


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into the persistent buffer `dst`; on CUDA pinned and enqueued, so it
    lands after queued work that reads `dst`."""
    if dst.device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()  # CUDA only
    dst.copy_(host, non_blocking=dst.device.type == "cuda")


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA pinned first and enqueued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()  # CUDA only
    return host.to(device, non_blocking=True)


# ---- device-to-host copies -----------------------------------------------------------------------


def start_host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """(the host copy of `tensor`, what to wait on before reading it): on CUDA a copy into pinned
    memory queued behind the work that writes `tensor`, and its event; elsewhere `tensor` itself."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # CUDA only
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()  # CUDA only
    ready.record()
    return host, ready
