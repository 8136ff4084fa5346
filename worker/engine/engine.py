"""The engine (add_request, abort, step) and EngineLoop, the thread that runs it and talks to
asyncio through an inbox and `on_outputs`. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import gc
import json
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Callable

import structlog
import torch

from inferline.config.settings import Settings
from inferline.contract.tool_format import fallback_messages, renders_tools
from inferline.worker.engine.block_manager import BlockManager, sliding_window
from inferline.worker.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from inferline.worker.engine.fair_share import FairShare
from inferline.worker.engine import overlap
from inferline.worker.engine.model_runner import LaunchedStep, ModelRunner
from inferline.worker.engine.request import (
    EngineRequest,
    RequestOutput,
    SampleResult,
    SamplingParams,
)
from inferline.worker.engine.sampler import SamplerOutput, make_stream
from inferline.worker.engine.scheduler import BackgroundLimit, Scheduler, SchedulerOutput
from inferline.worker.engine.sequence import ERROR_CODE_OF, PENDING, Sequence
from inferline.worker.engine.spec_decode import NgramProposer, accept
from inferline.worker.engine.structured_output import GrammarCompiler, new_matcher

log = structlog.get_logger(__name__)

# Test and benchmark hook: a throttled worker sleeps this long before each step.
_STEP_DELAY_S = float(os.environ.get("INFERLINE_FAULT_STEP_DELAY_S", "0"))

ABORT_REASONS = ("cancelled", "timeout", "requeued", "error")
# A generous bound on the characters of one token.
MAX_CHARS_PER_TOKEN = 256
GRAMMAR_WAIT_S = 0.01
# Steps in a row over the mask budget before a request ends (one slow step may be the machine's).
MASK_STRIKES = 3


class Rejected(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    kv_cache_waste: float = 0.0  # fraction of used slots holding no token
    num_preemptions: int = 0  # total
    batch_size: int = 0
    num_batched_tokens: int = 0  # drafts included
    num_draft_tokens: int = 0  # speculative drafts in the last step
    step_time_s: float = 0.0  # the last step
    num_generated_tokens: int = 0  # total
    num_steps: int = 0
    prefix_cache_queries: int = 0  # prefix-cache lookups, tokens, total
    prefix_cache_hits: int = 0  # of which hits, total
    spec_draft_tokens: int = 0  # total
    spec_accepted_tokens: int = 0  # of which accepted, total
    num_forks: int = 0  # total
    # By tenant: (waiting, running) sequences now, and tokens generated in the last step.
    tenant_load: dict[str, tuple[int, int]] = field(default_factory=dict)
    tenant_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class LLMEngine:
    def __init__(self, runner: ModelRunner, settings: Settings):
        self.runner = runner
        self._runner_token = runner.claim()  # one engine per KV cache
        self.tokenizer = runner.tokenizer
        self.max_model_len = min(runner.max_model_len, settings.model.max_model_len)
        self.max_waiting = settings.scheduler.max_waiting
        num_blocks = min(settings.cache.num_blocks or runner.num_blocks, runner.num_blocks)
        self.block_manager = BlockManager(
            num_blocks,
            runner.block_size,
            settings.cache.enable_prefix_caching,
            sliding_window(getattr(runner.model, "windows", None)),
        )
        spec = settings.speculative
        proposer = (
            NgramProposer(spec.num_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
            if spec.method == "ngram"
            else None
        )
        sched = settings.scheduler
        self.scheduler = Scheduler(
            self.block_manager,
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            sched.policy,
            proposer,
            spec.disable_by_batch_size,
            BackgroundLimit(
                sched.background_priority,
                sched.background_max_tokens,
                sched.background_alone_max_tokens or None,
                sched.background_quiet_s,
            ),
            fair=FairShare(sched.tenant_weights, sched.default_tenant_weight),
        )
        self.eos_token_ids = eos_token_ids(runner.config, self.tokenizer)
        self.vocab_size = runner.config.vocab_size
        self.requests: dict[str, list[Sequence]] = {}  # every sample of a request, by index
        # Samples 1..n-1 waiting for sample 0 to compute the prompt (_fork).
        self._unforked: dict[str, list[Sequence]] = {}
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request
        self._structured = settings.structured
        # Sequences whose grammar still compiles (with request time): in no queue, holding no block.
        self._compiling: dict[str, tuple[Sequence, Future, float]] = {}
        self._finished: list[RequestOutput] = []  # rejections and aborts, reported by the next step
        self._stats = EngineStats()
        self._tenant_tokens: dict[str, int] = {}  # generated this step
        self._token_texts = TokenTexts(self.tokenizer)
        self.overlap = overlap.pick_overlap(settings.engine.overlap, runner.device.type)
        # The step left on the device while the next is scheduled (overlap), and its schedule.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> "LLMEngine":
        if settings.model.cpu_threads:  # process-wide
            torch.set_num_threads(settings.model.cpu_threads)
        return cls(ModelRunner(settings), settings)

    # ---- requests in ---------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; an impossible one finishes as `rejected` in the next step."""
        if req.request_id in self.requests:
            self._finished.append(
                rejected_output(req.request_id, "invalid_request", "duplicate request id")
            )
            return
        try:
            seq = self._make_sequence(req)
        except Rejected as exc:
            self._finished.append(rejected_output(req.request_id, exc.code, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - a bad prompt must not kill the thread
            log.warning(
                "engine.add_request_failed", request_id=req.request_id, error=repr(exc)[:200]
            )
            self._finished.append(
                rejected_output(
                    req.request_id,
                    "invalid_request",
                    f"prompt could not be tokenized ({type(exc).__name__})",
                )
            )
            return
        samples = [seq] + [self._sample(seq, i) for i in range(1, seq.sampling.n)]
        self.requests[seq.request_id] = samples
        if len(samples) > 1:
            self._unforked[seq.request_id] = samples[1:]
        if seq.sampling.structured is not None:
            self._compile(seq, req.tenant)
        else:
            self.scheduler.add(seq)

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer,
                self.vocab_size,
                sorted(self.eos_token_ids),
                self._structured.compile_threads,
                self._structured.cache_bytes,
                self._structured.compile_processes,
            )
        return self._grammars

    def _compile(self, seq: Sequence, tenant: str | None = None) -> None:
        """Compile off-thread; the sequence joins the queue once ready, so the batch never waits."""
        field = seq.sampling.structured.field
        try:
            future = self.grammars.compile(seq.sampling.structured, tenant)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer xgrammar cannot read
            log.warning(
                "engine.grammar_compiler_failed", request_id=seq.request_id, error=repr(exc)[:200]
            )
            self._forget(seq.request_id)
            self._finished.append(
                rejected_output(
                    seq.request_id,
                    "invalid_request",
                    f"{field}: structured outputs are unavailable on this worker",
                )
            )
            return
        self._compiling[seq.request_id] = (seq, future, time.monotonic())

    def _admit_compiled(self) -> None:
        if self._compiling and not self._finished and not self.scheduler.has_unfinished():
            wait(
                [future for _, future, _ in self._compiling.values()],
                GRAMMAR_WAIT_S,
                FIRST_COMPLETED,
            )
        budget, now = self._structured.compile_timeout_s, time.monotonic()
        ready_since = self._grammars.ready_since if self._compiling else None
        for request_id, (seq, future, since) in list(self._compiling.items()):
            if not future.done():
                if ready_since is not None and now - max(since, ready_since) > budget:
                    reason = (
                        f"the grammar did not compile within {budget:g} s "
                        "(INFERLINE_STRUCTURED__COMPILE_TIMEOUT_S)"
                    )
                    self.grammars.give_up(future, reason)
                    self._forget(request_id)
                    self._finished.append(
                        rejected_output(
                            request_id,
                            "invalid_request",
                            f"{seq.sampling.structured.field}: {reason}",
                        )
                    )
                continue
            del self._compiling[request_id]
            try:
                for sample in self.requests[request_id]:
                    sample.grammar = new_matcher(future.result())
            except ValueError as exc:
                self._forget(request_id)
                field = seq.sampling.structured.field
                self._finished.append(
                    rejected_output(request_id, "invalid_request", f"{field}: {exc}")
                )
                continue
            self.scheduler.add(seq)

    def _make_sequence(self, req: EngineRequest) -> Sequence:
        prompt_ids = self.tokenize(req)
        if any(not 0 <= t < self.vocab_size for t, _ in req.sampling.logit_bias):
            raise Rejected(
                "invalid_request", f"logit_bias: token ids must be in [0, {self.vocab_size})"
            )
        sampling = self._fit_max_tokens(len(prompt_ids), req.sampling)
        self._check_fits(prompt_ids, sampling.max_tokens, sampling.n)
        # Preempted sequences wait too; only new arrivals count.
        num_new = sum(s.first_scheduled_time is None for s in self.scheduler.waiting) + len(
            self._compiling
        )
        if num_new >= self.max_waiting:
            raise Rejected("overloaded", f"waiting pool full ({self.max_waiting})")
        return Sequence(
            request_id=req.request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            priority=req.priority,
            arrival_time=req.arrival_time,
            deadline=req.deadline,
            tenant=req.tenant or "default",
            stream=make_stream(req.sampling.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, req.sampling.stop),
        )

    def _sample(self, seq: Sequence, index: int) -> Sequence:
        """Sample `index` of `seq`'s request: same prompt and params, its own seed + index."""
        return Sequence(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            sampling=seq.sampling,
            priority=seq.priority,
            arrival_time=seq.arrival_time,
            deadline=seq.deadline,
            tenant=seq.tenant,
            index=index,
            stream=make_stream(sample_seed(seq.sampling.seed, index)),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.sampling.stop
            ),
        )

    def _fork(self, seq: Sequence) -> None:
        """Sample 0 has computed the prompt: the other samples share its full blocks."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        children = self._unforked.pop(seq.request_id)
        num_shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        for child in children:
            self.block_manager.fork(seq.block_table[:num_shared], child)
            child.first_scheduled_time = seq.first_scheduled_time  # the request started once
            self.scheduler.add(child)
        self._stats.num_forks += len(children)

    def _forget(self, request_id: str) -> list[Sequence]:
        self._unforked.pop(request_id, None)
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None and all(
            f is not compiling[1] for _, f, _ in self._compiling.values()
        ):
            self.grammars.abandon(compiling[1])  # nobody else waits for it
        return self.requests.pop(request_id, [])

    def tokenize(self, req: EngineRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise Rejected(
                    "invalid_request", f"prompt_token_ids: ids must be in [0, {self.vocab_size})"
                )
        elif req.messages is not None:
            chars = sum(map(turn_chars, req.messages)) + len(json.dumps(req.tools or []))
            check_text_size(chars, "messages", self.max_model_len)
            messages, tools = chat_inputs(self.tokenizer, req)
            ids = list(
                self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **(req.chat_template_kwargs or {}),
                )["input_ids"]
            )
        else:
            text = req.prompt or ""
            check_text_size(len(text), "prompt", self.max_model_len)
            ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise Rejected("invalid_request", "prompt: empty after tokenization")
        return ids

    def _fit_max_tokens(self, num_prompt_tokens: int, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the max_tokens this prompt can have (as vLLM): what the model length
        leaves when it was left out; an explicit one that cannot fit is rejected naming it."""
        left = self.max_model_len - num_prompt_tokens
        if left < 1:
            raise Rejected(
                "prompt_too_long",
                f"prompt ({num_prompt_tokens} tokens) leaves no room in the model length "
                f"{self.max_model_len}",
            )
        if sampling.fit_to_model_len:
            room = self._kv_room(num_prompt_tokens, sampling.n)
            return replace(sampling, max_tokens=max(1, min(sampling.max_tokens, left, room)))
        if sampling.max_tokens > left:
            raise Rejected(
                "prompt_too_long",
                f"max_tokens: {sampling.max_tokens} does not fit: the prompt has "
                f"{num_prompt_tokens} tokens and the model length is {self.max_model_len} "
                f"(at most {left} left)",
            )
        return sampling

    def _kv_room(self, num_prompt_tokens: int, n: int) -> int:
        """New tokens each of n samples can have with the whole KV cache to themselves (the
        inverse of num_blocks_needed); below 1 when even the prompt does not fit."""
        bm = self.block_manager
        shared = (num_prompt_tokens - 1) // bm.block_size if n > 1 else 0
        return (shared + (bm.num_blocks - shared) // n) * bm.block_size - num_prompt_tokens

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, n: int = 1) -> None:
        total = len(prompt_ids) + max_tokens
        assert total <= self.max_model_len, "_fit_max_tokens first"
        needed = self.num_blocks_needed(len(prompt_ids), max_tokens, n)
        if needed > self.block_manager.num_blocks:
            what = "prompt + max_tokens" if n == 1 else f"n ({n}) samples of prompt + max_tokens"
            raise Rejected(
                "prompt_too_long",
                f"{what} ({total} tokens each) need {needed} KV blocks, "
                f"more than the whole KV cache ({self.block_manager.num_blocks} blocks)",
            )

    def num_blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """KV blocks for n samples all running to max_tokens: the prompt's full blocks are shared,
        the rest is each sample's own."""
        bm = self.block_manager
        shared = (num_prompt_tokens - 1) // bm.block_size if n > 1 else 0
        return shared + n * (bm.num_blocks_for(num_prompt_tokens + max_tokens) - shared)

    def abort(self, request_id: str, reason: str = "cancelled", message: str | None = None) -> None:
        """Finish a waiting or running request now, freeing its blocks."""
        assert reason in ABORT_REASONS, reason
        samples = self._forget(request_id)
        if not samples:
            return  # aborts race with completion
        for seq in samples:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish(reason, message)
        self._finished.append(self._final_output(samples, reason, message))

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._finished)
            or self.scheduler.has_unfinished()
            or bool(self._compiling)
            or self._in_flight is not None
        )

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._expire_deadlines()
        self._admit_compiled()
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs = {(o.request_id, o.index): o for o in self._finished}
        self._finished = []
        if not sched.is_empty or sched.started or self._in_flight is not None:
            self._run(sched, outputs)
        self._record_stats(sched, time.perf_counter() - started)
        return list(outputs.values())

    def _run(self, sched: SchedulerOutput, outputs: dict) -> None:
        """Launch the step; resolve the one in flight after it (worker/engine/overlap.py); then
        leave this one in flight where it may, else resolve it now."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and overlap.needs_tokens_first(sched.scheduled):
            self._resolve(*in_flight, outputs)
            in_flight = None
            sched.scheduled = [c for c in sched.scheduled if not c.seq.is_finished]
        launched = None
        if sched.scheduled:
            previous = in_flight[1] if in_flight is not None else None
            launched = self.runner.launch(sched.scheduled, self._runner_token, previous)
        speculative = self.scheduler.proposer is not None
        stays = (
            launched is not None
            and self.overlap
            and overlap.can_overlap(sched.scheduled, speculative)
        )
        if stays:
            self._launched(sched, outputs)
        if in_flight is not None:
            self._resolve(*in_flight, outputs)
        if stays:
            self._leave_in_flight(sched, launched)
        else:
            self._update(sched, self.runner.resolve(launched) if launched else [], outputs)
            self._end_costly_grammars(sched)

    def _launched(self, sched: SchedulerOutput, outputs: dict) -> None:
        """A step staying in flight: what the host knows at launch (no drafts in such a step)."""
        self._mark_started(sched, outputs, time.time())
        for chunk in sched.scheduled:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens

    def _leave_in_flight(self, sched: SchedulerOutput, launched: LaunchedStep) -> None:
        """Each sampling sequence takes a PENDING token; one that the token ends by length sits
        out the next schedules (no wasted row, no slot past its limits)."""
        for chunk in launched.samples:
            seq = chunk.seq
            if seq.is_finished:
                continue  # ended by the step resolved just now: this row is wasted
            seq.output_token_ids.append(PENDING)
            limit = seq.sampling.max_tokens
            if seq.num_output_tokens >= limit or seq.num_tokens >= self.max_model_len:
                self.scheduler.hold(seq)
        self._in_flight = (sched, launched)

    def _resolve(self, sched: SchedulerOutput, launched: LaunchedStep, outputs: dict) -> None:
        """The step in flight's tokens in place of its PENDING ones; a finished sequence's row
        is dropped."""
        now = time.time()
        for chunk, drawn in zip(launched.samples, self.runner.resolve(launched)):
            seq = chunk.seq
            if not seq.is_finished:
                assert seq.output_token_ids[-1] == PENDING, seq.request_id
                seq.output_token_ids.pop()
                self._append_token(seq, drawn.token_ids[0], now, outputs, drawn.logprobs[0])
        for chunk in sched.scheduled:  # every computed token is known now
            if not chunk.seq.is_finished:
                self.block_manager.cache_computed_blocks(chunk.seq)

    def _end_costly_grammars(self, sched: SchedulerOutput) -> None:
        """End with `error` a request whose token mask keeps costing the batch over budget."""
        for seq in {
            id(c.seq): c.seq for c in sched.scheduled if c.seq.mask_strikes >= MASK_STRIKES
        }.values():
            if seq.request_id in self.requests and not seq.is_finished:
                budget = self.runner.token_bitmask.budget_s
                self.abort(
                    seq.request_id,
                    "error",
                    f"{seq.sampling.structured.field}: the grammar's token mask "
                    f"took over {budget * 1e3:g} ms per step "
                    "(INFERLINE_STRUCTURED__MASK_BUDGET_MS)",
                )

    def _expire_deadlines(self) -> None:
        now = time.time()
        for seq in [
            s[0]
            for s in self.requests.values()
            if s[0].deadline is not None and s[0].deadline <= now
        ]:
            self.abort(seq.request_id, "timeout", "deadline passed")

    def _mark_started(self, sched: SchedulerOutput, outputs: dict, now: float) -> None:
        """`now`: the step's own clock reading, which its first tokens share (a later reading
        would make a request's queue time exceed its time to first token)."""
        for seq in sched.started:
            seq.first_scheduled_time = now
            outputs[(seq.request_id, 0)] = self._output(seq, started=True)

    def _update(self, sched: SchedulerOutput, sampled: list[SamplerOutput], outputs: dict) -> None:
        now = time.time()
        self._mark_started(sched, outputs, now)
        sampled_iter = iter(sampled)
        for chunk in sched.scheduled:
            seq, drafts = chunk.seq, chunk.spec_token_ids
            drawn = next(sampled_iter) if chunk.samples else None
            if seq.is_finished:
                continue  # ended by the step in flight resolved before this one (overlap)
            new_tokens = accept(drafts, drawn.token_ids) if drawn is not None else []
            # K/V is valid for the known tokens and accepted drafts, not rejected ones.
            num_accepted = max(0, len(new_tokens) - 1)
            seq.num_computed_tokens += chunk.num_new_tokens - len(drafts) + num_accepted
            self._stats.spec_draft_tokens += len(drafts)
            self._stats.spec_accepted_tokens += num_accepted
            self.block_manager.cache_computed_blocks(seq)
            if seq.request_id in self._unforked:
                self._fork(seq)  # before its first token, which may end it and free its blocks
            for token_id, logprobs in zip(new_tokens, drawn.logprobs if drawn is not None else []):
                self._append_token(seq, token_id, now, outputs, logprobs)
                if seq.is_finished:
                    break  # a stop among accepted tokens: the rest were never generated

    def _append_token(
        self, seq: Sequence, token_id: int, now: float, outputs: dict, logprobs: dict | None = None
    ) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token_id)
        self._stats.num_generated_tokens += 1
        self._tenant_tokens[seq.tenant] = self._tenant_tokens.get(seq.tenant, 0) + 1
        out = outputs.setdefault((seq.request_id, seq.index), self._output(seq))
        out.new_token_ids.append(token_id)
        if seq.sampling.logprobs is not None:
            out.logprobs = out.logprobs if out.logprobs is not None else []
            out.logprobs.append(
                {"token": self._token_texts(token_id), **self._token_texts.name(logprobs)}
            )
        out.num_output_tokens = seq.num_output_tokens  # a step may append several (accepted drafts)
        reason = self._grammar_stop(seq, token_id) or self._stop_reason(seq, token_id)
        if token_id not in self.eos_token_ids and token_id not in seq.sampling.stop_token_ids:
            delta, stopped = seq.detokenizer.add(token_id)
            out.text_delta += delta
            reason = "stop" if stopped else reason
        if reason is not None:
            out.text_delta += seq.detokenizer.flush()
            self._retire(seq, reason, out)

    def _grammar_stop(self, seq: Sequence, token_id: int) -> str | None:
        if seq.grammar is None:
            return None
        if not seq.grammar.accept_token(token_id):  # the mask allowed it: a bug
            log.error("engine.grammar_rejected_token", request_id=seq.request_id, token_id=token_id)
            return "error"
        return "stop" if seq.grammar.is_terminated() else None

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling
        if token_id in params.stop_token_ids:
            return "stop"
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _retire(self, seq: Sequence, reason: str, out: RequestOutput) -> None:
        self.scheduler.remove(seq)
        seq.finish(reason)
        samples = self.requests[seq.request_id]
        if not all(s.is_finished for s in samples):
            return
        del self.requests[seq.request_id]
        final = self._final_output(samples)
        out.finished, out.finish_reason, out.text, out.samples = (
            True,
            final.finish_reason,
            final.text,
            final.samples,
        )
        out.error_code, out.error_message = final.error_code, final.error_message
        out.num_output_tokens, out.ttft_s, out.total_s = (
            final.num_output_tokens,
            final.ttft_s,
            final.total_s,
        )

    def fail_all(self, message: str) -> None:
        """After an unexpected step error: end every request with `error`, keep serving."""
        self._in_flight = None  # whatever it computed is not trusted
        for request_id in list(self.requests):
            self.abort(request_id, "error", message)

    # ---- outputs and stats ---------------------------------------------------------------------

    def _output(
        self, seq: Sequence, started: bool = False, finished: bool = False
    ) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            started=started,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
        )
        if seq.first_scheduled_time is not None:
            out.queue_s = seq.first_scheduled_time - seq.arrival_time
        if finished:
            out.finished, out.finish_reason = True, seq.finish_reason
            out.error_code, out.error_message = seq.error_code, seq.error_message
            out.text = seq.detokenizer.text if seq.detokenizer else ""
            out.total_s = (seq.finish_time or time.time()) - seq.arrival_time
            if seq.first_token_time is not None:
                out.ttft_s = seq.first_token_time - seq.arrival_time
        return out

    def _final_output(
        self, samples: list[Sequence], reason: str | None = None, message: str | None = None
    ) -> RequestOutput:
        """A request's final output: sample 0's text and reason (or `reason`), every sample's
        tokens, and each sample when n > 1."""
        out = self._output(samples[0], finished=True)
        if len(samples) == 1:
            return out
        if reason is not None:
            out.finish_reason, out.error_code, out.error_message = (
                reason,
                ERROR_CODE_OF.get(reason),
                message,
            )
        out.num_output_tokens = sum(s.num_output_tokens for s in samples)
        out.total_s = max(s.finish_time for s in samples) - samples[0].arrival_time
        out.samples = [
            SampleResult(
                s.index,
                s.detokenizer.text if s.detokenizer else "",
                s.finish_reason,
                s.num_output_tokens,
            )
            for s in samples
        ]
        return out

    def _record_stats(self, sched: SchedulerOutput, step_time: float) -> None:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting) + len(self._compiling)
        s.kv_cache_usage = self.block_manager.usage
        s.kv_cache_waste = self.block_manager.waste(self.scheduler.owners())
        s.num_preemptions = self.scheduler.num_preemptions
        s.batch_size, s.num_batched_tokens = len(sched.scheduled), sched.num_batched_tokens
        s.num_draft_tokens = sum(len(c.spec_token_ids) for c in sched.scheduled)
        s.step_time_s = step_time
        s.num_steps += 1
        s.tenant_load = self._tenant_load()
        s.tenant_tokens, self._tenant_tokens = self._tenant_tokens, {}
        if cache := self.block_manager.prefix_cache:
            s.prefix_cache_queries, s.prefix_cache_hits = (
                cache.num_queried_tokens,
                cache.num_hit_tokens,
            )

    def _tenant_load(self) -> dict[str, tuple[int, int]]:
        """(waiting, running) sequences by tenant; compiling ones wait."""
        load = self.scheduler.fair.load()
        for seq, _, _ in self._compiling.values():
            waiting, running = load.get(seq.tenant, (0, 0))
            load[seq.tenant] = (waiting + 1, running)
        return load

    def stats(self) -> EngineStats:
        return EngineStats(**vars(self._stats))

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.owners())


