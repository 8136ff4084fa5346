"""The Worker: wiring only. It builds the parts, starts them in order, drains and stops them.
design: docs/architecture.md#data-flow
"""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

from inferline.worker.engine.engine import EngineLoop, EngineStats, LLMEngine
from inferline.worker.engine.request import RequestOutput
from inferline.worker.service.http import HttpServer
from inferline.worker.intake.cancels import CancelListener, RecentCancels
from inferline.worker.intake.group import Intake
from inferline.worker.intake.lanes import Lanes
from inferline.worker.delivery.finals import AcknowledgedDelivery, Delivery
from inferline.worker.delivery.ledger import Job, JobLedger
from inferline.worker.request_tracker import RequestTracker
from inferline.worker.service.metrics import Metrics
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.delivery.publisher import Publisher
from inferline.worker.service.ratelimit import RateLimiter
from inferline.worker.intake.share import ShareIntake
from inferline.worker.delivery.commit import Committer

log = structlog.get_logger(__name__)
# Benchmark hook: join the group once this file exists (a scaling step timed apart from loading).
_JOIN_GATE = os.environ.get("INFERLINE_FAULT_JOIN_GATE")


class EngineDied(RuntimeError):
    """The engine thread stopped: the worker hands everything back and exits non-zero."""


class WorkerFailed(RuntimeError):
    """The worker cannot serve its partitions (their transactional ids could not be taken)."""


def engine_settings(settings):
    """The engine's settings: preempted sequences requeue in the engine, so its max_waiting gets
    headroom beyond the intake's bound."""
    sched = settings.scheduler.model_copy(
        update={"max_waiting": settings.scheduler.max_waiting + settings.scheduler.max_num_seqs}
    )
    return settings.model_copy(update={"scheduler": sched})


def build_engine(settings) -> LLMEngine:
    return LLMEngine.from_settings(engine_settings(settings))


