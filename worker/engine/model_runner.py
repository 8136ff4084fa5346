"""Turns a SchedulerOutput into one forward pass and sampled tokens; computes, never decides
policy. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import structlog
import torch

from inferline.config.settings import Settings
from inferline.kernels.attention import AttentionBackend, AttentionMetadata, make_attention
from inferline.kernels.backends import (
    KernelBackends,
    ModelShape,
    linear_candidates,
    select_backends,
)
from inferline.kernels.cpu import gemm
from inferline.kernels.triton.launch import interpreting
from inferline.worker.engine.cuda_graphs import CaptureReport, DecodeGraphs
from inferline.worker.engine.device import (  # noqa: F401 (huge_page_tensor is imported from here)
    free_device_memory,
    host_copy,
    huge_page_tensor,
    tensor_to_device,
    kv_cache_tensor,
    num_kv_blocks,
    pick_cuda_graphs,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
    start_host_copy,
)
from inferline.worker.engine.models.calibration import Calibration, choose_linear_backend
from inferline.worker.engine.models.llama import length_limit
from inferline.worker.engine.models.loader import load_model
from inferline.worker.engine.overlap import pending_rows
from inferline.worker.engine.padded_decode import PaddedDecode, capture_sizes
from inferline.worker.engine.sampler import Sampler, SamplerOutput
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.step_inputs import StepBuilder
from inferline.worker.engine.structured_output import TokenBitmask
from inferline.worker.engine.warmup import WarmupReport, warm_up

log = structlog.get_logger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None  # None in a padded decode step
    logits_indices: torch.Tensor  # rows whose next-token logits are sampled
    sampling: list[ScheduledSequence]  # in logits_indices order (1 + len(drafts) rows each)
    ordered: list[ScheduledSequence]  # every chunk, in input order (decodes first)
    bucket: int | None = None  # a decode-only step padded to this many rows


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled ids, on their way to the host."""

    samples: list[ScheduledSequence]  # the chunks that sample, in the scheduler's order
    rows_of: dict[int, int]  # id(seq) -> its first row in token_ids
    token_ids: torch.Tensor | None = None  # int64 [rows], on the device; None: nothing sampled
    host_ids: torch.Tensor | None = None  # token_ids' host copy, valid once `ready` is done
    ready: object | None = None  # a CUDA event; None: host_ids is valid now
    logprobs: list[dict | None] | None = None  # per row


