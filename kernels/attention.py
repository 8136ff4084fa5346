"""Paged attention backends as objects: `prepare` once a step, `store_kv` and `forward` once a
layer. design: docs/architecture.md#kernels
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from inferline.kernels import reference
from inferline.kernels.cpu import attention as cpu_attention


@dataclass
class StepTables:
    """One step's batch as the attention sees it: the first `num_decodes` sequences decode one
    token each, the rest are prompt chunks."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each token's K/V goes
    positions: torch.Tensor  # int64 [num_tokens]
    context_lens: torch.Tensor  # int32 [num_seqs]: context once this step's tokens are stored
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: sequence i owns rows cu[i] .. cu[i + 1] - 1
    num_decodes: int
    block_tables: Callable[[int, int], torch.Tensor]  # (first, stop) -> int32 rows
    max_decode_context: int | None = None  # on the host; None: as long as the tables hold
    # int32 [1], persistent (a padded decode step's): the host writes the split length each step
    decode_split_len: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What every layer gets for a step; each backend's subclass adds its own fields."""

    backend: "AttentionBackend"
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int  # the first rows are decodes, one token each
    fused_ops: str = "torch"  # kernels/fused.py's `ops`: c | triton | torch


@dataclass
class SplitMetadata(AttentionMetadata):
    """Decode rows for a decode kernel, prompt chunks for a prefill kernel."""

    decode_block_tables: torch.Tensor | None = None  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor | None = None  # int32 [num_prefills, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor | None = None  # int32 [num_prefills + 1]
    prefill_context_lens: torch.Tensor | None = None  # int32 [num_prefills]
    decode_plan: reference.DecodePlan | None = None  # torch: the decode index math, once a step
    window_plans: dict | None = None  # torch: the decode plan of each sliding window, made lazily
    decode_split_len: torch.Tensor | None = None  # triton: int32 [1], tokens per split
    decode_reduce: bool = True  # triton: False when every context fits one split (no stage 2)


@dataclass
class TokenMetadata(AttentionMetadata):
    """Every row attends as a decode over its own causal context (the C kernel)."""

    block_tables: torch.Tensor | None = None  # int32 [num_seqs, max_blocks]
    cu_seqlens: torch.Tensor | None = None  # int32 [num_seqs + 1]
    context_lens: torch.Tensor | None = None  # int32 [num_tokens]: positions + 1


class AttentionBackend:
    """The interface: `prepare` once a step, `store_kv` and `forward` once a layer."""

    name = ""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int | None = None):
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim

    def prepare(self, step: StepTables, fused_ops: str = "torch") -> AttentionMetadata:
        raise NotImplementedError

    def decode_split_len(
        self, num_rows: int, max_blocks: int, max_context: int, num_seqs: int, device
    ) -> int | None:
        """Tokens per split of a decode step of `num_seqs` sequences, the longest `max_context`,
        on a grid of `num_rows` rows of tables `max_blocks` wide; None: this backend has none."""
        return None

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """Write k, v [num_tokens, num_kv_heads, head_dim] at slot_mapping (negative: skipped)."""
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] (all K/V stored) -> the same shape. `window`: the
        layer's sliding window (a query at position p sees keys p - window < j <= p), None: all.
        `softcap`: the scaled scores become cap * tanh(s / cap) (Gemma 2), 0: off. `sinks`: fp32
        [num_heads], a logit per head that joins each softmax and is dropped (gpt-oss), None:
        none."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class _SplitBackend(AttentionBackend):
    """Decodes to `_decode`, prompt chunks to `_prefill`, concatenated in batch order."""

    def prepare(self, step: StepTables, fused_ops: str = "torch") -> SplitMetadata:
        nd, num_seqs = step.num_decodes, step.context_lens.shape[0]
        meta = SplitMetadata(self, step.slot_mapping, nd, fused_ops)
        if nd:
            meta.decode_block_tables = step.block_tables(0, nd)
            meta.decode_context_lens = step.context_lens[:nd]
        if nd < num_seqs:
            cu = step.cu_seqlens_q[nd:]
            meta.prefill_block_tables = step.block_tables(nd, num_seqs)
            meta.prefill_context_lens = step.context_lens[nd:]
            meta.prefill_cu_seqlens_q = cu - cu[:1] if nd else cu
        return meta

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: SplitMetadata,
        scale: float,
        window: int | None = None,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        nd, args = meta.num_decode_tokens, (scale, window, softcap, sinks)
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta, *args)
        prefill = self._prefill(q[nd:], k_cache, v_cache, meta, *args)
        if nd == 0:
            return prefill
        return torch.cat((self._decode(q[:nd], k_cache, v_cache, meta, *args), prefill))

    def _decode(
        self, q, k_cache, v_cache, meta: SplitMetadata, scale, window=None, softcap=0.0, sinks=None
    ):
        raise NotImplementedError

    def _prefill(
        self, q, k_cache, v_cache, meta: SplitMetadata, scale, window=None, softcap=0.0, sinks=None
    ):
        raise NotImplementedError


