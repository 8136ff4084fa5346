"""The runner's device choices (worker/engine/device.py), CUDA arms included, on the CPU.

Each choice is a pure function of plain values, so a CUDA target is a string here; the few calls
that need a real GPU are the `gpu` tests at the end (and docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from inferline.worker.engine.device import (
    HostCopy,
    free_device_memory,
    host_copy,
    host_to_device,
    tensor_to_device,
    kv_cache_budget,
    kv_cache_tensor,
    num_kv_blocks,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
    start_host_copy,
)

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
GiB = 1 << 30
# A Llama-3-8B block: K and V, 16 tokens, 8 KV heads of 128, bf16, 32 layers.
LLAMA3_8B_BLOCK = 2 * 16 * 8 * 128 * 2 * 32


def blocks(
    device_type="cpu",
    *,
    bytes_per_block=LLAMA3_8B_BLOCK,
    num_blocks=None,
    kv_memory_gb=1.0,
    gpu_memory_utilization=0.85,
    free_bytes=None,
) -> int:
    return num_kv_blocks(
        bytes_per_block,
        device_type,
        num_blocks=num_blocks,
        kv_memory_gb=kv_memory_gb,
        gpu_memory_utilization=gpu_memory_utilization,
        free_bytes=free_bytes,
    )


# ---- device and dtypes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,cuda_available,expected",
    [
        ("auto", True, CUDA),
        ("auto", False, CPU),
        ("cpu", True, CPU),
        ("cuda", False, CUDA),
        ("cuda:1", True, torch.device("cuda", 1)),
    ],
)
def test_pick_device(name, cuda_available, expected):
    assert pick_device(name, cuda_available) == expected


def test_pick_device_asks_torch_when_not_told():
    assert pick_device("auto") == (CUDA if torch.cuda.is_available() else CPU)


@pytest.mark.parametrize(
    "name,device,expected",
    [
        ("auto", CUDA, torch.bfloat16),
        ("auto", CPU, torch.float32),
        ("float32", CUDA, torch.float32),
        ("float16", CUDA, torch.float16),
        ("bfloat16", CPU, torch.bfloat16),
        ("float16", CPU, torch.float16),
    ],
)
def test_pick_dtype(name, device, expected):
    assert pick_dtype(name, device) == expected


@pytest.mark.parametrize(
    "name,model_dtype,device,expected",
    [
        ("auto", torch.float32, CPU, torch.float32),
        ("auto", torch.bfloat16, CUDA, torch.bfloat16),
        ("float16", torch.float32, CPU, torch.float16),  # halves for an fp32 model on the CPU
        ("float16", torch.float16, CUDA, torch.float16),  # the model's own type: nothing to convert
    ],
)
def test_pick_kv_dtype(name, model_dtype, device, expected):
    assert pick_kv_dtype(name, model_dtype, device) == expected


@pytest.mark.parametrize(
    "model_dtype,device",
    [
        (torch.bfloat16, CUDA),
        (torch.float32, CUDA),
        (torch.bfloat16, CPU),
    ],
)
def test_fp16_kv_cache_is_refused_off_fp32_cpu(model_dtype, device):
    with pytest.raises(ValueError, match="INFERLINE_CACHE__DTYPE=auto"):
        pick_kv_dtype("float16", model_dtype, device)


# ---- KV cache size ------------------------------------------------------------------------------


def test_cuda_budget_is_a_share_of_free_memory():
    free = 120 * GiB
    assert kv_cache_budget("cuda", 1.0, 0.85, free) == free * 0.85
    assert blocks("cuda", free_bytes=free) == int(free * 0.85) // LLAMA3_8B_BLOCK
    assert (
        blocks("cuda", free_bytes=free, gpu_memory_utilization=1.0)
        == free // LLAMA3_8B_BLOCK
        == 61440
    )
    assert blocks("cuda", free_bytes=free, gpu_memory_utilization=0.5) == 30720


def test_cuda_ignores_kv_memory_gb_and_cpu_ignores_free_memory():
    on_cuda = {blocks("cuda", free_bytes=40 * GiB, kv_memory_gb=gb) for gb in (0.001, 1.0, 500.0)}
    assert on_cuda == {int(40 * GiB * 0.85) // LLAMA3_8B_BLOCK}
    on_cpu = {
        blocks("cpu", free_bytes=free, gpu_memory_utilization=u)
        for free in (None, 0, 80 * GiB)
        for u in (0.1, 1.0)
    }
    assert on_cpu == {10**9 // LLAMA3_8B_BLOCK} == {476}


def test_cpu_budget_is_kv_memory_gb_in_decimal_gigabytes():
    assert kv_cache_budget("cpu", 2.5, 0.85, None) == 2.5e9
    assert (
        blocks("cpu", kv_memory_gb=0.1, bytes_per_block=737_280) == 135
    )  # 0.1e9 / SmolLM2's fp32 block
    assert (
        blocks("cpu", kv_memory_gb=0.1, bytes_per_block=368_640) == 271
    )  # fp16 halves: twice, rounded down


@pytest.mark.parametrize("device_type,free_bytes", [("cpu", None), ("cuda", 0), ("cuda", 80 * GiB)])
def test_explicit_num_blocks_wins(device_type, free_bytes):
    assert blocks(device_type, num_blocks=7, free_bytes=free_bytes) == 7
    assert blocks(device_type, num_blocks=10**6, free_bytes=free_bytes, kv_memory_gb=0.001) == 10**6


@pytest.mark.parametrize(
    "budget,expected",
    [
        (0, 1),
        (1, 1),
        (LLAMA3_8B_BLOCK - 1, 1),  # below one block: still one
        (LLAMA3_8B_BLOCK, 1),
        (2 * LLAMA3_8B_BLOCK - 1, 1),
        (2 * LLAMA3_8B_BLOCK, 2),  # whole blocks only
    ],
)
def test_whole_blocks_and_at_least_one(budget, expected):
    assert blocks("cuda", free_bytes=budget, gpu_memory_utilization=1.0) == expected
    assert blocks("cpu", kv_memory_gb=budget / 1e9) == expected


def test_cuda_budget_needs_free_memory():
    with pytest.raises(AssertionError):
        blocks("cuda", free_bytes=None)


def test_no_free_memory_is_asked_off_cuda():
    assert free_device_memory(CPU) is None and free_device_memory(META) is None


def test_free_memory_is_read_after_the_allocator_cache_is_emptied(monkeypatch):
    """The CUDA arm's calls, recorded: blocks the caching allocator keeps from the load are
    handed back before the driver is asked, or the KV pool is sized as if they were in use."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device: calls.append(("mem_get_info", device)) or (7, 9)
    )
    assert free_device_memory(CUDA) == 7
    assert calls == ["empty_cache", ("mem_get_info", CUDA)]