class ModelRunner:
    def __init__(self, settings: Settings):
        self.device = pick_device(settings.model.device)
        self.dtype = pick_dtype(settings.model.dtype, self.device)
        self.block_size = settings.cache.block_size
        self.kv_dtype = pick_kv_dtype(settings.cache.dtype, self.dtype, self.device)
        self.model, self.config, self.tokenizer = load_model(
            settings.model.path,
            settings.model.load_format,
            self.dtype,
            self.device,
            max_positions=settings.model.max_model_len,
            weight_codes=self._weight_codes(settings),
            gguf_levels=self._gguf_levels(settings),
        )
        self.max_model_len = min(settings.model.max_model_len, length_limit(self.config))
        self.num_blocks = self._num_blocks(settings)
        self.kv_cache = self._allocate_kv_cache()
        self.sampler = Sampler()
        self.token_bitmask = TokenBitmask(
            self.config.vocab_size, self.device, budget_s=settings.structured.mask_budget_ms / 1000
        )
        self.owner: object | None = None  # the engine whose blocks the KV cache holds
        self.backends = self._select_backends(settings)
        self.cuda_graphs = pick_cuda_graphs(
            settings.model.cuda_graphs, self.device.type, self.backends.attention
        )
        block_size, num_kv_heads, head_dim = self._kv_shape()
        self.attention: AttentionBackend = make_attention(
            self.backends.attention, block_size, num_kv_heads, head_dim
        )
        copy = host_copy(self.device.type)
        self.step_builder = StepBuilder(
            self.block_size,
            -(-self.max_model_len // self.block_size),
            self._to_device,
            pin_memory=copy.pin_memory,
        )
        codes = settings.model.cpu_weight_codes == "auto"
        self.linear_calibration = self._calibrate_linear(settings, codes)
        self.backends = replace(self.backends, linear=self.linear_calibration.backend)
        if self.backends.linear != "torch":
            packed = self.model.pack_linears(self.backends.linear, codes)
            assert packed, f"{self.backends.linear} could not pack this model's weights"
        # weights the C GEMM keeps as exact 8-bit codes
        self.coded_weights = sum(
            isinstance(p, gemm.CodedWeight) for p in self.model.packed_weights()
        )
        log.info(
            "model ready",
            device=str(self.device),
            dtype=str(self.dtype),
            kv_dtype=str(self.kv_dtype),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            attention=self.backends.attention,
            triton_target=self.backends.triton_target,
            linear=self.backends.linear,
            fused_ops=self.backends.fused_ops,
            coded_weights=self.coded_weights,
            linear_timed={k: round(v * 1e6, 2) for k, v in self.linear_calibration.seconds.items()}
            or None,
            linear_cached=self.linear_calibration.cached,
        )
        # Compile every Triton binary this model can launch before the worker is ready.
        self.warmup: WarmupReport | None = None
        if self.backends.triton_target == "cuda":
            self.warmup = warm_up(self, settings.scheduler.max_num_seqs)
        self.padded_decode: PaddedDecode | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_capture: CaptureReport | None = None
        if self.cuda_graphs != "off":
            self.padded_decode = self._padded_decode(settings.scheduler.max_num_seqs)
        if (
            self.cuda_graphs == "capture"
        ):  # after the warm-up: every binary a graph launches is compiled
            self.decode_graphs = DecodeGraphs(self.padded_decode)
            self.graph_capture = self.decode_graphs.capture_all()

    def _weight_codes(self, settings: Settings) -> bool:
        """FP8 checkpoints keep their codes where the W8A16 Triton kernel runs: on CUDA, and under
        the interpreter with the Triton attention (as on CUDA); the CPU dequantizes once. (A
        GGUF's exact levels stay codes on CUDA only.)"""
        triton_here = interpreting() and settings.model.attention_backend == "triton"
        wanted = settings.model.gpu_weight_codes == "auto"
        return wanted and (self.device.type == "cuda" or triton_here)

    def _gguf_levels(self, settings: Settings) -> bool:
        """A GGUF's exact uint8 levels stay codes for the W8A16 kernel on CUDA only: not under the
        interpreter, where the kernel takes seconds a layer-step at SmolLM2's sizes
        (tests/gguf_engine_cases.py runs them there as on CUDA, on a tiny model)."""
        return self.device.type == "cuda" and settings.model.gpu_weight_codes == "auto"

    def _padded_decode(self, max_num_seqs: int) -> PaddedDecode:
        return PaddedDecode(
            self.model,
            self.kv_cache,
            self.attention,
            self.backends.fused_ops,
            capture_sizes(max_num_seqs),
            self.step_builder.rows.max_blocks,
            self.config.vocab_size,
            self.dtype,
            self.device,
        )

    def _select_backends(self, settings: Settings) -> KernelBackends:
        block_size, num_kv_heads, head_dim = self._kv_shape()
        shape = ModelShape(head_dim, self.config.num_attention_heads, num_kv_heads, block_size)
        m = settings.model
        return select_backends(
            self.device,
            self.dtype,
            self.kv_dtype,
            shape,
            m.attention_backend,
            m.cpu_linear,
            m.cpu_fused_ops,
        )

    def _calibrate_linear(self, settings: Settings, codes: bool) -> Calibration:
        """`cpu_linear=auto`: the fastest candidate timed on this model; else the setting's."""
        candidates = linear_candidates(self.device, self.dtype, settings.model.cpu_linear)
        if not settings.model.cpu_linear_calibrate:
            candidates = candidates[:1]
        return choose_linear_backend(self.model, candidates, codes)

    def claim(self) -> object:
        """Make the caller the KV cache's only user and return its token for run(); an older
        engine's run() then fails instead of reading overwritten K/V."""
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
        cache = settings.cache  # after the model loaded: free memory is what is left for K/V
        return num_kv_blocks(
            self.bytes_per_block(),
            self.device.type,
            num_blocks=cache.num_blocks,
            kv_memory_gb=cache.kv_memory_gb,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            free_bytes=free_device_memory(self.device),
        )

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.config.num_hidden_layers, 2, self.num_blocks, *self._kv_shape())
        cache = kv_cache_tensor(shape, self.kv_dtype, self.device)
        return [(cache[i, 0], cache[i, 1]) for i in range(shape[0])]

    # ---- one step -------------------------------------------------------------------------------

    def run(
        self, scheduled: list[ScheduledSequence], owner: object | None = None
    ) -> list[SamplerOutput]:
        """One forward over `scheduled`: for each chunk that samples, in order, its sampled tokens
        (and logprobs); with drafts, one per row. `owner`: claim()'s token."""
        return self.resolve(self.launch(scheduled, owner))

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledSequence],
        owner: object | None = None,
        in_flight: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """Prepare, forward and sample on the device, then start the sampled ids' copy to the
        host; no wait for the device. Decodes whose input is PENDING take it from `in_flight`'s
        sampled ids (worker/engine/overlap.py)."""
        if owner is not None and owner is not self.owner:
            raise RuntimeError(
                "this engine's ModelRunner was claimed by a newer LLMEngine: "
                "its KV cache no longer holds this engine's blocks"
            )
        samples = [s for s in scheduled if s.samples]
        batch = self.prepare(scheduled)
        if in_flight is not None:
            self._take_pending(batch, in_flight)
        logits = self._forward(batch)
        if logits is None:
            return LaunchedStep(samples, {})
        token_ids, logprobs = self._sample(batch, logits)
        host_ids, ready = start_host_copy(token_ids)
        rows_of, first = {}, 0
        for s in batch.sampling:
            rows_of[id(s.seq)] = first
            first += 1 + len(s.spec_token_ids)
        return LaunchedStep(samples, rows_of, token_ids, host_ids, ready, logprobs)

    def resolve(self, step: LaunchedStep) -> list[SamplerOutput]:
        """A launched step's tokens (run()'s list), once the device has sampled them."""
        if step.ready is not None:
            step.ready.synchronize()
        if step.host_ids is None:
            return []
        tokens = step.host_ids.tolist()
        out = []
        for s in step.samples:
            first, num_rows = step.rows_of[id(s.seq)], 1 + len(s.spec_token_ids)
            rows = slice(first, first + num_rows)
            out.append(SamplerOutput(tokens[rows], step.logprobs[rows]))
        return out

    def _take_pending(self, batch: Batch, in_flight: LaunchedStep) -> None:
        """Write the PENDING inputs' tokens into the batch's input ids, on the device."""
        dst, src = pending_rows(batch.ordered, in_flight.rows_of)
        if dst:
            index = self._to_device(torch.tensor(dst))
            tokens = in_flight.token_ids.index_select(0, self._to_device(torch.tensor(src)))
            batch.input_ids.index_copy_(0, index, tokens)

    def _sample(self, batch: Batch, logits: torch.Tensor):
        """(token ids on the device, logprobs) of the batch's sampled rows."""
        rows = [s.seq for s in batch.sampling for _ in range(1 + len(s.spec_token_ids))]
        # Filled while a GPU still computes the logits: the matchers' CPU work overlaps it.
        grammar_rows = [i for i, seq in enumerate(rows) if seq.grammar is not None]
        bitmask = (
            self.token_bitmask.fill([rows[i].grammar for i in grammar_rows])
            if grammar_rows
            else None
        )
        slow = set(self.token_bitmask.slow) if grammar_rows else set()
        for j, i in enumerate(grammar_rows):  # steps in a row over the mask budget
            rows[i].mask_strikes = rows[i].mask_strikes + 1 if j in slow else 0
        return self.sampler.sample_on_device(
            logits,
            [s.sampling for s in rows],
            [s.prompt_token_ids for s in rows],
            [s.output_token_ids for s in rows],
            [s.stream for s in rows],
            bitmask,
            grammar_rows,
        )

    def _forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits of the batch's sampled rows (logits_indices order); None if no row samples."""
        if batch.bucket is not None:
            run = self.decode_graphs.replay if self.decode_graphs else self.padded_decode.forward
            logits = run(batch.bucket)
            return logits[batch.logits_indices] if batch.sampling else None
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
        return self.model.compute_logits(hidden[batch.logits_indices]) if batch.sampling else None

    def prepare(self, scheduled: list[ScheduledSequence]) -> Batch:
        bucket = self.padded_decode.bucket(scheduled) if self.padded_decode else None
        if bucket is not None:
            return self._prepare_padded(scheduled, bucket)
        step = self.step_builder.build(scheduled)
        meta = self.attention.prepare(step.tables, fused_ops=self.backends.fused_ops)
        return Batch(
            step.input_ids,
            step.tables.positions,
            meta,
            step.logits_indices,
            [s for s in step.ordered if s.samples],
            step.ordered,
        )

    def _prepare_padded(self, scheduled: list[ScheduledSequence], bucket: int) -> Batch:
        step = self.step_builder.build_decode(scheduled, bucket)
        self.padded_decode.load(step)
        tokens = self.padded_decode.buffers.tokens
        return Batch(
            tokens[0, :bucket],
            tokens[1, :bucket],
            None,
            step.logits_indices,
            [s for s in step.ordered if s.samples],
            step.ordered,
            bucket,
        )

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return tensor_to_device(host, self.device)
