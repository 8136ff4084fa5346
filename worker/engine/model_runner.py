"""Turns a SchedulerOutput into one forward pass and sampled tokens.

The runner computes and never decides policy: it flattens the scheduled chunks into one batch
(decodes first, then prefill chunks), builds positions / slot_mapping / block tables, runs the
model, computes logits only for the rows that sample, and samples.
"""
from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass

import structlog
import torch

import kernels
from config.settings import Settings
from kernels import fused, gemm, reference
from worker.engine.models.linear import choose_backend
from worker.engine.models.llama import AttentionMetadata
from worker.engine.models.loader import load_model
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledSequence

log = structlog.get_logger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls are ~5x slower than fp32 on these CPUs; on a GPU bf16 is the norm.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def pick_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's element type (settings.cache.dtype)."""
    if name == "auto" or getattr(torch, name) == model_dtype:
        return model_dtype
    if device.type != "cpu" or model_dtype != torch.float32:
        raise ValueError(f"cache.dtype={name} is for fp32 models on the CPU (this one: {model_dtype} on "
                         f"{device.type}); set INFERLINE_CACHE__DTYPE=auto")
    return getattr(torch, name)


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own, advised onto 2 MB pages
    (transparent huge pages, when the host's THP mode is `madvise` or `always`). Decode attention
    reads K/V blocks scattered over the whole cache; on 4 KB pages every 12 KB block is several
    TLB misses (the C kernel, batch 32: 29.5 -> 27.3 ms a step on 2 MB pages). Where THP is off
    the advice is ignored: 4 KB pages, as torch.empty's.

    Every page is written here, once: the memory is the KV budget, taken at start-up (a host that
    cannot give it fails now, not mid-request), and no step pays the first touch of a page (the
    kernel zeroing 2 MB inside a K/V store: ~2% of a decode benchmark's samples, in bursts)."""
    # Private and anonymous (mmap's default, MAP_SHARED, is shmem: THP there follows another setting).
    buf = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape).zero_()  # the tensor keeps the mapping alive


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose next-token logits are sampled
    sampling: list[ScheduledSequence]  # in the order of logits_indices (1 + len(drafts) rows each)


class ModelRunner:
    def __init__(self, settings: Settings):
        self.device = pick_device(settings.model.device)
        self.dtype = pick_dtype(settings.model.dtype, self.device)
        self.block_size = settings.cache.block_size
        self.kv_dtype = pick_kv_dtype(settings.cache.dtype, self.dtype, self.device)
        self.model, self.config, self.tokenizer = load_model(
            settings.model.path, settings.model.load_format, self.dtype, self.device,
            max_positions=settings.model.max_model_len)
        self.max_model_len = min(settings.model.max_model_len,
                                 getattr(self.config, "max_position_embeddings", 1 << 30))
        self.num_blocks = self._num_blocks(settings)
        self.kv_cache = self._allocate_kv_cache()
        self.sampler = Sampler()
        self.owner: object | None = None  # the engine whose blocks the KV cache holds (claim())
        head_dim, num_heads = self._kv_shape()[2], self.config.num_attention_heads
        self.decode_backend = kernels.decode_backend(self.device, self.dtype, settings.model.attention_backend,
                                                     (head_dim, num_heads, self.block_size), self.kv_dtype)
        self.linear_backend = "torch"
        backend = choose_backend(settings.model.cpu_linear) if self.device.type == "cpu" else "torch"
        codes = settings.model.cpu_weight_codes == "auto"
        if backend != "torch" and self.model.pack_linears(backend, codes):
            self.linear_backend = backend
        # weights the C GEMM keeps as 8-bit codes (exact: kernels/gemm.py), of all packed ones
        self.coded_weights = sum(isinstance(p, gemm.CodedWeight) for p in self.model.packed_weights())
        self.fused_ops = settings.model.cpu_fused_ops == "auto" and fused.available(self.device, self.dtype)
        log.info("model ready", device=str(self.device), dtype=str(self.dtype), kv_dtype=str(self.kv_dtype),
                 num_blocks=self.num_blocks,
                 block_size=self.block_size, decode_attention=self.decode_backend, linear=self.linear_backend,
                 coded_weights=self.coded_weights,
                 fused_ops="c" if self.fused_ops else "torch")

    def claim(self) -> object:
        """Make the caller the KV cache's only user; returns its token for run(). An engine built
        on a runner takes it over: the earlier engine's next run() fails loudly instead of
        reading K/V the new one has overwritten (two block managers over one cache)."""
        self.owner = object()
        return self.owner

    # ---- KV cache -----------------------------------------------------------------------------

    def _kv_shape(self) -> tuple[int, ...]:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return (self.block_size, c.num_key_value_heads, head_dim)

    def bytes_per_block(self) -> int:
        per_layer = 2 * torch.Size(self._kv_shape()).numel() * self.kv_dtype.itemsize
        return per_layer * self.config.num_hidden_layers

    def _num_blocks(self, settings: Settings) -> int:
        if settings.cache.num_blocks:
            return settings.cache.num_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * settings.cache.gpu_memory_utilization
        else:
            budget = settings.cache.kv_memory_gb * 1e9
        return max(1, int(budget // self.bytes_per_block()))

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.config.num_hidden_layers, 2, self.num_blocks, *self._kv_shape())
        if self.device.type == "cpu":
            cache = huge_page_tensor(shape, self.kv_dtype)
        else:
            cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        return [(cache[i, 0], cache[i, 1]) for i in range(shape[0])]

    # ---- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence], owner: object | None = None) -> list[list[int]]:
        """Run one forward over `scheduled`; for each chunk that samples, in the order of
        `[s for s in scheduled if s.samples]`, its sampled tokens: one, or with drafts one per
        row (the argmax after each known token and draft, for spec_decode.accept to check).
        `owner`: claim()'s token, if any."""
        if owner is not None and owner is not self.owner:
            raise RuntimeError("this engine's ModelRunner was claimed by a newer LLMEngine: "
                               "its KV cache no longer holds this engine's blocks")
        batch = self.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
        if not batch.sampling:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = [s.seq for s in batch.sampling for _ in range(1 + len(s.spec_token_ids))]
        tokens = iter(self.sampler(logits, [s.sampling for s in rows], [s.prompt_token_ids for s in rows],
                                   [s.output_token_ids for s in rows], [s.generator for s in rows]))
        # The batch put decodes first; hand the tokens back in the scheduler's order.
        by_seq = {id(s.seq): [next(tokens) for _ in range(1 + len(s.spec_token_ids))] for s in batch.sampling}
        return [by_seq[id(s.seq)] for s in scheduled if s.samples]

    def prepare(self, scheduled: list[ScheduledSequence]) -> Batch:
        # Decodes (one new token) first: they go to the decode kernel as one block, shortest
        # context first (the CPU path attends in chunks of similar length: no reordering there).
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens)
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slots, logits_indices = [], [], [], []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids += (seq.token_ids + s.spec_token_ids)[start:end] if s.spec_token_ids else seq.token_ids[start:end]
            positions += range(start, end)
            table, bs = seq.block_table, self.block_size
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if s.samples:  # the last row; with drafts, the last known token's row and theirs
                logits_indices += range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids))
        positions = self._tensor(positions, torch.long)
        meta = AttentionMetadata(self._tensor(slots, torch.long), len(decodes), None, None, None, None, None,
                                 decode_backend=self.decode_backend, fused_ops=self.fused_ops)
        if self.decode_backend == "cpu" and prefills:  # one C call attends every row
            meta.token_block_tables, meta.token_cu_seqlens, meta.token_context_lens = \
                self._token_tables(ordered, positions)
        else:
            self._split_metadata(meta, decodes, prefills)
        sampling = [s for s in ordered if s.samples]
        return Batch(self._tensor(input_ids, torch.long), positions, meta,
                     self._tensor(logits_indices, torch.long), sampling)

    def _token_tables(self, ordered: list[ScheduledSequence], positions: torch.Tensor):
        """For the C kernel, prompt rows too attend as decodes do: row t over its own causal
        context, the first positions[t] + 1 tokens of its sequence, with the bits a decode of it
        gets (K/V blocks read in place: no gathered copy, as SDPA needs; a prompt chunk's blocks
        once per tile of 16 rows). So a prompt's rows are computed exactly as its decode steps
        will be, and a sequence recomputed after preemption gets its first pass's tokens back.
        Returns (block tables, a row per sequence; cu_seqlens; each row's context length)."""
        return self._block_tables(ordered), self._cu_seqlens(ordered), (positions + 1).to(torch.int32)

    def _split_metadata(self, meta: AttentionMetadata, decodes, prefills) -> None:
        """Decode rows for the decode kernel, prompt chunks for the prefill kernel (or SDPA)."""
        if decodes:
            meta.decode_block_tables = self._block_tables(decodes)
            meta.decode_context_lens = self._context_lens(decodes)
            if self.decode_backend == "torch":  # the decode index math, once for all layers
                meta.decode_plan = reference.plan_decode(meta.decode_block_tables, meta.decode_context_lens,
                                                         self.block_size, self.config.num_key_value_heads)
        if prefills:
            meta.prefill_block_tables = self._block_tables(prefills)
            meta.prefill_context_lens = self._context_lens(prefills)
            meta.prefill_cu_seqlens_q = self._cu_seqlens(prefills)

    def _cu_seqlens(self, chunks: list[ScheduledSequence]) -> torch.Tensor:
        """int32 [len(chunks) + 1]: chunk i's rows are cu[i] .. cu[i + 1] - 1 of the flat batch."""
        cu = [0]
        for s in chunks:
            cu.append(cu[-1] + s.num_new_tokens)
        return self._tensor(cu, torch.int32)

    def _block_tables(self, chunks: list[ScheduledSequence]) -> torch.Tensor:
        width = max(len(s.seq.block_table) for s in chunks)
        rows = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in chunks]
        return self._tensor(rows, torch.int32)

    def _context_lens(self, chunks: list[ScheduledSequence]) -> torch.Tensor:
        return self._tensor([s.seq.num_computed_tokens + s.num_new_tokens for s in chunks], torch.int32)

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t