# ---- where the KV cache lives --------------------------------------------------------------------


def test_cpu_kv_cache_is_zeroed_host_memory():
    cache = kv_cache_tensor((2, 2, 3, 16, 2, 8), torch.float16, CPU)
    assert (
        cache.shape == (2, 2, 3, 16, 2, 8) and cache.dtype == torch.float16 and cache.device == CPU
    )
    assert cache.count_nonzero() == 0
    cache[1, 1, 2] = 1.5  # writable, and the mapping is its own: nothing else sees it
    assert cache.sum() == 1.5 * 16 * 2 * 8


def test_device_kv_cache_comes_from_the_device_allocator():
    # "meta" takes the CUDA arm (torch.empty on the device) without a GPU: shape and type only.
    cache = kv_cache_tensor((32, 2, 1000, 16, 8, 128), torch.bfloat16, META)
    assert (
        cache.device == META
        and cache.dtype == torch.bfloat16
        and cache.shape == (32, 2, 1000, 16, 8, 128)
    )


# ---- host-to-device copies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "device_type,expected",
    [
        ("cuda", HostCopy(pin_memory=True, non_blocking=True)),
        ("cpu", HostCopy(pin_memory=False, non_blocking=False)),
        ("meta", HostCopy(pin_memory=False, non_blocking=False)),
    ],
)
def test_copy_decision(device_type, expected):
    assert host_copy(device_type) == expected


