"""The machine's compute roofline for a model: how many tokens/s its matmuls alone allow.

We time the model's own linear layers (the real weight tensors, every layer plus the LM head) on
a random activation of `batch` rows, i.e. exactly the matmuls of one decode step at that batch
size. Measured FLOP/s = batch x FLOPs per token / time; roofline tokens/s = batch / time.
FLOPs per token = 2 x (weights of every linear layer, embeddings excluded) + 2 x the LM head
(tied to the embedding on SmolLM2, but still one [hidden x vocab] matmul per sampled token).
Attention over the context, norms and sampling are not counted: they are what an engine should
keep small next to this.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.nn.functional as F

from inferline.kernels.cpu.gemm import CodedWeight
from inferline.worker.engine.models.linear import BACKENDS, Packed, linear, pack_weight


def linear_weights(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(every decoder linear weight in forward order, the LM head weight) of a LlamaForCausalLM."""
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    return layers, model.lm_head_weight()


def linear_ops(model, backend: str | None = None) -> list[tuple[torch.Tensor, Packed | None]]:
    """(weight, packed copy) of every linear layer in forward order, the LM head last: the
    model's own packed copies (models/linear.py), or with `backend` (linear.BACKENDS, or "c+codes":
    the C GEMM over 8-bit codes where exact) copies packed here for it; None (F.linear) where there
    are none."""
    layers, head = linear_weights(model)
    if backend is not None:
        return [(w, pack_for(w, backend)) for w in layers + [head]]
    packed = [m.packed for layer in model.layers
              for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    return list(zip(layers + [head], packed + [model.lm_head_packed]))


def pack_for(weight: torch.Tensor, backend: str) -> Packed | None:
    """pack_weight for a backend name of the benchmarks: linear.BACKENDS, or "c+codes" (the C GEMM
    over 8-bit codes where the weight has exact ones)."""
    name, _, codes = backend.partition("+")
    return pack_weight(weight, name, codes=codes == "codes")


def flops_per_token(model) -> dict[str, float]:
    layers, head = linear_weights(model)
    body = 2.0 * sum(w.numel() for w in layers)
    lm_head = 2.0 * head.numel()
    return {"decoder_linears": body, "lm_head": lm_head, "total": body + lm_head}


@torch.inference_mode()
def time_step_matmuls(ops: list[tuple[torch.Tensor, Packed | None]], batch: int,
                      repeats: int = 5) -> float:
    """Best-of-`repeats` seconds for one pass over every weight of `ops` (linear_ops) at `batch`
    rows (best, because the roofline is what the machine can do; contention from other
    processes only adds time)."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w, _ in ops}
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        for w, packed in ops:  # as the model computes them, the LM head last
            linear(inputs[w.shape[1]], w, packed=packed)
        elapsed = time.perf_counter() - start
        if i:  # the first pass warms caches and the allocator
            best = min(best, elapsed)
    return best


def measure(model, batches=(64, 128, 256), repeats: int = 5) -> dict:
    """Roofline of `model` on this machine: per batch size and the best of them, each the faster
    of the packed backends (linear.BACKENDS) that apply: the machine's best rate, whichever
    backend the model itself uses."""
    flops = flops_per_token(model)
    by_batch = {}
    for backend in _packing_backends(model) or ["torch"]:
        ops = linear_ops(model, None if backend == "torch" else backend)  # packed once for every batch size
        for b in batches:
            t = time_step_matmuls(ops, b, repeats)
            if str(b) not in by_batch or t < by_batch[str(b)]["step_matmul_s"]:
                by_batch[str(b)] = {"step_matmul_s": t, "gflops": b * flops["total"] / t / 1e9,
                                    "tokens_per_s": b / t, "backend": backend}
        del ops  # a second copy of every weight
    best = max(by_batch.values(), key=lambda r: r["tokens_per_s"])
    return {"flops_per_token": flops, "by_batch": by_batch, "backend": best["backend"],
            "gflops": best["gflops"], "tokens_per_s": best["tokens_per_s"],
            "threads": torch.get_num_threads(), "dtype": str(model.lm_head_weight().dtype)}


def _packing_backends(model) -> list[str]:
    """The packed backends that apply to the model's weights on this machine (not where there is
    no oneDNN or no compiled kernels; F.linear is never faster than either), and "c+codes" where
    the C GEMM keeps the weights as 8-bit codes (the same fp32 values: kernels/cpu/gemm.py)."""
    head = model.lm_head_weight()
    backends = [b for b in BACKENDS if pack_weight(head[:16], b) is not None]
    if "c" in backends and isinstance(pack_for(head[:16], "c+codes"), CodedWeight):
        backends.append("c+codes")
    return backends


def canary_gflops(n: int = 256, k: int = 576, m: int = 1536, repeats: int = 20) -> float:
    """A ~0.1 s fp32 matmul probe: taken before each run, it shows how much CPU other processes
    were taking at the time (compare it between runs; it is not the roofline)."""
    a, w = torch.randn(n, k), torch.randn(m, k)
    F.linear(a, w)
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(a, w)
    return 2.0 * n * k * m * repeats / (time.perf_counter() - start) / 1e9


@contextlib.contextmanager
def torch_threads(num: int | None):
    """Run with `num` torch threads (None/0: torch's choice), then restore: main() also runs in pytest.
    One thread is the better choice on a busy 2-core machine: two OpenMP threads stall at every
    op's barrier whenever the other one is descheduled (docs/benchmarks.md)."""
    before = torch.get_num_threads()
    if num:
        torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_thread(fn, threads: int = 0):
    """`fn()` in a thread of its own, as the worker's EngineLoop runs the engine: where torch
    runs matters on a busy machine: OpenMP on the main thread behaved differently under load
    (docs/benchmarks.md)."""
    box: dict = {}

    def target():
        if threads:
            torch.set_num_threads(threads)  # per thread: OpenMP's setting is thread-local
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="bench-engine")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
