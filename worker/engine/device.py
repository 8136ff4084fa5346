"""Where the runner's tensors live, and in what types.

Every choice that differs between a GPU and the CPU is a pure function of plain values here
(a device's type, byte counts, setting names), so the CUDA arm of each runs in the CPU tests
(tests/unit/test_device.py). What only a GPU can answer (free memory, pinned host pages) is a thin
call beside it; docs/gpu.md lists those calls and what exercises them.
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
    """settings.model.device: `auto` is CUDA when there is one (cuda_available=None: ask torch)."""
    if name == "auto":
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        name = "cuda" if cuda_available else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """settings.model.dtype: `auto` is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        # CPU bf16 matmuls are far slower than fp32 (docs/benchmarks.md); on a GPU bf16 is the norm.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def pick_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's element type (settings.cache.dtype): the model's own, or fp16 halves for an
    fp32 model on the CPU (the C kernels widen them as they read; nothing else does)."""
    if name == "auto" or getattr(torch, name) == model_dtype:
        return model_dtype
    if device.type != "cpu" or model_dtype != torch.float32:
        raise ValueError(f"cache.dtype={name} is for fp32 models on the CPU (this one: {model_dtype} on "
                         f"{device.type}); set INFERLINE_CACHE__DTYPE=auto")
    return getattr(torch, name)


def pick_cuda_graphs(name: str, device_type: str, attention: str) -> str:
    """settings.model.cuda_graphs resolved: `capture` (a CUDA graph per decode bucket), `eager`
    (the same padded static-buffer decode steps, launched op by op) or `off` (flat batches).
    Capture needs CUDA and the Triton attention: its metadata are views of the static buffers,
    while the PyTorch path plans each step on the host from the context lengths' values. An
    explicit `on` that cannot capture raises BackendUnavailable: the worker stops at start-up
    with that one line (worker/__main__.py)."""

    if name == "off" or name == "eager":
        return name
    capturable = device_type == "cuda" and attention == "triton"
    if name == "auto":
        return "capture" if capturable else "off"
    assert name == "on", f"cuda_graphs must be auto, on, eager or off, got {name!r}"
    if not capturable:
        raise BackendUnavailable(f"model.cuda_graphs=on captures on CUDA with the Triton attention (this runner: "
                         f"{device_type}, attention {attention}); set INFERLINE_MODEL__CUDA_GRAPHS=eager "
                         f"for the padded decode steps without capture, or auto")
    return "capture"


# ---- KV cache size and memory ---------------------------------------------------------------------

def kv_cache_budget(device_type: str, kv_memory_gb: float, gpu_memory_utilization: float,
                    free_bytes: int | None) -> float:
    """Bytes the KV cache may take.

    CUDA: `gpu_memory_utilization` of the memory free once the model has loaded (free_bytes, from
    free_device_memory); the rest of it is headroom for activations and the allocator. This is
    not vLLM's meaning (there: a share of the device's *total* memory for the whole instance,
    weights and profiled activations included); ours needs no profiling run, and a device shared
    with another process gives only what is free. Elsewhere: `kv_memory_gb` (10^9 bytes)."""
    if device_type == "cuda":
        assert free_bytes is not None, "the CUDA budget is a share of the free device memory"
        return free_bytes * gpu_memory_utilization
    return kv_memory_gb * 1e9


def num_kv_blocks(bytes_per_block: int, device_type: str, *, num_blocks: int | None, kv_memory_gb: float,
                  gpu_memory_utilization: float, free_bytes: int | None) -> int:
    """The KV cache's size in blocks: settings.cache.num_blocks when set, else as many whole
    blocks as the budget holds, and never fewer than one (the scheduler then rejects what cannot
    fit, with a reason, instead of the worker failing to start)."""
    assert bytes_per_block > 0 and 0 < gpu_memory_utilization <= 1
    if num_blocks:
        return num_blocks
    budget = kv_cache_budget(device_type, kv_memory_gb, gpu_memory_utilization, free_bytes)
    return max(1, int(budget // bytes_per_block))


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (measured now: call it after the model has loaded); None on
    devices whose KV budget is a setting. The caching allocator's unused blocks (the load's
    temporaries) are handed back first: the driver counts them as taken."""
    if device.type != "cuda":
        return None
    gc.collect()  # tensors only a reference cycle still holds
    torch.cuda.empty_cache()  # CUDA only: docs/gpu.md
    return torch.cuda.mem_get_info(device)[0]  # CUDA only: docs/gpu.md


def kv_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole KV cache as one tensor: on the CPU in huge pages, written once; elsewhere as the
    device's allocator gives it (every slot is stored before attention reads it)."""
    if device.type == "cpu":
        return huge_page_tensor(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own, advised onto 2 MB pages
    (transparent huge pages, when the host's THP mode is `madvise` or `always`). Decode attention
    reads K/V blocks scattered over the whole cache; on 4 KB pages every block is several TLB
    misses (docs/benchmarks.md). Where THP is off the advice is ignored: 4 KB pages, as
    torch.empty's.

    Every page is written here, once: the memory is the KV budget, taken at start-up (a host that
    cannot give it fails now, not mid-request), and no step pays the first touch of a page."""
    # Private and anonymous (mmap's default, MAP_SHARED, is shmem: THP there follows another setting).
    buf = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape).zero_()  # the tensor keeps the mapping alive


# ---- host-to-device copies --------------------------------------------------------------------------

@dataclass(frozen=True)
class HostCopy:
    """How a tensor built on the host from Python lists reaches the device."""
    pin_memory: bool  # build it in page-locked memory (needs CUDA present)
    non_blocking: bool  # enqueue the copy on the stream and return at once


def host_copy(device_type: str) -> HostCopy:
    # From pageable memory a CUDA copy waits for the host anyway; from pinned memory it is a true
    # async DMA (torch's pinned allocator keeps the buffer until the copy is done). CPU: no copy.
    on_cuda = device_type == "cuda"
    return HostCopy(pin_memory=on_cuda, non_blocking=on_cuda)


def host_to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(data) on `device`; on the CPU the tensor itself (`.to` to its own device
    is a no-op)."""
    copy = host_copy(device.type)
    host = torch.tensor(data, dtype=dtype, pin_memory=copy.pin_memory)  # pinned: CUDA only, docs/gpu.md
    return host.to(device, non_blocking=copy.non_blocking)


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into `dst` (a persistent buffer): on CUDA from pinned memory (pinned
    first if it is not), enqueued on the stream, so it lands after the work already queued that
    reads `dst` (the last step's graph replay); on the CPU a plain copy."""
    if dst.device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()  # CUDA only: docs/gpu.md
    dst.copy_(host, non_blocking=dst.device.type == "cuda")


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: the tensor itself on the CPU; on CUDA copied from pinned memory
    (pinned first if it is not), enqueued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()  # CUDA only: docs/gpu.md
    return host.to(device, non_blocking=True)