class TorchAttention(_SplitBackend):
    name = "torch"

    def prepare(self, step: StepTables, fused_ops: str = "torch") -> SplitMetadata:
        meta = super().prepare(step, fused_ops)
        if meta.decode_block_tables is not None:  # the decode index math, once for all layers
            meta.decode_plan = reference.plan_decode(
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.block_size,
                self.num_kv_heads,
            )
        return meta

    def _decode(
        self, q, k_cache, v_cache, meta: SplitMetadata, scale, window=None, softcap=0.0, sinks=None
    ):
        return reference.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            plan=self._window_plan(meta, window),
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

    def _window_plan(self, meta: SplitMetadata, window: int | None) -> reference.DecodePlan:
        """The step's plan for this window: made by the first layer that has it, shared after."""
        if not window:
            return meta.decode_plan
        meta.window_plans = meta.window_plans or {}
        if window not in meta.window_plans:
            meta.window_plans[window] = reference.plan_decode(
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.block_size,
                self.num_kv_heads,
                window=window,
            )
        return meta.window_plans[window]

    def _prefill(
        self, q, k_cache, v_cache, meta: SplitMetadata, scale, window=None, softcap=0.0, sinks=None
    ):
        return reference.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


class TritonAttention(_SplitBackend):
    name = "triton"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int | None = None):
        assert head_dim, "the Triton attention needs head_dim (its split length depends on it)"
        super().__init__(block_size, num_kv_heads, head_dim)
        # TRITON_INTERPRET must be set before triton is imported.
        from inferline.kernels.triton.decode import paged_decode_attention_triton
        from inferline.kernels.triton.prefill import paged_prefill_attention_triton
        from inferline.kernels.triton.store import store_kv_triton

        self._decode_kernel, self._prefill_kernel = (
            paged_decode_attention_triton,
            paged_prefill_attention_triton,
        )
        self._store_kernel = store_kv_triton

    def prepare(self, step: StepTables, fused_ops: str = "torch") -> SplitMetadata:
        """As the split backends, plus the decode rows' split length, once a step: the padded
        step's buffer as it stands, else a fresh one for the step's longest context."""
        meta = super().prepare(step, fused_ops)
        if meta.decode_block_tables is None:
            return meta
        if step.decode_split_len is not None:  # stage 2 stays: a graph replays it every step
            meta.decode_split_len = step.decode_split_len
            return meta
        nd, width = meta.num_decode_tokens, meta.decode_block_tables.shape[1]
        longest = step.max_decode_context
        longest = width * self.block_size if longest is None else longest
        device = meta.decode_context_lens.device
        split_len = self.decode_split_len(nd, width, longest, nd, device)
        meta.decode_split_len = torch.full((1,), split_len, dtype=torch.int32, device=device)
        meta.decode_reduce = longest > split_len
        return meta

    def decode_split_len(
        self, num_rows: int, max_blocks: int, max_context: int, num_seqs: int, device
    ) -> int:
        from inferline.kernels.triton.decode import choose_split_len, decode_grid
        from inferline.kernels.triton.launch import target_of

        num_sms = target_of(device).num_sms
        num_splits, _, block_n = decode_grid(
            num_rows, self.num_kv_heads, self.head_dim, max_blocks * self.block_size, num_sms
        )
        return choose_split_len(
            max_context, num_seqs, self.num_kv_heads, num_splits, block_n, num_sms
        )

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._store_kernel(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: SplitMetadata,
        scale: float,
        window: int | None = None,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each kernel writes its rows of one output: a mixed step needs no concatenation."""
        nd, out = meta.num_decode_tokens, torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks, out[:nd])
        if nd < q.shape[0]:
            self._prefill(q[nd:], k_cache, v_cache, meta, scale, window, softcap, sinks, out[nd:])
        return out

    def _decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: SplitMetadata,
        scale,
        window=None,
        softcap=0.0,
        sinks=None,
        out=None,
    ) -> torch.Tensor:
        return self._decode_kernel(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            split_len=meta.decode_split_len,
            reduce=meta.decode_reduce,
            window=window,
            softcap=softcap,
            sinks=sinks,
            out=out,
        )

    def _prefill(
        self,
        q,
        k_cache,
        v_cache,
        meta: SplitMetadata,
        scale,
        window=None,
        softcap=0.0,
        sinks=None,
        out=None,
    ) -> torch.Tensor:
        return self._prefill_kernel(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
            out=out,
        )


class CpuAttention(AttentionBackend):
    """The C kernel: every row attends as a decode over its causal context."""

    name = "cpu"

    def prepare(self, step: StepTables, fused_ops: str = "torch") -> TokenMetadata:
        num_seqs = step.context_lens.shape[0]
        if step.num_decodes == num_seqs:
            return TokenMetadata(
                self,
                step.slot_mapping,
                num_seqs,
                fused_ops,
                step.block_tables(0, num_seqs),
                None,
                step.context_lens,
            )
        return TokenMetadata(
            self,
            step.slot_mapping,
            step.num_decodes,
            fused_ops,
            step.block_tables(0, num_seqs),
            step.cu_seqlens_q,
            (step.positions + 1).to(torch.int32),
        )

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: TokenMetadata,
        scale: float,
        window: int | None = None,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return cpu_attention.paged_decode_attention_cpu(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            meta.cu_seqlens,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


BACKENDS = {b.name: b for b in (TritonAttention, CpuAttention, TorchAttention)}


def make_attention(
    name: str, block_size: int, num_kv_heads: int, head_dim: int | None = None
) -> AttentionBackend:
    """The backend kernels.backends.select_attention chose (never `auto`); Triton needs
    head_dim."""
    assert name in BACKENDS, f"attention backend must be one of {sorted(BACKENDS)}, got {name!r}"
    return BACKENDS[name](block_size, num_kv_heads, head_dim)
