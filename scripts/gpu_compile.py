"""Compile every Triton launch plan for real GPUs on a machine without one (`make gpu-compile`).
A development tool, not part of the installed package.

    python scripts/gpu_compile.py [--archs 80,90,100] [--quick] [--first-contact] [--jobs 2]

Exits non-zero on a compile error, a spill, or too much shared memory.
design: docs/gpu.md#make-gpu-compile
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from inferline.kernels.triton import activation, decode, moe, norm, prefill, rotary, store, w8a16
from inferline.kernels.triton.launch import LaunchPlan, Target
from inferline.kernels.triton.variants import exemptions


@dataclass(frozen=True)
class Arch:
    name: str  # the --gpu-name for ptxas: sm_90 and up as the "a" variant
    num_sms: int
    max_shared: int  # bytes of shared memory a block may opt in to


ARCHS = {
    80: Arch("sm_80", 108, 163 * 1024),  # A100
    90: Arch("sm_90a", 132, 227 * 1024),  # H100 / H200
    100: Arch("sm_100a", 148, 227 * 1024),  # B200
}
KERNELS = {
    "_decode_stage1_kernel": decode._decode_stage1_kernel,
    "_decode_stage2_kernel": decode._decode_stage2_kernel,
    "_prefill_kernel": prefill._prefill_kernel,
    "_store_kv_kernel": store._store_kv_kernel,
    "_rms_norm_kernel": norm._rms_norm_kernel,
    "_silu_and_mul_kernel": activation._silu_and_mul_kernel,
    "_swiglu_oai_kernel": activation._swiglu_oai_kernel,
    "_rope_store_kv_kernel": rotary._rope_store_kv_kernel,
    "_fused_moe_kernel": moe._fused_moe_kernel,
    "_fused_moe_w8a16_kernel": moe._fused_moe_w8a16_kernel,
    "_w8a16_kernel": w8a16._w8a16_kernel,
}
TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

# The supported models (Llama, Mistral, Qwen2/3, SmolLM): head sizes, GQA groups, cache pages.
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.float16, torch.bfloat16)
NUM_KV_HEADS = 8
# (num_seqs, context tokens): one split per sequence (DIRECT); a few splits; the most splits.
DECODE_BATCHES = ((256, 2048), (8, 4096), (1, 32768))
# (num_seqs, query tokens): one prompt (num_seqs == 1 reaches the JIT as a constant); a batch.
PREFILL_BATCHES = ((1, 2048), (7, 4096))
# The layer's elementwise kernels: (hidden, intermediate) of SmolLM2-135M, Llama-3-8B, Llama-3-70B.
LAYER_SIZES = ((576, 1536), (4096, 14336), (8192, 28672))
# The fused-MoE layers: (hidden, one expert's intermediate, experts, top-k) of Mixtral-8x7B,
# Qwen3-30B-A3B, Qwen3-235B-A22B and Qwen1.5-MoE-A2.7B (Qwen2-MoE).
MOE_SIZES = ((4096, 14336, 8, 2), (2048, 768, 128, 8), (4096, 1536, 128, 8), (2048, 1408, 60, 4))
MOE_TOKENS = (1, 256, 8192)  # a decode of one sequence, a decode batch, a prefill chunk
# gpt-oss-20b and -120b: attention with sinks (head_dim 64, 64 query / 8 KV heads), the fused MoE
# with the experts' biases (hidden 2880, one expert's intermediate 2880, 32 or 128 experts,
# top-4) and its clamped SwiGLU (alpha 1.702, limit 7)
GPT_OSS_ATTENTION = (64, 8)  # (head_dim, GQA group)
GPT_OSS_MOE_SIZES = ((2880, 2880, 32, 4), (2880, 2880, 128, 4))
GPT_OSS_SWIGLU = (1.702, 7.0)
# W8A16 linear layers: N and K are not constants, so one shape (Llama-3-8B's qkv_proj) stands
# for all; FP8 codes with per-row scales (per tensor, per channel) or 128-column blocks, and
# GGUF's uint8 levels with a scale and offset per 32 columns; with and without a bias, decode-
# and prefill-sized. (affine, group_k) pairs:
W8A16_SHAPE = (6144, 4096)
W8A16_GROUPS = ((False, 0), (False, 128), (True, 32))
W8A16_TOKENS = (1, 8192)
# FP8 MoE experts (the fused-MoE kernel's W8A16 variant): a scale per row (per tensor, per
# channel: Mixtral FP8) or per 128-column block (Qwen3-MoE-FP8), on the MoE layers above.
MOE_W8A16_GROUPS = (0, 128)
# (constexpr, label) shown in the shape column
SHOWN = (
    ("HEAD_DIM", "d"), ("GROUP", "gqa"), ("NUM_KV_HEADS", "kvh"), ("BLOCK_SIZE", "bs"),
    ("SPLITS_P2", "SPLITS_P2"), ("BLOCK_M", "BLOCK_M"), ("BLOCK_N", "BLOCK_N"), ("COLS", "cols"),
    ("INTER", "inter"), ("HAS_RESIDUAL", "residual"), ("HEADS_BLOCK", "heads/program"),
    ("N", "N"), ("K", "K"), ("TOP_K", "k"), ("BLOCK_K", "BLOCK_K"), ("GROUP_K", "group_k"),
    ("HAS_BIAS", "bias"), ("AFFINE", "affine"), ("HAS_SINKS", "sinks"),
)  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One compile: equal Jobs are one binary (the grid is not part of it)."""

    kernel: str
    arch: int
    dtype: str
    constexprs: tuple[tuple[str, object], ...]
    params: tuple[
        tuple[str, str, bool], ...
    ]  # (name, type, divisible by 16) of the other arguments
    num_warps: int
    num_stages: int

    @property
    def shape(self) -> str:
        cx = dict(self.constexprs)
        parts = [f"{label}={cx[name]}" for name, label in SHOWN if name in cx]
        if "DIRECT" in cx:
            parts.insert(0, "direct" if cx["DIRECT"] else "split")
        return " ".join(parts + [f"warps={self.num_warps}", f"stages={self.num_stages}"])


