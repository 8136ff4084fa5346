"""Start-up compiles: every Triton binary the loaded model can launch, compiled before the worker
is ready. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
import triton

from inferline.kernels.attention import StepTables
from inferline.kernels.triton.decode import MAX_SPLITS, TILE_ELEMENTS, choose_splits, split_tokens
from inferline.kernels.triton.launch import Target
from inferline.worker.engine.models.linear import fp8_prompt_tokens
from inferline.worker.engine.models.moe import warmup_prompt_tokens

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DecodeShape:
    num_seqs: int
    width: int  # blocks in the widest block table


@dataclass
class WarmupReport:
    decode_shapes: list[DecodeShape]
    seconds: float


def decode_shapes(
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    max_num_seqs: int,
    target: Target,
) -> list[DecodeShape]:
    """One batch shape per distinct decode plan, the smallest found (few split counts exist)."""
    block_n = max(16, TILE_ELEMENTS // triton.next_power_of_2(head_dim))
    wishes = {}  # choose_splits' wish -> the fewest sequences that make it
    for num_seqs in range(1, max_num_seqs + 1):
        wishes.setdefault(
            choose_splits(num_seqs, num_kv_heads, MAX_SPLITS * 256 * 16, target.num_sms), num_seqs
        )
    shapes: dict[int, DecodeShape] = {}  # SPLITS_P2 (1: direct) -> a shape
    for width in range(1, max_blocks + 1):
        max_len = width * block_size
        for num_seqs in wishes.values():
            wish = choose_splits(num_seqs, num_kv_heads, max_len, target.num_sms)
            num_splits, _ = split_tokens(max_len, wish, block_n)
            shapes.setdefault(triton.next_power_of_2(num_splits), DecodeShape(num_seqs, width))
    return [shapes[k] for k in sorted(shapes)]


def warm_up(runner, max_num_seqs: int) -> WarmupReport:
    """Run the model once on a prompt and once per decode plan (a ModelRunner on Triton)."""
    from inferline.kernels.triton.launch import target_of

    start = time.monotonic()
    config = runner.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_blocks = -(-runner.max_model_len // runner.block_size)
    shapes = decode_shapes(
        config.num_key_value_heads,
        head_dim,
        runner.block_size,
        max_blocks,
        max_num_seqs,
        target_of(runner.device),
    )
    with torch.inference_mode():
        _forward(runner, [2], 0, 1)  # one prompt of two tokens
        # the fused-MoE and W8A16 kernels' other row-block sizes
        tokens = max(warmup_prompt_tokens(runner.model), fp8_prompt_tokens(runner.model))
        if tokens:
            _forward(runner, [tokens], 0, -(-tokens // runner.block_size))
        for shape in shapes:
            _forward(runner, [1] * shape.num_seqs, shape.num_seqs, shape.width)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report = WarmupReport(shapes, time.monotonic() - start)
    log.info("kernels warmed", decode_plans=len(shapes), seconds=round(report.seconds, 2))
    return report


def _forward(runner, new_tokens: list[int], num_decodes: int, width: int) -> None:
    dev, i32 = runner.device, torch.int32
    num_tokens, num_seqs = sum(new_tokens), len(new_tokens)
    lens = torch.tensor(new_tokens, dtype=i32, device=dev)
    cu = torch.zeros(num_seqs + 1, dtype=i32, device=dev)
    cu[1:] = lens.cumsum(0)
    tables = torch.zeros(num_seqs, width, dtype=i32, device=dev)
    step = StepTables(
        torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
        torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        lens,
        cu,
        num_decodes,
        lambda first, stop: tables[first:stop],
    )
    meta = runner.attention.prepare(step, fused_ops=runner.backends.fused_ops)
    runner.model(
        torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        step.positions,
        runner.kv_cache,
        meta,
    )
