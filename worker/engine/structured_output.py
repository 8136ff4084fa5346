"""Structured outputs with xgrammar: grammars compiled off the engine thread, a matcher per
constrained sequence, one token bitmask per batch. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import structlog
import torch

from inferline.worker.engine.grammar_process import CompilerDied, CompilerProcess
from inferline.worker.engine.request import StructuredSpec

if TYPE_CHECKING:
    import xgrammar as xgr

log = structlog.get_logger(__name__)

# Bytes of compiled grammars kept by default (INFERLINE_STRUCTURED__CACHE_BYTES).
CACHE_BYTES = 256 * 2**20
IDLE_CHECK_S = 1.0
_FAILURE_BYTES = 1024
# xgrammar's messages start with "[07:32:22] /project/...cc:94: ": not the user's business.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# Compact JSON: fewer tokens, and no whitespace run for a small model to wander into.
JSON_SEPARATORS = (",", ":")


class GrammarCompiler:
    """Compiles `StructuredSpec`s off the calling thread: `compile` returns a Future of a compiled
    grammar or a ValueError; futures are cached by (kind, text) up to `cache_bytes` (LRU), and a
    tenant runs at most `threads - 1` jobs at once."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        threads: int = 2,
        cache_bytes: int = CACHE_BYTES,
        processes: bool = True,
    ):
        xgr = xgrammar()
        self.info = (
            tokenizer
            if isinstance(tokenizer, xgr.TokenizerInfo)
            else xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
            )
        )
        self._compiler = (
            None
            if processes
            else xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        )
        self._info_json = self.info.serialize_json() if processes else None
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.num_bytes = 0
        self._queues: OrderedDict[str | None, deque] = (
            OrderedDict()
        )  # tenant -> (key, spec, future)
        self._running: dict[str | None, int] = {}
        self._lock = threading.Condition()  # the cache and the queues; workers wait on it
        self._closed = False
        self._processes: dict[Future, CompilerProcess] = {}
        self._given_up: dict[Future, str] = {}  # -> why
        self._children: list[CompilerProcess] = []  # for the finalizer
        # When the first process could compile: the compile time budget counts from then.
        self.ready_since: float | None = None if processes else float("-inf")
        ref = weakref.ref(self)
        self._threads = [
            threading.Thread(
                target=_work, args=(ref, self._lock), name=f"inferline-grammar-{i}", daemon=True
            )
            for i in range(max(1, threads))
        ]
        weakref.finalize(self, _close, self._lock, self._children)
        for thread in self._threads:
            thread.start()

    def compile(self, spec: StructuredSpec, tenant: str | None = None) -> Future:
        key = (spec.kind, spec.text)
        with self._lock:
            future = self._cache.get(key)
            if future is None or future.cancelled():  # cancelled: abandoned, compile again
                future = self._cache[key] = Future()
                self._queues.setdefault(tenant, deque()).append((key, spec, future))
                self._lock.notify()
            self._cache.move_to_end(key)
            return future

    def abandon(self, future: Future) -> bool:
        """Nobody waits for `future` any more: drop its compile if it has not started."""
        with self._lock:
            return future.cancel()

    def give_up(self, future: Future, reason: str) -> None:
        """`future`'s compile took too long: dropped if not started, else its process is killed
        (an in-thread compile cannot be stopped)."""
        with self._lock:
            if future.cancel() or future not in self._processes:
                return
            self._given_up[future] = reason
            self._processes[future].kill()

    def _next_job(self):
        """The next job of the tenant next in turn that may run one more (lock held)."""
        busy = sum(self._running.values())
        for tenant in list(self._queues):
            queue = self._queues[tenant]
            while queue and queue[0][2].cancelled():
                queue.popleft()
            if not queue:
                del self._queues[tenant]
                continue
            if tenant is not None and self._running.get(tenant, 0) >= max(
                1, len(self._threads) - 1
            ):
                continue
            job = queue.popleft()
            self._queues.move_to_end(tenant)  # round robin
            if not queue:
                del self._queues[tenant]
            self._running[tenant] = self._running.get(tenant, 0) + 1
            assert busy < len(self._threads)
            return tenant, job
        return None

    def _start_process(self) -> CompilerProcess | None:
        """A ready child process, or None (compile in the thread) when none can start."""
        process = None
        if self._info_json is not None:
            try:
                process = CompilerProcess(self._info_json)
                with self._lock:
                    self._children.append(process)
                process.wait_ready()
            except (OSError, CompilerDied) as exc:
                log.error("grammar.process_failed", error=str(exc)[:200])
                self._end_process(process)
                process = None
        with self._lock:
            if self.ready_since is None:
                self.ready_since = time.monotonic()
        return process

    def _end_process(self, process: CompilerProcess | None) -> None:
        if process is not None:
            with self._lock:
                if process in self._children:
                    self._children.remove(process)
            process.close()

    def _run(self, key, spec: StructuredSpec, future: Future, process: CompilerProcess | None):
        """Compiles one job and returns the process to use next; a dead process is replaced and the
        job retried once."""
        for attempt in range(2):
            try:
                compiled = self._compile(spec, future, process)
                break
            except CompilerDied:
                reason = self._given_up.pop(future, None)
                self._end_process(process)
                process = self._start_process()
                if reason is None and attempt == 0:
                    continue
                future.set_exception(
                    ValueError(reason or "cannot be compiled: it crashed the grammar compiler")
                )
                self._account(key, future, _FAILURE_BYTES)
                return process
            except Exception as exc:  # noqa: BLE001 - xgrammar raises many types for bad input
                reason = _SOURCE_PREFIX.sub(
                    "", (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                )
                future.set_exception(ValueError(f"cannot be compiled: {reason}"[:300]))
                self._account(key, future, _FAILURE_BYTES)
                return process
        reason = self._given_up.pop(future, None)
        if reason is not None:  # killed just after it answered
            self._end_process(process)
            future.set_exception(ValueError(reason))
            self._account(key, future, _FAILURE_BYTES)
            return self._start_process()
        future.set_result(compiled)
        self._account(key, future, int(getattr(compiled, "memory_size_bytes", 0)) + len(spec.text))
        return process

    def _compile(self, spec: StructuredSpec, future: Future, process: CompilerProcess | None):
        if process is None:
            return compile_spec(self._compiler or self._thread_compiler(), spec)
        with self._lock:
            self._processes[future] = process
        try:
            text = process.compile(spec.kind, spec.text)
        finally:
            with self._lock:
                del self._processes[future]
        return xgrammar().CompiledGrammar.deserialize_json(text, self.info)

    def _thread_compiler(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = xgrammar().GrammarCompiler(
                    self.info, max_threads=1, cache_enabled=False
                )
            return self._compiler

    def _account(self, key, future: Future, size: int) -> None:
        """A finished entry counts its bytes; LRU entries go until they fit."""
        with self._lock:
            if self._cache.get(key) is not future:
                return
            self._sizes[key] = size
            self.num_bytes += size
            for old in list(self._cache):
                if self.num_bytes <= self.cache_bytes:
                    break
                if old in self._sizes:  # running compiles stay: requests wait on them
                    self.num_bytes -= self._sizes.pop(old)
                    del self._cache[old]

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for _, _, future in queue:
                    future.cancel()
            self._queues.clear()
            self._lock.notify_all()
        _close(self._lock, self._children)


def _work(ref: weakref.ref, lock: threading.Condition) -> None:
    """A compile thread; it holds the compiler only while picking or running a job, so a dropped
    engine ends it."""
    compiler = ref()
    process = compiler._start_process() if compiler is not None else None
    del compiler
    try:
        while True:
            with lock:
                compiler = ref()
                if compiler is None or compiler._closed:
                    return
                picked = compiler._next_job()
                if picked is None:
                    del compiler
                    lock.wait(IDLE_CHECK_S)
                    continue
            tenant, (key, spec, future) = picked
            try:
                if future.set_running_or_notify_cancel():
                    process = compiler._run(key, spec, future, process)
            finally:
                with lock:
                    compiler._running[tenant] -= 1
                    lock.notify_all()
                del compiler
    finally:
        if process is not None:
            process.close()


def _close(lock: threading.Condition, children: list) -> None:
    with lock:
        doomed, children[:] = list(children), []
        lock.notify_all()
    for process in doomed:
        process.kill()


def xgrammar():
    """The xgrammar module, imported by the first constrained request: an engine that serves none
    starts and runs without it (the GPU image has no xgrammar)."""
    import xgrammar

    return xgrammar


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredSpec):
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(
            spec.text, any_whitespace=False, separators=JSON_SEPARATORS
        )
    if spec.kind == "json_object":
        # strict_mode off: any properties allowed
        return compiler.compile_json_schema(
            '{"type": "object"}',
            any_whitespace=False,
            separators=JSON_SEPARATORS,
            strict_mode=False,
        )
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "choice":
        options = json.loads(spec.text)
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        )
    assert spec.kind == "grammar", spec.kind
    return compiler.compile_grammar(spec.text)


