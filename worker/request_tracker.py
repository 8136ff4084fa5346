"""The RequestTracker: every request held here, from admission to its hand-over to the Delivery,
and the engine outputs that move it; runs on the event loop (docs/architecture.md#data-flow).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable

import structlog
from aiokafka import TopicPartition

from inferline.contract.schema import Request, Sample
from inferline.worker.delivery.finals import Delivery
from inferline.worker.delivery.ledger import Job, JobLedger
from inferline.worker.delivery.publisher import ReplyStream
from inferline.worker.engine.engine import EngineStats
from inferline.worker.engine.request import EngineRequest, RequestOutput, SamplingParams
from inferline.worker.engine.request import StructuredSpec
from inferline.worker.intake.triage import Admission
from inferline.worker.intake.cancels import RecentCancels
from inferline.worker.service.tenancy import cancel_key
from inferline.worker.tracing import request_trace

log = structlog.get_logger(__name__)


def engine_request(
    req: Request, attempt: str, max_tokens: int, received: float, deadline: float
) -> EngineRequest:
    """The engine's request for one attempt of `req` (`attempt`: the engine's request id)."""
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        fit_to_model_len=req.max_tokens is None,
        structured=StructuredSpec(*c) if (c := req.output_constraint()) else None,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        n=req.n,
        logit_bias=tuple((int(t), bias) for t, bias in (req.logit_bias or {}).items()),
    )
    messages = [m.template_dict() for m in req.messages] if req.messages is not None else None
    return EngineRequest(
        request_id=attempt,
        sampling=sampling,
        prompt=req.prompt,
        messages=messages,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        tool_format=req.tool_format,
        prompt_token_ids=req.prompt_token_ids,
        priority=req.priority,
        arrival_time=received,
        deadline=deadline,
        tenant=req.tenant,
    )


def wire_samples(out: RequestOutput) -> list[Sample] | None:
    """The engine's samples of an n > 1 request, as the `done` lists them."""
    if out.samples is None:
        return None
    return [
        Sample(
            index=s.index,
            text=s.text,
            finish_reason=s.finish_reason,
            completion_tokens=s.num_output_tokens,
        )
        for s in out.samples
    ]


