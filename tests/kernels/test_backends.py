"""kernels/backends.py: what `auto` picks on each device, and that an explicit backend this
machine cannot run is refused at load with one line naming the setting to change.
(Through the engine: tests/unit/test_engine.py for the CPU paths,
tests/kernels/test_triton_engine.py for Triton.)"""

from __future__ import annotations

import pytest
import torch

from inferline import kernels
from inferline.kernels import backends
from inferline.kernels.backends import (
    BackendUnavailable,
    KernelBackends,
    ModelShape,
    select_backends,
)
from inferline.kernels.cpu import build

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMOLLM2 = ModelShape(head_dim=64, num_heads=9, num_kv_heads=3, block_size=16)
F32, BF16 = torch.float32, torch.bfloat16


def test_auto_on_cuda_is_triton_attention_and_fused_ops_and_torch_linears():
    chosen = select_backends(CUDA, BF16, BF16, SMOLLM2)
    assert chosen == KernelBackends("triton", "torch", "triton", "cuda")
    assert select_backends(CUDA, BF16, BF16, SMOLLM2, fused_ops="torch").fused_ops == "torch"


def test_auto_on_a_cpu_in_fp32_is_the_c_kernels_where_they_built(monkeypatch):
    chosen = select_backends(CPU, F32, F32, SMOLLM2)
    assert chosen.attention == ("cpu" if build.available() else "torch")
    assert (
        chosen.fused_ops == ("c" if build.available() else "torch") and chosen.triton_target is None
    )
    monkeypatch.setattr(
        build, "available", lambda: False
    )  # no compiler: PyTorch everywhere, no error
    assert select_backends(CPU, F32, F32, SMOLLM2) == KernelBackends(
        "torch", "onednn" if backends.onednn_available() else "torch", "torch"
    )


def test_auto_on_a_cpu_in_bf16_is_torch():
    assert select_backends(CPU, BF16, BF16, SMOLLM2) == KernelBackends("torch", "torch", "torch")


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        BackendUnavailable, match="needs TRITON_INTERPRET=1.*ATTENTION_BACKEND=auto"
    ):
        select_backends(CPU, F32, F32, SMOLLM2, attention="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chosen = select_backends(
        CPU, F32, F32, SMOLLM2, attention="triton", linear="torch", fused_ops="torch"
    )
    assert chosen == KernelBackends("triton", "torch", "torch", "interpreter")
    # auto: the fused ops follow the attention onto Triton, as on a GPU
    assert (
        select_backends(CPU, F32, F32, SMOLLM2, attention="triton", linear="torch").fused_ops
        == "triton"
    )
    with pytest.raises(BackendUnavailable, match="K/V cache in the model's dtype"):
        select_backends(CPU, F32, torch.float16, SMOLLM2, attention="triton")


def test_cpu_attention_that_cannot_run_is_refused(monkeypatch):
    with pytest.raises(
        BackendUnavailable, match="attention_backend=cpu takes fp32 models on the CPU"
    ):
        select_backends(CUDA, BF16, BF16, SMOLLM2, attention="cpu")
    odd = ModelShape(head_dim=72, num_heads=4, num_kv_heads=1, block_size=16)
    with pytest.raises(BackendUnavailable, match="head_dim 72"):
        select_backends(CPU, F32, F32, odd, attention="cpu")
    monkeypatch.setattr(build, "available", lambda: False)
    with pytest.raises(
        BackendUnavailable, match="attention_backend=cpu but the C kernels did not build"
    ):
        select_backends(CPU, F32, F32, SMOLLM2, attention="cpu")


def test_cpu_linears_on_a_gpu_are_refused():
    with pytest.raises(BackendUnavailable, match="cpu_linear=c is for fp32 models on the CPU"):
        select_backends(CUDA, BF16, BF16, SMOLLM2, linear="c")
    assert select_backends(CUDA, BF16, BF16, SMOLLM2, linear="torch").linear == "torch"


def test_the_plan_is_frozen():
    chosen = select_backends(CPU, F32, F32, SMOLLM2)
    with pytest.raises(AttributeError):
        chosen.attention = "torch"


@pytest.mark.parametrize("name", ["store_kv", "paged_decode_attention", "paged_prefill_attention"])
def test_no_submodule_shadows_a_public_call(name):
    """The trap of issue 24: a submodule named like an exported function replaces it on import."""
    import inferline.kernels.triton.decode  # noqa: F401
    import inferline.kernels.triton.prefill  # noqa: F401
    import inferline.kernels.triton.store  # noqa: F401

    assert callable(getattr(kernels, name)) and not isinstance(
        getattr(kernels, name), type(kernels)
    )
