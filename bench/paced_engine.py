"""A stand-in for the model in delivery benchmarks: every running request gets one token per step,
one step every `--step-ms` (a GPU's decode pace), and nothing is computed.

What delivery costs the broker (events, transactions, fetches) depends on how many tokens a
request yields per second, not on how they were computed; on a 2-core machine the real model
yields a token per request every second or so, far from a GPU's 20-30 ms, and would take the
cores the broker's CPU is measured on. Everything else is the real worker: intake, admission,
Publisher, transactions, against the real broker.

    # `python -m inferline.worker` with this engine (INFERLINE_* settings)
    python -m bench.paced_engine
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from inferline.worker.engine.engine import EngineStats
from inferline.worker.engine.request import EngineRequest, RequestOutput

TOKEN_ID, TOKEN_TEXT = 42, " x"


@dataclass
class _Running:
    req: EngineRequest
    arrived: float  # monotonic
    admitted: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token: float | None = None


class PacedEngine:
    """The parts of LLMEngine that EngineLoop and the worker use."""

    def __init__(self, step_s: float = 0.025, max_num_seqs: int = 256) -> None:
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.runner = SimpleNamespace(
            backends=SimpleNamespace(attention="paced", linear="paced", fused_ops="paced")
        )
        self._waiting: deque[tuple[EngineRequest, float]] = deque()
        self._running: dict[str, _Running] = {}
        self._finished: list[RequestOutput] = []
        self._next = time.monotonic()
        self._stats = EngineStats()

    def add_request(self, req: EngineRequest) -> None:
        self._waiting.append((req, time.monotonic()))

    def abort(self, request_id: str, reason: str = "cancelled", message: str | None = None) -> None:
        self._waiting = deque(w for w in self._waiting if w[0].request_id != request_id)
        run = self._running.pop(request_id, None)
        self._finished.append(
            RequestOutput(
                request_id=request_id,
                finished=True,
                finish_reason=reason,
                error_message=message,
                num_output_tokens=run.num_output_tokens if run else 0,
            )
        )

    def fail_all(self, message: str) -> None:
        for rid in [w[0].request_id for w in self._waiting] + list(self._running):
            self.abort(rid, "error", message)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running or self._finished)

    def stats(self) -> EngineStats:
        return self._stats

    def step(self) -> list[RequestOutput]:
        time.sleep(max(0.0, self._next - time.monotonic()))
        self._next = time.monotonic() + self.step_s
        outputs, self._finished = self._finished, []
        while self._waiting and len(self._running) < self.max_num_seqs:
            req, arrived = self._waiting.popleft()
            prompt = req.prompt_token_ids or (req.prompt or str(req.messages)).split()
            self._running[req.request_id] = _Running(req, arrived, time.monotonic(), len(prompt))
        now = time.monotonic()
        for rid, run in list(self._running.items()):
            outputs.append(self._advance(run, now))
            if outputs[-1].finished:
                del self._running[rid]
        self._stats = EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            batch_size=len(self._running),
            num_steps=self._stats.num_steps + 1,
        )
        return outputs

    def _advance(self, run: _Running, now: float) -> RequestOutput:
        """One token (prefill yields the first); the last one finishes the request."""
        run.num_output_tokens += 1
        first = run.first_token is None
        run.first_token = run.first_token or now
        done = run.num_output_tokens >= run.req.sampling.max_tokens
        return RequestOutput(
            request_id=run.req.request_id,
            new_token_ids=[TOKEN_ID],
            text_delta=TOKEN_TEXT,
            started=first,
            finished=done,
            finish_reason="length" if done else None,
            text=TOKEN_TEXT * run.num_output_tokens if done else None,
            num_prompt_tokens=run.num_prompt_tokens,
            num_output_tokens=run.num_output_tokens,
            queue_s=run.admitted - run.arrived,
            ttft_s=run.first_token - run.arrived,
            total_s=now - run.arrived,
        )


def main() -> None:
    """`python -m inferline.worker` with a PacedEngine (step from INFERLINE_BENCH_STEP_MS,
    default 25)."""
    import asyncio
    import signal

    from inferline.config.logging import configure_logging
    from inferline.config.settings import load_settings
    from inferline.worker.app import Worker

    settings = load_settings()
    configure_logging(settings.log.level, settings.log.format)
    step_s = float(os.environ.get("INFERLINE_BENCH_STEP_MS", "25")) / 1000

    async def serve() -> None:
        worker = Worker(settings, lambda: PacedEngine(step_s, settings.scheduler.max_num_seqs))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        await worker.run()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