def check_text_size(num_chars: int, field: str, max_model_len: int) -> None:
    # Tokenizing a huge text costs seconds on the engine thread.
    if num_chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise Rejected(
            "prompt_too_long",
            f"{field}: {num_chars} characters cannot fit in {max_model_len} tokens",
        )


def chat_inputs(tokenizer, req: EngineRequest) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for apply_chat_template: a template that does not render tools gets
    them in its system turn instead, in the request's tool format."""
    if not req.tools:
        return req.messages, None
    if renders_tools(getattr(tokenizer, "chat_template", None)):
        return req.messages, req.tools
    return fallback_messages(req.messages, req.tools, req.tool_format), None


def turn_chars(turn: dict) -> int:
    """Characters of a chat turn's text: its content and its tool calls' arguments."""
    calls = turn.get("tool_calls", [])
    return len(turn.get("content", "")) + sum(len(str(c["function"]["arguments"])) for c in calls)


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: seed + index, wrapped into the seed range."""
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else seed + index - 2**64


def rejected_output(request_id: str, code: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        finished=True,
        finish_reason="rejected",
        error_code=code,
        error_message=message,
        text="",
    )


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    ids = getattr(config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class EngineLoop:
    """Runs an LLMEngine in its own thread. `add_request` and `abort` are thread-safe and never
    block; `on_outputs(outputs, stats)` is called from the engine thread after every step. Given
    a builder, the model loads on this thread (docs/operations.md#process-memory-on-the-cpu)."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_outputs: Callable[[list[RequestOutput], EngineStats], None],
        idle_tick_s: float = 0.05,
        on_death: Callable[[BaseException], None] | None = None,
    ):
        self._build = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = engine if self._build is None else None
        self.on_outputs = on_outputs
        self.idle_tick_s = idle_tick_s
        self.last_tick = time.monotonic()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self.on_death = on_death  # called on the engine thread if the loop dies
        self._thread = threading.Thread(target=self._run, name="inferline-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> LLMEngine:
        """The engine once built (blocks); re-raises the build's error."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine is still loading")
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._inbox.put(None)  # wake an idle wait
        self._thread.join(timeout)
        gc.unfreeze()  # what _run froze is collectable again

    def add_request(self, req: EngineRequest) -> None:
        self._inbox.put(("add", req))

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        self._inbox.put(("abort", request_id, reason))

    def _run(self) -> None:
        if self._build is not None:
            try:
                self.engine = self._build()
            except BaseException as exc:  # noqa: BLE001 - handed to wait_ready's caller
                self._build_error = exc
                self._ready.set()
                return
        # Objects alive now live as long as the engine: frozen, no full GC pause traverses them.
        gc.freeze()
        self._ready.set()
        try:
            while not self._stopping.is_set():
                self._drain_inbox(wait=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
                self.last_tick = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - a dead engine must be a dead worker, loudly
            log.exception("engine loop died", error=repr(exc))
            if self.on_death is not None:
                self.on_death(exc)

    def _drain_inbox(self, wait: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self.idle_tick_s) if wait else self._inbox.get_nowait()
            while True:
                self._apply(cmd)
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, cmd) -> None:
        if cmd is None:
            return
        if cmd[0] == "add":
            self.engine.add_request(cmd[1])
        else:
            self.engine.abort(cmd[1], cmd[2])

    def _step(self) -> None:
        if _STEP_DELAY_S:
            time.sleep(_STEP_DELAY_S)
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bad batch must not take the worker down
            log.exception("engine step failed; failing its requests", error=str(exc))
            self.engine.fail_all(f"internal error: {type(exc).__name__}")
            outputs = self.engine.step()
        self.on_outputs(outputs, self.engine.stats())
