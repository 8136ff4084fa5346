"""One CUDA graph per decode bucket, captured at start-up and replayed for every decode-only step.

Why: a decode step launches about ten kernels a layer (kernels/triton/, the GEMMs), over 300 for
Llama-3-8B, each with microseconds of host work, while a small batch's whole step reads the weights
in a few milliseconds: launches the host cannot issue fast enough leave the GPU idle between
kernels. A replay issues the step's kernels as one launch.

What is captured is PaddedDecode.forward (worker/engine/padded_decode.py): the model and the LM
head over static buffers, for one bucket's rows. Capture happens in ModelRunner.__init__ after
warmup.py has compiled every Triton binary, largest bucket first, every graph in one memory pool
(vLLM's order: the smaller graphs' temporaries fit in what the largest took). Before each capture
one eager forward runs the same step, so that nothing a first call sets up (cuBLAS workspaces, the
allocator's blocks) happens inside the capture. Every row is padding then: no K/V is written.

The capture itself (`cuda_capture`: torch.cuda.CUDAGraph) runs on CUDA only; the CPU tests pass a
fake `capture` that records its calls and replays by running the step eagerly (docs/gpu.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import structlog
import torch

from inferline.worker.engine.padded_decode import PaddedDecode

log = structlog.get_logger(__name__)


def cuda_capture(step: Callable[[], object], pool):
    """A CUDA graph of `step`, its memory in `pool` (None: a new pool). CUDA only."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


@dataclass
class CaptureReport:
    buckets: list[int]  # in capture order
    seconds: float


class DecodeGraphs:
    """The graphs of a PaddedDecode's buckets. `capture(step, pool)` returns an object with
    replay() and pool() (cuda_capture; a fake in the CPU tests)."""

    def __init__(self, padded: PaddedDecode, capture: Callable = cuda_capture):
        self.padded, self._capture = padded, capture
        self.graphs: dict[int, object] = {}

    @torch.inference_mode()
    def capture_all(self) -> CaptureReport:
        start, pool, order = time.monotonic(), None, sorted(self.padded.sizes, reverse=True)
        for bucket in order:
            self.padded.load_padding(bucket)
            self.padded.forward(bucket)  # eager first: first-call set-up stays out of the graph
            graph = self._capture(lambda b=bucket: self.padded.forward(b), pool)
            pool = graph.pool()
            self.graphs[bucket] = graph
        if self.padded.buffers.logits.is_cuda:
            torch.cuda.synchronize(self.padded.buffers.logits.device)
        report = CaptureReport(order, time.monotonic() - start)
        log.info("cuda graphs captured", buckets=len(order), seconds=round(report.seconds, 2))
        return report

    def replay(self, bucket: int) -> torch.Tensor:
        """The captured step over the buffers as loaded; logits [bucket, vocab] (the buffer's rows)."""
        self.graphs[bucket].replay()
        return self.padded.buffers.logits[:bucket]
