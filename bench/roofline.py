"""The machine's compute roofline for a model: how many tokens/s its matmuls alone allow, and
the threads the benchmarks measure on.

The model's own linear layers (every layer plus the LM head) are timed on `batch` random rows:
the matmuls of one decode step. FLOPs per token = 2 x the linear weights (embeddings excluded) +
2 x the LM head. Attention, norms and sampling are not counted: an engine keeps them small.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from inferline.worker.engine.models.linear import Packed, linear, pack_weight


def linear_modules(model) -> list:
    """Every decoder linear layer of a LlamaForCausalLM, in forward order."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


def linear_weights(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(every decoder linear weight in forward order, the LM head weight) of a LlamaForCausalLM."""
    return [m.weight for m in linear_modules(model)], model.lm_head_weight()


def linear_ops(model, backend: str | None = None) -> list[tuple[torch.Tensor, Packed | None]]:
    """(weight, packed copy) of every linear layer in forward order, the LM head last: the
    model's own copies, or copies packed here for `backend` (pack_for); None: F.linear."""
    layers, head = linear_weights(model)
    if backend is not None:
        return [(w, pack_for(w, backend)) for w in layers + [head]]
    packed = [m.packed for m in linear_modules(model)]
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
def time_step_matmuls(
    ops: list[tuple[torch.Tensor, Packed | None]], batch: int, repeats: int = 5
) -> float:
    """Best-of-`repeats` seconds for one pass over `ops` at `batch` rows (best: what the machine
    can do; other processes only add time)."""
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
    """Roofline of `model` per batch size and the best of them, on the model's own linear
    backend (`auto` picks the faster on this machine at load)."""
    flops, ops = flops_per_token(model), linear_ops(model)
    by_batch = {}
    for b in batches:
        t = time_step_matmuls(ops, b, repeats)
        gflops = b * flops["total"] / t / 1e9
        by_batch[str(b)] = {"step_matmul_s": t, "gflops": gflops, "tokens_per_s": b / t}
    best = max(by_batch.values(), key=lambda r: r["tokens_per_s"])
    return {
        "flops_per_token": flops,
        "by_batch": by_batch,
        "gflops": best["gflops"],
        "tokens_per_s": best["tokens_per_s"],
        "threads": torch.get_num_threads(),
        "dtype": str(model.lm_head_weight().dtype),
    }


def canary_gflops(n: int = 256, k: int = 576, m: int = 1536, repeats: int = 20) -> float:
    """A ~0.1 s fp32 matmul probe before each run: how much CPU other processes took then."""
    a, w = torch.randn(n, k), torch.randn(m, k)
    F.linear(a, w)
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(a, w)
    return 2.0 * n * k * m * repeats / (time.perf_counter() - start) / 1e9


def in_thread(fn, threads: int = 0):
    """`fn()` in a thread of its own, as the worker's EngineLoop runs the engine: each thread
    that runs OpenMP work keeps its own pool (docs/benchmarks.md)."""
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