@dataclass(frozen=True)
class Row:
    job: Job
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0
    error: str = ""

    def spills(self) -> bool:
        """Spills fail a 16-bit plan; fp32 runs on a GPU only in the first contact's correctness
        checks (serving is bf16/fp16), where they cost speed alone: reported, not failed."""
        return bool(self.spill_stores or self.spill_loads)

    def problems(self) -> list[str]:
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if self.spills() and self.job.dtype != "fp32":
            out.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.shared > ARCHS[self.job.arch].max_shared:
            out.append(f"shared memory {self.shared} B > {ARCHS[self.job.arch].max_shared} B")
        return out


# --- the plans, as the launchers build them ----------------------------------------------------


def job_of(plan: LaunchPlan, arch: int, dtype: torch.dtype, args: dict) -> Job:
    """The compile a launch of `plan` with these `args` triggers (a "*type" string for a pointer,
    else the value), specialized as the JIT does."""
    fn = KERNELS[plan.kernel]
    constexprs = dict(plan.constexprs)
    assert set(args) | set(constexprs) == set(fn.arg_names), (
        plan.kernel,
        set(fn.arg_names) ^ set(args),
    )
    exempt, unaligned = exemptions(fn)
    params = []
    for name in fn.arg_names:
        if name in constexprs:
            continue
        type_, aligned = specialize(args[name], name not in exempt, name not in unaligned)
        if type_ == "constexpr":
            constexprs[name] = args[name]
        else:
            params.append((name, type_, aligned))
    return Job(plan.kernel, arch, TYPE_NAMES[dtype], tuple(constexprs.items()), tuple(params),
               plan.num_warps, plan.num_stages)  # fmt: skip


def specialize(value, values: bool = True, alignment: bool = True) -> tuple[str, bool]:
    """(type, divisible by 16) as the JIT specializes one argument (False: exempt)."""
    if isinstance(value, str):
        return value, alignment  # a pointer; assumed 16-byte aligned
    if isinstance(value, float):
        return "fp32", False
    if value == 1 and values:
        return "constexpr", False
    return ("i32" if -(2**31) <= value < 2**31 else "i64"), values and value % 16 == 0