def new_matcher(compiled) -> xgr.GrammarMatcher:
    return xgrammar().GrammarMatcher(compiled)


class TokenBitmask:
    """Allowed-token bits (xgrammar's layout: one int32 word per 32 ids per row), filled on the
    CPU for the whole batch in one call and moved to the logits' device."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        max_rows: int = 256,
        budget_s: float | None = None,
    ):
        self.vocab_size = vocab_size
        self.device = device
        self._batch = None  # xgrammar's BatchGrammarMatcher, made by the first fill
        self._host = self._allocate(max_rows)
        self.budget_s = budget_s  # None: never timed
        self.slow: list[int] = []  # rows of the last fill over budget_s alone

    def _allocate(self, rows: int) -> torch.Tensor:
        pin = self.device.type == "cuda"  # pinned: an asynchronous copy to the GPU
        return torch.full(
            (rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin
        )

    def fill(self, matchers: list[xgr.GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32 on the device: the tokens each matcher allows next."""
        if len(matchers) > self._host.shape[0]:
            self._host = self._allocate(len(matchers))
        host = self._host[: len(matchers)]
        if self._batch is None:  # one thread: the engine thread's own core
            self._batch = xgrammar().BatchGrammarMatcher(max_threads=1)
        started = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        self.slow = []
        if self.budget_s is not None and time.perf_counter() - started > self.budget_s:
            self.slow = self._time_rows(matchers, host)
        return host.to(self.device, non_blocking=True)

    def _time_rows(self, matchers: list[xgr.GrammarMatcher], host: torch.Tensor) -> list[int]:
        """The rows whose mask alone takes over budget_s (refilled one by one: same bits)."""
        slow = []
        for i, matcher in enumerate(matchers):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(host, i)
            if time.perf_counter() - started > self.budget_s:
                slow.append(i)
        return slow


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets to -inf in place the logits the bitmask [n, words] forbids, ids past 32 * words
    included; returns `logits`."""
    num_rows, vocab = logits.shape
    assert bitmask.shape[0] == num_rows and bitmask.dtype == torch.int32, (
        bitmask.shape,
        bitmask.dtype,
    )
    # One AND with every bit's value and one compare per id: fewer passes than shifts.
    forbidden = ((bitmask.unsqueeze(-1) & _bit_values(logits.device)) == 0).view(num_rows, -1)
    width = min(vocab, forbidden.shape[1])
    logits[:, :width].masked_fill_(forbidden[:, :width], float("-inf"))
    if vocab > width:
        logits[:, width:] = float("-inf")
    return logits


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    if device not in _BIT_VALUES:
        values = [1 << k for k in range(31)] + [-(1 << 31)]
        _BIT_VALUES[device] = torch.tensor(values, dtype=torch.int32, device=device)
    return _BIT_VALUES[device]