class RequestTracker:
    def __init__(
        self,
        settings,
        ledger: JobLedger,
        delivery: Delivery,
        metrics,
        limiter,
        cancels: RecentCancels,
        generation: Callable[[TopicPartition], int],
        fatal: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self.ledger, self.delivery, self.publisher = ledger, delivery, delivery.publisher
        self.metrics, self.limiter, self.cancels = metrics, limiter, cancels
        self._generation, self.fatal = generation, fatal
        self.engine_loop = None  # set once the model is loaded
        self.draining = False
        self.hurry = False  # a second signal: skip the drain wait
        self._num_waiting = 0
        self._waiting_by_tenant: dict[str, int] = {}
        self._stats = EngineStats()
        self.on_room: Callable[[], None] = lambda: None  # the lanes' release: the pool moved

    @property
    def jobs(self) -> dict[str, Job]:
        return self.ledger.jobs

    def start(self, engine_loop, stats: EngineStats) -> None:
        self.engine_loop, self._stats = engine_loop, stats  # totals are deltas from here

    # -- intake sink ------------------------------------------------------------------------------

    def room(self) -> int:
        """Records intake may take now: the waiting pool's room, less the dead letters in flight
        (a flood of them must not grow memory while the dead-letter topic is slow)."""
        if self.draining or self.delivery.publisher.full():
            return 0
        busy = self._num_waiting + self.delivery.dead_letters_in_flight
        return max(0, self.settings.scheduler.max_waiting - busy)

    def pool_full(self) -> bool:
        return self._num_waiting >= self.settings.scheduler.max_waiting

    def waiting_of(self, tenant: str) -> int:
        """The tenant's requests in the pool, not started yet."""
        return self._waiting_by_tenant.get(tenant, 0)

    def _count_waiting(self, tenant: str, delta: int) -> None:
        self._num_waiting += delta
        left = self._waiting_by_tenant.get(tenant, 0) + delta
        if left:
            self._waiting_by_tenant[tenant] = left
        else:
            self._waiting_by_tenant.pop(tenant, None)

    def admit(self, adm: Admission) -> None:
        req, tp, offset = adm.request, adm.tp, adm.offset
        rs = ReplyStream(
            req.id, uuid.uuid4().hex, req.reply_topic, req.reply_partition, stream=req.stream
        )
        rs.content_type = req.content_type  # every event in the request's encoding
        job = Job(req, rs, tp, offset, adm.received, adm.max_tokens, self._generation(tp))
        job.sent_at = adm.sent_at  # for TTFT from the record's timestamp
        job.trace = request_trace(adm, adm.headers)
        rs.headers = job.trace.headers
        self.metrics.observe_receipt(adm.received, adm.sent_at)
        job.log = log.bind(
            request_id=req.id, attempt=rs.attempt, partition=tp.partition, offset=offset
        )
        self.ledger.add(job)
        self._count_waiting(req.tenant, 1)
        attempt = engine_request(req, rs.attempt, adm.max_tokens, adm.received, adm.deadline)
        self.engine_loop.add_request(attempt)
        job.log.debug("request.admitted", priority=req.priority, tenant=req.tenant)

    async def requeue(self, tps: set[TopicPartition], timeout: float | None = None) -> None:
        """Give up these partitions' requests (`requeued`); wait until their `done`s are acked."""
        if timeout is None:  # within the rebalance timeout, leaving time to commit and rejoin
            timeout = self.settings.kafka.session_timeout_ms / 2000
        self._abort([a for a, j in self.jobs.items() if j.tp in tps], "requeued")
        await self._wait_jobs(lambda: not self.ledger.unacked(tps), timeout)
        self.ledger.release_partitions(tps)

    def cancel(self, request_id: str, tenant: str | None = None) -> None:
        """Abort the request wherever it is here; `tenant` limits it to that tenant's requests."""
        self.cancels.add(cancel_key(request_id, tenant))  # the request may not have been read yet
        attempts = [
            a
            for a in self.ledger.attempts(request_id)
            if tenant is None or self._tenant_of_attempt(a) == tenant
        ]
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
        while not done() and not self.hurry:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.ledger.settled.clear()
            try:
                await asyncio.wait_for(self.ledger.settled.wait(), left)
            except asyncio.TimeoutError:
                return

    # -- engine outputs ---------------------------------------------------------------------------

    def hand_back_all(self) -> None:
        """The engine died: hand each job back (`requeued`) for the partition's next owner."""
        for job in [j for j in self.jobs.values() if j.state != "finishing"]:
            self._finish(
                job, RequestOutput(request_id=job.attempt, finished=True, finish_reason="requeued")
            )

    async def drain(self, timeout: float) -> None:
        """Hand back what waits, let what runs finish (bounded), hand back the rest; wait for the
        acks."""
        self.draining = True
        self._abort([a for a, j in self.jobs.items() if j.state == "waiting"], "requeued")
        await self._wait_jobs(lambda: not self.jobs, timeout)
        busy = self.ledger.unacked() | {j.tp for j in self.jobs.values()}
        await self.requeue(busy, timeout=10.0)

    def on_outputs(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        now = time.time()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.state == "finishing":
                continue
            if out.started:
                self._started(job, out, now)
            if out.new_token_ids or out.text_delta:
                self._tokens(job, out, now)
            if out.finished:
                self._finish(job, out)
        self.metrics.observe_engine(stats, self._stats, self._num_waiting)
        self._stats = stats
        self.on_room()

    def _started(self, job: Job, out: RequestOutput, now: float) -> None:
        job.state = "running"
        # The engine's first schedule, not this output's time: one step may both start it and
        # give its first token, and the step's time is prefill, not pool (as queue_time counts).
        job.trace.started(min(now, job.received + max(0.0, out.queue_s)))
        self._count_waiting(job.request.tenant, -1)
        self.delivery.publisher.started(job.reply, out.queue_s)
        self.metrics.by_priority(self.metrics.queue_time, job.request.priority).observe(out.queue_s)

    def _tokens(self, job: Job, out: RequestOutput, now: float) -> None:
        if job.first_token_at is None:
            job.first_token_at = now
            job.trace.first_token(now)
            # A timestamp after receipt (clock skew, or set by the producer) counts as receipt.
            origin = min(job.sent_at, job.received) if job.sent_at is not None else job.received
            self.metrics.observe_first_token(
                job.request.priority, now - job.received, now - origin, out.num_prompt_tokens
            )
        job.last_token_at = now
        if out.new_token_ids:
            self._token_gap(job, out.index, now)
        self.delivery.publisher.tokens(
            job.reply, out.new_token_ids, out.text_delta, out.logprobs, out.index
        )

    def _token_gap(self, job: Job, index: int, now: float) -> None:
        """One gap per sample and step, however many tokens the step gave it (as vLLM counts
        its inter-token latency): the user gets them together."""
        last = job.token_at.get(index)
        if last is not None:
            self.metrics.observe_gap(now - last)
        job.token_at[index] = now

    def _finish(self, job: Job, out: RequestOutput) -> None:
        ran = job.state == "running"
        if job.state == "waiting":
            self._count_waiting(job.request.tenant, -1)
        job.state = "finishing"
        reason = out.finish_reason or "error"
        if reason != "requeued" and self.delivery.stale(job):
            job.log.warning("request.finished_after_revocation", finish_reason=reason)
            reason, out = (
                "requeued",
                RequestOutput(request_id=out.request_id, finished=True, finish_reason="requeued"),
            )
        error = None
        if out.error_code and reason != "requeued":
            error = (out.error_code, out.error_message or out.error_code)
        job.trace.finished(time.time(), out.num_prompt_tokens, out.num_output_tokens, reason)
        final = reason != "requeued"
        self.delivery.finish(
            job,
            final,
            usage=(out.num_prompt_tokens, out.num_output_tokens),
            timing=(out.queue_s if ran else out.total_s, out.ttft_s, out.total_s),
            finish_reason=reason,
            text=out.text,
            error=error,
            samples=wire_samples(out) if final else None,
        )
        self.limiter.refund(
            job.request.tenant, job.max_tokens * job.request.n - out.num_output_tokens
        )
        self._observe_finish(job, out, reason, error)

    def _observe_finish(self, job: Job, out: RequestOutput, reason: str, error) -> None:
        itl = None
        # Samples stream side by side: the gaps are those of the longest one.
        num_tokens = (
            max(s.num_output_tokens for s in out.samples) if out.samples else out.num_output_tokens
        )
        if num_tokens > 1 and job.first_token_at and job.last_token_at:
            itl = (job.last_token_at - job.first_token_at) / (num_tokens - 1)
        self.metrics.observe_finish(
            reason, out.error_code, job.request.priority, time.time() - job.received, itl
        )
        # A requeued request's lengths are counted where it ends.
        if job.first_token_at is not None and reason != "requeued":
            self.metrics.observe_lengths(out.num_prompt_tokens, out.num_output_tokens)
        job.log.info(
            "request.done",
            finish_reason=reason,
            error=error and error[0],
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            total_s=round(out.total_s, 3),
        )