class Worker:
    def __init__(self, settings, engine: LLMEngine | None = None) -> None:
        self.settings = settings
        self.name = settings.worker.name or f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = Metrics(settings.gateway.model_name, settings.model.max_model_len)
        self.tracker = OffsetTracker()
        self.limiter = RateLimiter(settings.limits)
        self.cancels = RecentCancels(ttl_s=settings.kafka.cancel_lookback_s)
        share = settings.kafka.intake == "share"
        self.committer = (
            None if share else Committer(settings, self.tracker, self.metrics, self.name)
        )
        self.publisher = Publisher(
            settings,
            self.metrics,
            self.name,
            self.committer,
            on_send_failed=lambda topic: self.intake.reply_topics.forget(topic),
        )
        self.ledger = JobLedger(self.tracker)
        generation = self.tracker.epoch  # share mode owns no partition: always 0
        if share:
            self.delivery = AcknowledgedDelivery(
                settings,
                self.publisher,
                self.ledger,
                self.metrics,
                generation,
                decide=lambda tp, offset, verdict: self.intake.decide(tp, offset, verdict),
            )
        else:
            self.delivery = Delivery(
                settings, self.publisher, self.ledger, self.metrics, generation
            )
        self.requests = RequestTracker(
            settings,
            self.ledger,
            self.delivery,
            self.metrics,
            self.limiter,
            self.cancels,
            generation,
            self.fatal,
        )
        # Group mode: records past the pool's room wait in per-tenant lanes (share mode acquires
        # only what it can run).
        self.lanes = None
        if not share and settings.lanes.max_records > 0:
            self.lanes = Lanes(settings, self.requests, self.metrics)
            self.requests.on_room = self.lanes.release
        sink = self.lanes or self.requests
        parts = (settings, sink, self.tracker, self.limiter, self.metrics, self.cancels)
        self.intake = (
            ShareIntake(*parts, self.delivery)
            if share
            else Intake(*parts, self.delivery, committer=self.committer)
        )
        if self.lanes is not None:
            self.lanes.recheck = self.intake.recheck
        self.cancel_listener = CancelListener(settings, self.requests.cancel, self.metrics)
        self.http = HttpServer(settings, self.metrics, self._last_tick, self.readiness)
        self.engine = engine
        self.engine_loop: EngineLoop | None = None
        self.engine_died: BaseException | None = None
        self.failed: BaseException | None = None
        self._stop = asyncio.Event()

    @property
    def jobs(self) -> dict[str, Job]:
        return self.ledger.jobs

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.http.start()
        log.info("worker.starting", worker=self.name, http_port=self.http.port)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_exception)
        # The model loads on the thread that will run it, off the event loop so /healthz answers.
        source = self.engine if self.engine is not None else (lambda: build_engine(self.settings))
        engine_loop = EngineLoop(
            source,
            lambda outs, st: self._from_engine(loop, outs, st),
            on_death=lambda exc: loop.call_soon_threadsafe(self._on_engine_death, exc),
        )
        engine_loop.start()
        self.engine = await asyncio.to_thread(engine_loop.wait_ready)
        runner = self.engine.runner
        self.metrics.set_backends(runner.backends, getattr(runner, "linear_calibration", None))
        if self._stop.is_set():  # stopped while loading: joining would only rebalance
            await asyncio.to_thread(engine_loop.stop, 10.0)
            log.info("worker.stopped_before_start")
            return
        self.requests.start(
            engine_loop, self.engine.stats()
        )  # an engine may be reused: deltas from here
        self.engine_loop = engine_loop
        await self.publisher.start()
        await self.delivery.start()  # the DLQ's limit, read before the first dead letter
        if self.committer is not None:
            await self.committer.start()
        await self.cancel_listener.start()
        await _join_gate()
        await self.intake.start()
        log.info(
            "worker.started",
            topic=self.settings.kafka.request_topic,
            group=self.settings.kafka.group_id,
        )

    async def run(self) -> None:
        """Start, serve until request_stop(), drain, close."""
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.shutdown()
        if self.engine_died is not None:
            raise EngineDied(f"the engine thread died: {self.engine_died!r}")
        if self.failed is not None:
            raise WorkerFailed(f"cannot serve the assigned partitions: {self.failed!r}")

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: the first drains, a second stops waiting for running requests."""
        if self._stop.is_set():
            self.requests.hurry = True
            self.ledger.settled.set()
        self._stop.set()

    async def shutdown(self) -> None:
        log.info("worker.draining", jobs=len(self.jobs))
        self.intake.fetching = False
        await self.requests.drain(self.settings.worker.drain_timeout_s)
        # Each step is bounded: with the broker gone, aiokafka would retry for minutes.
        # Finals commit while the group still lists this member; then it leaves.
        await _bounded(self.publisher.stop(), 15.0, "publisher.stop")
        if self.committer is not None:
            await _bounded(self.committer.close(), 15.0, "committer.close")
        await _bounded(self.intake.close(), 15.0, "intake.close")
        await _bounded(self.cancel_listener.close(), 5.0, "cancels.close")
        if self.engine_loop:
            await asyncio.to_thread(self.engine_loop.stop, 10.0)
        await self.http.stop()
        log.info("worker.stopped", unfinished=len(self.jobs))

    def readiness(self) -> dict[str, bool]:
        return {
            "model_loaded": self.engine_loop is not None,
            "engine_alive": self.engine_died is None,
            "in_group": self.intake.joined,
            "producer": self.committer is None or self.committer.ready,
            "cancel_listener": self.cancel_listener.ready,
            "not_draining": not self.requests.draining,
        }

    def _on_engine_death(self, exc: BaseException) -> None:
        """Nothing will answer the jobs now: hand each back (`requeued`), fail readiness, stop."""
        log.critical("worker.engine_died", error=repr(exc), jobs=len(self.jobs))
        self.engine_died = exc
        self.requests.hand_back_all()
        self.request_stop()

    def fatal(self, exc: BaseException) -> None:
        log.critical("worker.failed", error=repr(exc))
        self.failed = exc
        self.request_stop()

    def _last_tick(self) -> float | None:
        return self.engine_loop.last_tick if self.engine_loop else None

    # -- engine outputs: engine thread -> event loop ---------------------------------------------

    def _from_engine(self, loop, outputs: list[RequestOutput], stats: EngineStats) -> None:
        try:
            loop.call_soon_threadsafe(self.requests.on_outputs, outputs, stats)
        except RuntimeError:  # the loop closed under a stopping engine
            pass


def _loop_exception(loop, context: dict) -> None:
    """The event loop's unhandled errors, logged without a traceback: formatting one parses source,
    and CPython 3.11's parser is not re-entrant (a failed future may be collected mid-parse)."""
    exc = context.get("exception")
    log.warning("loop.unhandled", message=context.get("message"), error=repr(exc) if exc else None)


async def _join_gate() -> None:
    if _JOIN_GATE:
        log.info("worker.join_gate", path=_JOIN_GATE)
        while not os.path.exists(_JOIN_GATE):
            await asyncio.sleep(0.05)


async def _bounded(coro, timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(coro, timeout)
    except asyncio.CancelledError:
        # A step's own cancelled task (aiokafka's consumer stop awaits its fetch tasks after
        # cancelling them: a broken connection's fetch raises it) is a failed step; only a
        # cancel of the shutdown itself goes on up.
        if asyncio.current_task().cancelling():
            raise
        log.warning("worker.shutdown_step_failed", step=what, error="cancelled inside the step")
    except Exception as exc:  # noqa: BLE001 - shutting down: log, go on
        log.warning("worker.shutdown_step_failed", step=what, error=repr(exc))
