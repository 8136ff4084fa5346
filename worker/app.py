"""The Worker: wires intake, engine thread, publisher, cancels and HTTP; start-up and drain.

Life of a request (one `Job` per execution attempt):

    record ─► Intake (decode, triage) ─► admit: EngineLoop.add_request      state "waiting"
    engine output started ─► `started`                                       state "running"
    engine output tokens  ─► Publisher buffers, flushes `tokens` events
    engine output finished ─► `done` queued                                  state "finishing"
    engine output finished ─► Delivery.finish: the final `done` (worker/delivery/finals.py)

The Worker is wiring: it builds the parts, keeps the jobs' states and metrics, and hands every
result to the Delivery, the one place a result becomes final (committed with its offset, or
acknowledged in share mode), is dead-lettered, or is given back. A job carries the intake's
assignment generation: one that finishes after its partition was revoked publishes `requeued`,
never a final result. If the engine thread dies, every job is handed back (`requeued`),
readiness fails and run() raises.

The engine request id is the attempt (a fresh uuid), not the wire id: two messages with the
same id (a redelivery racing its own requeue) are then two attempts, never one engine entry.
Engine outputs arrive on the engine thread and hop to the event loop with
call_soon_threadsafe; everything below runs on the loop and never blocks.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import structlog
from aiokafka import TopicPartition

from worker.engine.engine import EngineLoop, EngineStats, LLMEngine
from worker.engine.request import RequestOutput
from worker.service.http import HttpServer
from worker.intake.cancels import CancelListener, RecentCancels
from worker.intake.admission import Admission
from worker.intake.group import Intake
from worker.delivery.finals import AcknowledgedDelivery, Delivery
from worker.delivery.ledger import Job, JobLedger
from worker.service.metrics import Metrics, priority_label
from worker.delivery.offsets import OffsetTracker
from worker.delivery.publisher import Publisher, ReplyStream
from worker.service.ratelimit import RateLimiter
from worker.intake.share import ShareIntake
from worker.service.tenancy import cancel_key
from worker.delivery.transactions import Transactions

log = structlog.get_logger(__name__)


class EngineDied(RuntimeError):
    """The engine thread stopped: the worker hands everything back and exits non-zero."""


class WorkerFailed(RuntimeError):
    """The worker cannot serve its partitions (their transactional ids could not be taken)."""


def engine_settings(settings):
    """The settings the engine is built with. The intake bounds the waiting pool itself;
    preempted sequences go back to the engine's waiting queue too, so the engine's own
    max_waiting backstop gets headroom for them instead of rejecting them as overloaded."""
    sched = settings.scheduler.model_copy(
        update={"max_waiting": settings.scheduler.max_waiting + settings.scheduler.max_num_seqs})
    return settings.model_copy(update={"scheduler": sched})


def build_engine(settings) -> LLMEngine:
    return LLMEngine.from_settings(engine_settings(settings))


class Worker:
    def __init__(self, settings, engine: LLMEngine | None = None) -> None:
        self.settings = settings
        self.name = settings.worker.name or f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = Metrics()
        self.tracker = OffsetTracker()
        self.limiter = RateLimiter(settings.limits)
        self.cancels = RecentCancels(ttl_s=settings.kafka.cancel_lookback_s)
        self.transactions = Transactions(settings, self.tracker, self.metrics)
        self.publisher = Publisher(settings, self.metrics, self.name, self.transactions,
                                   on_send_failed=lambda topic: self.intake.reply_topics.forget(topic))
        self.ledger = JobLedger()
        share = settings.kafka.intake == "share"
        generation = lambda: self.intake.generation  # noqa: E731
        if share:
            self.delivery = AcknowledgedDelivery(settings, self.publisher, self.ledger, self.metrics, generation,
                                                 decide=lambda tp, offset, verdict: self.intake.decide(tp, offset, verdict))
        else:
            self.delivery = Delivery(settings, self.publisher, self.ledger, self.metrics, generation)
        self.intake = (ShareIntake if share else Intake)(settings, self, self.tracker, self.limiter, self.metrics,
                                                         self.cancels, self.transactions, self.delivery)
        self.cancel_listener = CancelListener(settings, self.cancel, self.metrics)
        self.http = HttpServer(settings, self.metrics, self._last_tick, self.readiness)
        self.engine = engine
        self.engine_loop: EngineLoop | None = None
        self.engine_died: BaseException | None = None
        self.failed: BaseException | None = None
        self._num_waiting = 0
        self._stats = EngineStats()
        self._stop = asyncio.Event()
        self._hurry = False  # a second signal: skip the drain wait
        self.draining = False

    @property
    def jobs(self) -> dict[str, Job]:
        """attempt -> job, for every request running or waiting here."""
        return self.ledger.jobs

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.http.start()
        log.info("worker.starting", worker=self.name, http_port=self.http.port)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_exception)
        # The model loads on the engine's own thread, the one that will run it (EngineLoop says why);
        # minutes on a cold cache, awaited off the event loop so /healthz answers meanwhile.
        source = self.engine if self.engine is not None else (lambda: build_engine(self.settings))
        engine_loop = EngineLoop(source, lambda outs, st: self._from_engine(loop, outs, st),
                                 on_death=lambda exc: loop.call_soon_threadsafe(self._on_engine_death, exc))
        engine_loop.start()
        self.engine = await asyncio.to_thread(engine_loop.wait_ready)
        runner = self.engine.runner
        self.metrics.set_backends(runner.backends, getattr(runner, "linear_calibration", None))
        if self._stop.is_set():  # stopped while loading: joining the group would only rebalance it
            await asyncio.to_thread(engine_loop.stop, 10.0)
            log.info("worker.stopped_before_start")
            return
        self._stats = self.engine.stats()  # totals are deltas from here (an engine may be reused)
        self.engine_loop = engine_loop
        await self.publisher.start()
        await self.cancel_listener.start()
        await self.intake.start()
        log.info("worker.started", topic=self.settings.kafka.request_topic, group=self.settings.kafka.group_id)

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
        """SIGTERM/SIGINT: the first drains, a second one stops waiting for running requests."""
        if self._stop.is_set():
            self._hurry = True
            self.ledger.settled.set()
        self._stop.set()

    async def shutdown(self) -> None:
        log.info("worker.draining", jobs=len(self.jobs))
        self.draining, self.intake.fetching = True, False
        # Waiting requests would only start now to be cut off: hand them back at once.
        self._abort([a for a, j in self.jobs.items() if j.state == "waiting"], "requeued")
        await self._wait_jobs(lambda: not self.jobs, self.settings.worker.drain_timeout_s)
        await self.requeue(self.ledger.busy_partitions(), timeout=10.0)
        # Each step is bounded: with the broker gone, aiokafka would retry for minutes.
        await _bounded(self.intake.close(), 15.0, "intake.close")  # final commit, leave the group
        await _bounded(self.cancel_listener.close(), 5.0, "cancels.close")
        await _bounded(self.publisher.stop(), 15.0, "publisher.stop")
        await _bounded(self.transactions.close_all(), 15.0, "transactions.close")
        if self.engine_loop:
            await asyncio.to_thread(self.engine_loop.stop, 10.0)
        await self.http.stop()
        log.info("worker.stopped", unfinished=len(self.jobs))

    def readiness(self) -> dict[str, bool]:
        return {"model_loaded": self.engine_loop is not None, "engine_alive": self.engine_died is None,
                "in_group": self.intake.joined, "cancel_listener": self.cancel_listener.ready,
                "not_draining": not self.draining}

    def _on_engine_death(self, exc: BaseException) -> None:
        """Nothing will answer the jobs now: hand each back (`requeued`: their offsets stay
        uncommitted, the partitions' next owner runs them), fail readiness, stop."""
        log.critical("worker.engine_died", error=repr(exc), jobs=len(self.jobs))
        self.engine_died = exc
        for job in [j for j in self.jobs.values() if j.state != "finishing"]:
            self._finish(job, RequestOutput(request_id=job.attempt, finished=True, finish_reason="requeued"))
        self.request_stop()

    def fatal(self, exc: BaseException) -> None:
        log.critical("worker.failed", error=repr(exc))
        self.failed = exc
        self.request_stop()

    def _last_tick(self) -> float | None:
        return self.engine_loop.last_tick if self.engine_loop else None

    # -- intake sink ------------------------------------------------------------------------------

    def room(self) -> int:
        if self.draining or self.publisher.full():
            return 0
        return max(0, self.settings.scheduler.max_waiting - self._num_waiting)

    def pool_full(self) -> bool:
        return self._num_waiting >= self.settings.scheduler.max_waiting

    def admit(self, adm: Admission) -> None:
        req, tp, offset = adm.request, adm.tp, adm.offset
        if self.delivery.answered_before(tp, offset, req):  # the same id with other content runs
            return
        rs = ReplyStream(req.id, uuid.uuid4().hex, req.reply_topic, req.reply_partition, stream=req.stream)
        job = Job(req, rs, tp, offset, adm.received, adm.max_tokens, self.intake.generation)
        job.log = log.bind(request_id=req.id, attempt=rs.attempt, partition=tp.partition, offset=offset)
        self.ledger.add(job)
        self._num_waiting += 1
        self.engine_loop.add_request(adm.engine_request(rs.attempt))
        job.log.debug("request.admitted", priority=req.priority, tenant=req.tenant)

    async def requeue(self, tps: set[TopicPartition], timeout: float | None = None) -> None:
        """Give up the requests of these partitions (`requeued`) and wait until their `done`s are acked."""
        if timeout is None:  # within the rebalance timeout, leaving time to commit and rejoin
            timeout = self.settings.kafka.session_timeout_ms / 2000
        self._abort([a for a, j in self.jobs.items() if j.tp in tps], "requeued")
        await self._wait_jobs(lambda: not self.ledger.unacked(tps), timeout)
        self.ledger.release_partitions(tps)

    def cancel(self, request_id: str, tenant: str | None = None) -> None:
        """Abort the request wherever it is here; `tenant` (topic tenancy: whose cancel topic
        carried it) limits it to that tenant's requests."""
        self.cancels.add(cancel_key(request_id, tenant))  # the request may not have been read yet
        attempts = [a for a in self.ledger.attempts(request_id)
                    if tenant is None or self._tenant_of_attempt(a) == tenant]
        if attempts:
            log.info("request.cancel", request_id=request_id, attempts=len(attempts))
        self._abort(attempts, "cancelled")

    def _tenant_of_attempt(self, attempt: str) -> str | None:
        job = self.jobs.get(attempt)
        return job.request.tenant if job is not None else None

    def _abort(self, attempts: list[str], reason: str) -> None:
        for attempt in attempts:
            job = self.jobs.get(attempt)
            if job is not None and job.state != "finishing":
                self.engine_loop.abort(attempt, reason)

    async def _wait_jobs(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and not self._hurry:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.ledger.settled.clear()
            try:
                await asyncio.wait_for(self.ledger.settled.wait(), left)
            except asyncio.TimeoutError:
                return

    # -- engine outputs ---------------------------------------------------------------------------

    def _from_engine(self, loop, outputs: list[RequestOutput], stats: EngineStats) -> None:
        try:  # engine thread: hop onto the event loop
            loop.call_soon_threadsafe(self._on_outputs, outputs, stats)
        except RuntimeError:  # the loop closed under a stopping engine
            pass

    def _on_outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        now = time.time()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.state == "finishing":
                continue
            if out.started:
                self._started(job, out)
            if out.new_token_ids or out.text_delta:
                self._tokens(job, out, now)
            if out.finished:
                self._finish(job, out)
        self.metrics.observe_engine(stats, self._stats, self._num_waiting)
        self._stats = stats

    def _started(self, job: Job, out: RequestOutput) -> None:
        job.state = "running"
        self._num_waiting -= 1
        self.publisher.started(job.reply, out.queue_s)
        self.metrics.queue_time.labels(priority_label(job.request.priority)).observe(out.queue_s)

    def _tokens(self, job: Job, out: RequestOutput, now: float) -> None:
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.labels(priority_label(job.request.priority)).observe(now - job.received)
        job.last_token_at = now
        self.publisher.tokens(job.reply, out.new_token_ids, out.text_delta, out.logprobs, out.index)

    def _finish(self, job: Job, out: RequestOutput) -> None:
        ran = job.state == "running"
        if job.state == "waiting":
            self._num_waiting -= 1
        job.state = "finishing"
        reason = out.finish_reason or "error"
        if reason != "requeued" and self.delivery.stale(job):
            job.log.warning("request.finished_after_revocation", finish_reason=reason)
            reason, out = "requeued", RequestOutput(request_id=out.request_id, finished=True, finish_reason="requeued")
        error = None
        if out.error_code and reason != "requeued":
            error = (out.error_code, out.error_message or out.error_code)
        self.delivery.finish(job, out, reason, error, ran)
        self.limiter.refund(job.request.tenant, job.max_tokens * job.request.n - out.num_output_tokens)
        self._observe_finish(job, out, reason, error)

    def _observe_finish(self, job: Job, out: RequestOutput, reason: str, error) -> None:
        itl = None
        # Samples stream side by side: the gaps are those of the longest one.
        num_tokens = max(s.num_output_tokens for s in out.samples) if out.samples else out.num_output_tokens
        if num_tokens > 1 and job.first_token_at and job.last_token_at:
            itl = (job.last_token_at - job.first_token_at) / (num_tokens - 1)
        self.metrics.observe_finish(reason, out.error_code, job.request.priority,
                                    time.time() - job.received, itl)
        job.log.info("request.done", finish_reason=reason, error=error and error[0],
                     prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                     total_s=round(out.total_s, 3))


def _loop_exception(loop, context: dict) -> None:
    """The event loop's unhandled errors, logged without formatting a traceback: a failed future
    is reported when collected, on whatever thread collects it, possibly in the middle of
    another parse, and Python 3.11's traceback formatting parses source (the CPython 3.11 AST
    counter is not re-entrant: a nested parse breaks every later one in the process)."""
    exc = context.get("exception")
    log.warning("loop.unhandled", message=context.get("message"), error=repr(exc) if exc else None)


async def _bounded(coro, timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(coro, timeout)
    except Exception as exc:  # noqa: BLE001 - shutting down: log and go on to the next step
        log.warning("worker.shutdown_step_failed", step=what, error=repr(exc))