def test_host_to_device_on_the_cpu_is_the_host_tensor():
    t = host_to_device([[3, 1], [4, 1]], torch.int32, CPU)
    assert t.dtype == torch.int32 and t.device == CPU and t.tolist() == [[3, 1], [4, 1]]
    assert not t.is_pinned()


def test_host_to_device_to_another_device():
    t = host_to_device([5, 9, 2], torch.long, META)
    assert t.device == META and t.dtype == torch.long and t.shape == (3,)


def test_host_to_device_pins_and_enqueues_for_cuda(monkeypatch):
    """The CUDA arm's two calls, recorded (pinned memory needs a GPU: the gpu test does it)."""
    calls = {}

    class Host:
        def to(self, device, non_blocking):
            calls["to"] = (device, non_blocking)
            return "on device"

    def fake_tensor(data, dtype, pin_memory):
        calls["tensor"] = (data, dtype, pin_memory)
        return Host()

    monkeypatch.setattr(torch, "tensor", fake_tensor)
    assert host_to_device([1, 2], torch.int32, CUDA) == "on device"
    assert calls == {"tensor": ([1, 2], torch.int32, True), "to": (CUDA, True)}


def test_a_host_tensor_goes_to_cuda_from_pinned_memory(monkeypatch):
    """The step's tensors (step_inputs.py) and the sampler's: pinned, then an enqueued copy (the
    CUDA arm's calls recorded; on the CPU the tensor itself)."""
    host = torch.arange(4)
    assert tensor_to_device(host, CPU) is host
    calls = []

    class Pinned:
        def to(self, device, non_blocking):
            calls.append(("to", device, non_blocking))
            return "on device"

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda self: calls.append("pin_memory") or Pinned()
    )
    assert tensor_to_device(host, CUDA) == "on device"
    assert calls == ["pin_memory", ("to", CUDA, True)]


def test_sampled_ids_come_back_through_pinned_memory_and_an_event(monkeypatch):
    """The overlapped step's read-back (start_host_copy): on the CPU the tensor itself; the CUDA
    arm's calls recorded (a pinned buffer, an enqueued copy, an event recorded after it)."""
    ids = torch.arange(3)
    assert start_host_copy(ids) == (ids, None)
    calls = []

    class Device:
        type = "cuda"

    class OnDevice:
        device, shape, dtype = Device(), (3,), torch.int64

    class Host:
        def copy_(self, src, non_blocking):
            calls.append(("copy_", non_blocking))

    class Event:
        def record(self):
            calls.append("record")

    def fake_empty(shape, dtype, pin_memory):
        calls.append(("empty", shape, dtype, pin_memory))
        return Host()

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    host, ready = start_host_copy(OnDevice())
    assert isinstance(host, Host) and isinstance(ready, Event)
    assert calls == [("empty", (3,), torch.int64, True), ("copy_", True), "record"]


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_calls():
    free = free_device_memory(CUDA)
    assert 0 < free <= torch.cuda.get_device_properties(CUDA).total_memory
    assert blocks("cuda", free_bytes=free) == int(free * 0.85) // LLAMA3_8B_BLOCK
    t = host_to_device(list(range(1000)), torch.long, CUDA)
    assert t.is_cuda and t.sum().item() == 999 * 1000 // 2  # .item() waits for the async copy
    host, ready = start_host_copy(t)
    ready.synchronize()
    assert host.is_pinned() and host.tolist() == list(range(1000))
    cache = kv_cache_tensor((2, 2, 4, 16, 8, 128), torch.bfloat16, CUDA)
    assert cache.is_cuda and cache.shape == (2, 2, 4, 16, 8, 128)
