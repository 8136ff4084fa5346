"""One CUDA graph per decode bucket, captured at start-up and replayed for every decode-only step
(design: docs/architecture.md#the-engine-step). The CPU tests pass a fake `capture`.
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
    """A CUDA graph of `step`, its memory in `pool` (None: a new pool)."""
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
    replay() and pool()."""

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
        """The captured step; logits [bucket, vocab] (the buffer's rows)."""
        self.graphs[bucket].replay()
        return self.padded.buffers.logits[:bucket]