def decode_jobs(
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    arch: int,
    num_kv_heads: int = NUM_KV_HEADS,
    batches=DECODE_BATCHES,
    splits=(None,),  # None: the heuristic's
    sinks: bool = False,
):
    num_heads, ptr = group * num_kv_heads, "*" + TYPE_NAMES[dtype]
    NUM_KV_HEADS = num_kv_heads  # noqa: N806 - the strides below
    for (num_seqs, context), num_splits in itertools.product(batches, splits):
        max_blocks = -(-context // block_size)
        plan = decode.plan_decode(num_seqs, num_heads, NUM_KV_HEADS, head_dim, block_size,
                                  max_blocks, dtype, target(arch),
                                  num_splits=num_splits, sinks=sinks)  # fmt: skip
        # the arguments of launch_decode, for contiguous q/out [S, H, D] and the paged caches
        yield job_of(plan.stage1, arch, dtype, dict(
            q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
            context_lens_ptr="*i32", out_ptr=ptr, part_acc_ptr="*fp32", part_m_ptr="*fp32",
            part_l_ptr="*fp32", split_len_ptr="*i32", sinks_ptr="*fp32", qk_scale=0.125,
            num_splits=plan.num_splits, window=decode.NO_WINDOW, softcap=0.0,
            stride_qs=num_heads * head_dim, stride_qh=head_dim,
            stride_cb=block_size * NUM_KV_HEADS * head_dim,
            stride_cs=NUM_KV_HEADS * head_dim, stride_ch=head_dim, stride_bt=max_blocks,
            stride_os=num_heads * head_dim, stride_oh=head_dim,
        ))  # fmt: skip
        if plan.stage2 is not None:
            yield job_of(plan.stage2, arch, dtype, dict(
                out_ptr=ptr, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                context_lens_ptr="*i32", split_len_ptr="*i32", sinks_ptr="*fp32",
                num_splits=plan.num_splits,
                window=decode.NO_WINDOW, stride_os=num_heads * head_dim, stride_oh=head_dim,
            ))  # fmt: skip


def prefill_jobs(
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    arch: int,
    num_kv_heads: int = NUM_KV_HEADS,
    batches=PREFILL_BATCHES,
    sinks: bool = False,
    **tiles,
):
    num_heads, ptr = group * num_kv_heads, "*" + TYPE_NAMES[dtype]
    NUM_KV_HEADS = num_kv_heads  # noqa: N806 - the strides below
    for num_seqs, total in batches:
        plan = prefill.plan_prefill(total, num_seqs, num_heads, NUM_KV_HEADS, head_dim, block_size,
                                    dtype, target(arch), sinks=sinks, **tiles)  # fmt: skip
        yield job_of(plan, arch, dtype, dict(
            q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
            cu_seqlens_ptr="*i32", context_lens_ptr="*i32", out_ptr=ptr,
            sinks_ptr="*fp32" if sinks else ptr, qk_scale=0.125,
            num_seqs=num_seqs, window=decode.NO_WINDOW, softcap=0.0,
            stride_qt=num_heads * head_dim, stride_qh=head_dim,
            stride_cb=block_size * NUM_KV_HEADS * head_dim,
            stride_cs=NUM_KV_HEADS * head_dim, stride_ch=head_dim,
            stride_bt=(total + block_size - 1) // block_size,
            stride_ot=num_heads * head_dim, stride_oh=head_dim,
        ))  # fmt: skip


def store_jobs(
    head_dim: int, block_size: int, dtype: torch.dtype, arch: int, num_kv_heads: int = NUM_KV_HEADS
):
    ptr, row = "*" + TYPE_NAMES[dtype], num_kv_heads * head_dim
    plan = store.plan_store(4096, num_kv_heads, head_dim, block_size)
    yield job_of(plan, arch, dtype, dict(
        k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, slot_ptr="*i64",
        stride_kt=row, stride_kh=head_dim, stride_vt=row, stride_vh=head_dim,
        stride_cb=block_size * row, stride_cs=row, stride_ch=head_dim,
    ))  # fmt: skip


def rope_jobs(
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    arch: int,
    num_kv_heads: int = NUM_KV_HEADS,
):
    num_heads, ptr = group * num_kv_heads, "*" + TYPE_NAMES[dtype]
    NUM_KV_HEADS = num_kv_heads  # noqa: N806 - the strides below
    plan = rotary.plan_rope_store_kv(4096, num_heads, NUM_KV_HEADS, head_dim, block_size)
    yield job_of(plan, arch, dtype, dict(
        qkv_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr, slot_ptr="*i64", k_cache_ptr=ptr, v_cache_ptr=ptr,
        stride_t=(num_heads + 2 * NUM_KV_HEADS) * head_dim, stride_cos=head_dim,
        stride_cb=block_size * NUM_KV_HEADS * head_dim, stride_cs=NUM_KV_HEADS * head_dim,
        stride_ch=head_dim,
    ))  # fmt: skip


def elementwise_jobs(hidden: int, inter: int, dtype: torch.dtype, arch: int):
    """RMSNorm alone and with the residual add, SiLU-and-mul: rows of contiguous activations."""
    ptr = "*" + TYPE_NAMES[dtype]
    for residual in (False, True):
        plan = norm.plan_rms_norm(4096, hidden, residual)
        yield job_of(
            plan,
            arch,
            dtype,
            dict(
                x_ptr=ptr,
                residual_ptr=ptr,
                weight_ptr=ptr,
                out_ptr=ptr,
                stride_x=hidden,
                stride_r=hidden,
                stride_o=hidden,
                eps=1e-5,
            ),
        )
    plan = activation.plan_silu_and_mul(4096, inter)
    yield job_of(
        plan, arch, dtype, dict(x_ptr=ptr, out_ptr=ptr, stride_x=2 * inter, stride_o=inter)
    )


def moe_jobs(hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, arch: int,
             tokens=MOE_TOKENS, bias: bool = False):  # fmt: skip
    """The fused-MoE layer's two grouped GEMMs (gate/up on token rows, down on slot rows with the
    routing weights) as fused_experts_triton launches them, per row-block size; `bias`: the
    variant with the experts' biases (gpt-oss)."""
    ptr = "*" + TYPE_NAMES[dtype]
    for num_tokens in tokens:
        slots = num_tokens * top_k
        block_m = moe.block_m_for(slots, experts)
        blocks = -(-(slots + min(experts, slots) * (block_m - 1)) // block_m)
        for n, k, first in ((2 * inter, hidden, True), (hidden, inter, False)):
            plan = moe.plan_fused_moe(blocks, n, k, top_k, first, not first, block_m, dtype,
                                      target(arch), bias=bias)  # fmt: skip
            yield job_of(plan, arch, dtype, dict(
                a_ptr=ptr, b_ptr=ptr, c_ptr=ptr, weights_ptr="*fp32", sorted_ids_ptr="*i32",
                expert_ids_ptr="*i32", num_padded_ptr="*i32", bias_ptr=ptr if bias else "*fp32",
                num_slots=slots, stride_am=k,
                stride_be=n * k, stride_bn=k, stride_cm=n,
            ))  # fmt: skip


def moe_w8a16_jobs(hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
                   arch: int, tokens=MOE_TOKENS, groups=MOE_W8A16_GROUPS):  # fmt: skip
    """moe_jobs on FP8 experts: codes [E, N, K] as bytes, fp32 scales [E, N, groups]."""
    ptr = "*" + TYPE_NAMES[dtype]
    for num_tokens, group_k in itertools.product(tokens, groups):
        slots = num_tokens * top_k
        block_m = moe.block_m_for(slots, experts)
        blocks = -(-(slots + min(experts, slots) * (block_m - 1)) // block_m)
        for n, k, first in ((2 * inter, hidden, True), (hidden, inter, False)):
            plan = moe.plan_fused_moe(blocks, n, k, top_k, first, not first, block_m, dtype,
                                      target(arch), group_k)  # fmt: skip
            g = -(-k // group_k) if group_k else 1
            yield job_of(plan, arch, dtype, dict(
                a_ptr=ptr, b_ptr="*u8", scale_ptr="*fp32", c_ptr=ptr, weights_ptr="*fp32",
                sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_padded_ptr="*i32",
                num_slots=slots, stride_am=k, stride_be=n * k, stride_bn=k, stride_se=n * g,
                stride_sn=g, stride_cm=n,
            ))  # fmt: skip


def swiglu_oai_jobs(inter: int, dtype: torch.dtype, arch: int, swiglu=GPT_OSS_SWIGLU):
    """gpt-oss's clamped SwiGLU between the fused MoE's GEMMs: slot rows of [gate | up]."""
    ptr = "*" + TYPE_NAMES[dtype]
    plan = activation.plan_swiglu_oai(4096, inter, *swiglu)
    yield job_of(
        plan, arch, dtype, dict(x_ptr=ptr, out_ptr=ptr, stride_x=2 * inter, stride_o=inter)
    )


def gpt_oss_jobs(arch: int, dtype: torch.dtype, quick: bool = False):
    """gpt-oss's own variants: attention with sinks (decode with one split, a few and the most;
    prefill), the fused MoE with biases and the clamped SwiGLU."""
    head_dim, group = GPT_OSS_ATTENTION
    for block_size in BLOCK_SIZES[:1] if quick else BLOCK_SIZES:
        yield from decode_jobs(head_dim, group, block_size, dtype, arch, sinks=True)
        yield from prefill_jobs(head_dim, group, block_size, dtype, arch, sinks=True)
    for size in GPT_OSS_MOE_SIZES[:1] if quick else GPT_OSS_MOE_SIZES:
        yield from moe_jobs(*size, dtype, arch, bias=True)
    yield from swiglu_oai_jobs(GPT_OSS_MOE_SIZES[0][1], dtype, arch)


def w8a16_jobs(dtype: torch.dtype, arch: int, tokens=W8A16_TOKENS, groups=W8A16_GROUPS):
    """The FP8 linear layer as w8a16_linear_triton launches it: contiguous rows, codes [N, K]
    as bytes, fp32 scales [N, groups]."""
    ptr, (n, k) = "*" + TYPE_NAMES[dtype], W8A16_SHAPE
    for m, (affine, group_k), bias in itertools.product(tokens, groups, (False, True)):
        plan = w8a16.plan_w8a16(m, n, group_k, bias, dtype, target(arch), affine)
        yield job_of(plan, arch, dtype, dict(
            x_ptr=ptr, w_ptr="*u8", scale_ptr="*fp32", offset_ptr="*fp32",
            bias_ptr=ptr if bias else "*fp32",
            out_ptr=ptr, M=m, N=n, K=k, stride_xm=k, stride_wn=k,
            stride_sn=-(-k // group_k) if group_k else 1, stride_om=n,
        ))  # fmt: skip


# bench/first_contact.py's launches on top of the serving shape (32/8/128 bf16): its kernel sets,
# and its HF check's tiny fp32 Llama (3/1/64, hidden 192, intermediate 384).
FIRST_CONTACT_SETS = (
    (32, 8, 128, torch.bfloat16),
    (32, 8, 128, torch.float16),
    (9, 3, 64, torch.bfloat16),
    (9, 3, 64, torch.float32),
    (3, 1, 64, torch.float32),
)
# (num_seqs, context): the kernel checks (5 sequences up to 2100 tokens, 2 padding columns), the
# attention section (batch 64/16/1 on 2k and 4096-wide tables), the tiny Llama (256 tokens).
FIRST_CONTACT_DECODES = ((5, 2144), (64, 2048), (64, 4096), (16, 2048), (16, 4096), (1, 2048),
                         (1, 4096), (1, 256), (4, 256))  # fmt: skip
FIRST_CONTACT_PREFILLS = ((5, 447), (1, 21), (64, 8192))


def first_contact_jobs(arch: int):
    """The plans bench/first_contact.py launches: decode with one split, the heuristic's and the
    most, prefill, store, rotary and the elementwise kernels of each set."""
    for heads, kv_heads, dim, dtype in FIRST_CONTACT_SETS:
        group, kv = heads // kv_heads, {"num_kv_heads": kv_heads}
        splits = (1, None, decode.MAX_SPLITS)
        yield from decode_jobs(dim, group, 16, dtype, arch, **kv, batches=FIRST_CONTACT_DECODES,
                               splits=splits)  # fmt: skip
        yield from prefill_jobs(dim, group, 16, dtype, arch, **kv, batches=FIRST_CONTACT_PREFILLS)
        yield from store_jobs(dim, 16, dtype, arch, **kv)
        yield from rope_jobs(dim, group, 16, dtype, arch, **kv)
        yield from elementwise_jobs(heads * dim, heads * dim // 2, dtype, arch)
    yield from elementwise_jobs(192, 384, torch.float32, arch)
    yield from elementwise_jobs(4096, 14336, torch.bfloat16, arch)


def target(arch: int) -> Target:
    return Target(arch, ARCHS[arch].num_sms)


def all_jobs(archs, quick: bool = False, first_contact: bool = False) -> list[Job]:
    """Every distinct compile (quick: head_dim 128, GQA 4, bf16, block size 16; first_contact:
    and bench/first_contact.py's plans)."""
    axes = (
        ((128,), (4,), (16,), (torch.bfloat16,))
        if quick
        else (HEAD_DIMS, GROUPS, BLOCK_SIZES, DTYPES)
    )
    jobs = {}  # a dict: duplicates go, first-seen order stays
    for arch, (d, g, bs, dt) in itertools.product(archs, itertools.product(*axes)):
        for job in (
            *decode_jobs(d, g, bs, dt, arch),
            *prefill_jobs(d, g, bs, dt, arch),
            *store_jobs(d, bs, dt, arch),
            *rope_jobs(d, g, bs, dt, arch),
        ):
            jobs.setdefault(job, None)
    sizes = LAYER_SIZES[1:2] if quick else LAYER_SIZES
    for arch, (hidden, inter), dt in itertools.product(archs, sizes, axes[3]):
        for job in elementwise_jobs(hidden, inter, dt, arch):
            jobs.setdefault(job, None)
    moe_sizes = MOE_SIZES[:1] if quick else MOE_SIZES
    for arch, size, dt in itertools.product(archs, moe_sizes, axes[3]):
        for job in (*moe_jobs(*size, dt, arch), *moe_w8a16_jobs(*size, dt, arch)):
            jobs.setdefault(job, None)
    for arch, dt in itertools.product(archs, axes[3]):
        for job in w8a16_jobs(dt, arch):
            jobs.setdefault(job, None)
    for arch, dt in itertools.product(archs, axes[3]):
        for job in gpt_oss_jobs(arch, dt, quick):
            jobs.setdefault(job, None)
    for arch in archs if first_contact else ():
        for job in first_contact_jobs(arch):
            jobs.setdefault(job, None)
    return list(jobs)


# --- compiling and assembling ------------------------------------------------------------------


def compile_job(job: Job) -> Row:
    """Compile `job` and read registers, spills and shared memory; errors become a Row."""
    warnings.filterwarnings(
        "ignore", message="TRITON_DEFAULT_FP_FUSION"
    )  # the default (on) is what launches get
    fn = KERNELS[job.kernel]
    signature = {name: "constexpr" for name, _ in job.constexprs}
    signature.update({name: type_ for name, type_, _ in job.params})
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, _, aligned in job.params
        if aligned
    }
    source = ASTSource(fn, {n: signature[n] for n in fn.arg_names}, dict(job.constexprs), attrs)
    try:
        compiled = triton.compile(
            source, target=GPUTarget("cuda", job.arch, 32),
            options={"num_warps": job.num_warps, "num_stages": job.num_stages},
        )  # fmt: skip
        regs, stores, loads = assemble(compiled.asm["ptx"], job.arch)
    except Exception as exc:  # noqa: BLE001 - a failed compile is a report row, not a crash
        cause = exc.__cause__ or exc  # a CompilationError's text is the source excerpt
        return Row(
            job,
            error=f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:200]}",
        )
    return Row(job, regs, stores, loads, compiled.metadata.shared)


def assemble(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas_path(arch), "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={ARCHS[arch].name}", src,
               "-o", os.path.join(tmp, "kernel.cubin")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(
            f"{os.path.basename(cmd[0])} exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        )
    return parse_ptxas(proc.stderr)


def ptxas_path(arch: int) -> str:
    # Triton picks ptxas by arch (ptxas-blackwell from sm_90), which allocate registers
    # differently: ask the one that made the cubin.
    return get_ptxas(arch).path


def parse_ptxas(log: str) -> tuple[int, int, int]:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert regs and spills, f"unexpected ptxas -v output:\n{log}"
    return int(regs[1]), int(spills[1]), int(spills[2])


# --- the report ----------------------------------------------------------------------------------

HEADER = ("kernel", "arch", "dtype", "shape", "regs", "spill B (st/ld)", "smem B", "")


def table_row(row: Row) -> tuple[str, ...]:
    job = row.job
    fields = (
        job.kernel.strip("_").removesuffix("_kernel"),
        ARCHS[job.arch].name,
        job.dtype,
        job.shape,
    )
    if row.error:
        return (*fields, "-", "-", "-", "ERROR")
    flag = "FAIL" if row.problems() else "spills" if row.spills() else ""
    return (
        *fields,
        str(row.registers),
        f"{row.spill_stores}/{row.spill_loads}",
        str(row.shared),
        flag,
    )


def format_table(rows: list[Row]) -> str:
    lines = [HEADER, *(table_row(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines
    )


def run(jobs: list[Job], workers: int) -> list[Row]:
    """Compile in `workers` spawned processes (a fresh Triton each), printing progress."""
    rows, start = {}, time.monotonic()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(compile_job, job): job for job in jobs}
        for n, future in enumerate(as_completed(futures), 1):
            row = future.result()
            rows[row.job] = row
            note = "; ".join(row.problems()) or f"{row.registers} regs"
            print(f"[{n}/{len(jobs)} {time.monotonic() - start:5.0f} s] "
                  f"{' '.join(table_row(row)[:4])}: {note}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return [rows[job] for job in jobs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--archs", default="80,90,100", help="compute capabilities, comma-separated"
    )
    parser.add_argument(
        "--quick", action="store_true", help="head_dim 128, GQA 4, bf16, block size 16 only"
    )
    parser.add_argument(
        "--first-contact", action="store_true", help="and bench/first_contact.py's plans"
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="compile processes (this machine: 2 at most)"
    )
    parser.add_argument(
        "--kernels", default="", help="only these kernels' plans, comma-separated (KERNELS' names)"
    )
    args = parser.parse_args(argv)
    archs = [int(a) for a in args.archs.split(",")]
    if not set(archs) <= set(ARCHS):
        parser.error(f"--archs takes {','.join(map(str, ARCHS))}, got {args.archs}")
    jobs = all_jobs(archs, args.quick, args.first_contact)
    if args.kernels:
        wanted = set(args.kernels.split(","))
        if not wanted <= set(KERNELS):
            parser.error(f"--kernels takes names from {', '.join(KERNELS)}, got {args.kernels}")
        jobs = [job for job in jobs if job.kernel in wanted]
    print(
        f"{len(jobs)} distinct compiles for {', '.join(ARCHS[a].name for a in archs)}",
        file=sys.stderr,
    )
    rows = run(jobs, max(1, args.jobs))
    print(format_table(rows))
    failed = [r for r in rows if r.problems()]
    worst = max((r.registers for r in rows if not r.error), default=0)
    for row in failed:
        print(f"FAIL {' '.join(table_row(row)[:4])}: {'; '.join(row.problems())}")
    spilled = sum(r.spills() and not r.problems() for r in rows)
    allowed = f" ({spilled} fp32 plans spill: allowed)" if spilled else ""
    print(f"\n{len(rows)} plans, {len(failed)} failed{allowed}, at most {worst} registers")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
