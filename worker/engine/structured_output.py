"""Structured outputs (constrained decoding) with xgrammar: grammars, matchers, token bitmasks.

A request with a grammar (a JSON schema, any JSON object, a regex, a choice of strings, or EBNF)
samples only tokens that keep its output a prefix of some string of the grammar. Three parts:

- `GrammarCompiler` compiles grammars on a small pool of its own threads, never the engine's,
  taking the next job from each tenant in turn (one tenant's heavy grammars hold up its own
  requests, not everyone's), and keeps the results (or the errors) by their text, in a cache
  bounded in bytes, so a schema shared by many requests compiles once. The engine gives each
  request's compile a time budget (INFERLINE_STRUCTURED__COMPILE_TIMEOUT_S): past it the request
  is rejected naming its field, and a compile nobody waits for any more is abandoned (dropped
  before it starts; one already running cannot be interrupted, and finishes into the cache);
- each running sequence holds a `GrammarMatcher` (xgrammar's), advanced by every accepted token;
- `TokenBitmask` fills one bit per vocabulary id per constrained row for the whole batch with
  one xgrammar call, which the sampler applies to the logits before anything else.

xgrammar over llguidance: the batch bitmask of 32 rows costs it several times less on the default
model's vocabulary (`python -m bench.grammar_engines`, docs/benchmarks.md).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future

import structlog
import torch
import xgrammar as xgr

from worker.engine.request import StructuredSpec

log = structlog.get_logger(__name__)

# Bytes of compiled grammars kept by default (INFERLINE_STRUCTURED__CACHE_BYTES); xgrammar reports
# each one's size (token mask caches: tens of KB to a few MB on a 49K vocabulary).
CACHE_BYTES = 256 * 2**20
# What a failed compile is counted as in the cache (its message).
_FAILURE_BYTES = 1024
# xgrammar's messages start with "[07:32:22] /project/cpp/regex_converter.cc:94: ": not the user's business.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# Compact JSON: fewer tokens, and no whitespace run for a sampled small model to wander into
# (any_whitespace=False: between tokens the grammar allows exactly these separators, no blanks).
JSON_SEPARATORS = (",", ":")


class GrammarCompiler:
    """Compiles `StructuredSpec`s off the calling thread: `compile` returns a Future of an
    xgrammar CompiledGrammar that fails with ValueError (its message says why) when the
    grammar is invalid. Futures are cached by (kind, text), failures included, up to
    `cache_bytes` of compiled grammars (least recently used go first). `threads` compile at
    once; jobs are taken from each tenant in turn, and no tenant has more than `threads - 1` of
    them running, so another tenant's grammar always finds a thread (tenant None: no bound)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int = 2,
                 cache_bytes: int = CACHE_BYTES):
        self.info = tokenizer if isinstance(tokenizer, xgr.TokenizerInfo) else xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # of the finished entries
        self.num_bytes = 0
        self._queues: OrderedDict[str | None, deque] = OrderedDict()  # tenant -> (key, spec, future)
        self._running: dict[str | None, int] = {}
        self._lock = threading.Condition()  # the cache and the queues; workers wait on it
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"inferline-grammar-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def compile(self, spec: StructuredSpec, tenant: str | None = None) -> Future:
        key = (spec.kind, spec.text)
        with self._lock:
            future = self._cache.get(key)
            if future is None or future.cancelled():  # a cancelled one was abandoned: compile again
                future = self._cache[key] = Future()
                self._queues.setdefault(tenant, deque()).append((key, spec, future))
                self._lock.notify()
            self._cache.move_to_end(key)
            return future

    def abandon(self, future: Future) -> bool:
        """Nobody waits for `future` any more: drop its compile if it has not started."""
        with self._lock:
            return future.cancel()

    def _next_job(self):
        """The first queued job of the tenant next in turn that may run one more (lock held)."""
        busy = sum(self._running.values())
        for tenant in list(self._queues):
            queue = self._queues[tenant]
            while queue and queue[0][2].cancelled():
                queue.popleft()  # abandoned before it started
            if not queue:
                del self._queues[tenant]
                continue
            # A known tenant never holds every thread: another tenant's grammar always finds one.
            if tenant is not None and self._running.get(tenant, 0) >= max(1, len(self._threads) - 1):
                continue
            job = queue.popleft()
            self._queues.move_to_end(tenant)  # round robin
            if not queue:
                del self._queues[tenant]
            self._running[tenant] = self._running.get(tenant, 0) + 1
            assert busy < len(self._threads)
            return tenant, job
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (picked := self._next_job()) is None:
                    self._lock.wait()
                if self._closed:
                    return
            tenant, (key, spec, future) = picked
            try:
                if future.set_running_or_notify_cancel():
                    self._run(key, spec, future)
            finally:
                with self._lock:
                    self._running[tenant] -= 1
                    self._lock.notify_all()

    def _run(self, key, spec: StructuredSpec, future: Future) -> None:
        try:
            compiled = compile_spec(self._compiler, spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad input
            reason = _SOURCE_PREFIX.sub("", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
            future.set_exception(ValueError(f"cannot be compiled: {reason}"[:300]))
            self._account(key, future, _FAILURE_BYTES)
            return
        future.set_result(compiled)
        self._account(key, future, int(getattr(compiled, "memory_size_bytes", 0)) + len(spec.text))

    def _account(self, key, future: Future, size: int) -> None:
        """A finished entry counts its bytes; the least recently used go until they fit."""
        with self._lock:
            if self._cache.get(key) is not future:
                return  # evicted, or replaced, meanwhile
            self._sizes[key] = size
            self.num_bytes += size
            for old in list(self._cache):
                if self.num_bytes <= self.cache_bytes:
                    break
                if old in self._sizes:  # running compiles stay: their requests wait on them
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


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredSpec):
    """The xgrammar CompiledGrammar of one spec (raises on an invalid grammar)."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.text, any_whitespace=False, separators=JSON_SEPARATORS)
    if spec.kind == "json_object":
        # strict_mode off: any properties, not the strict reading of {"type": "object"} (only {}).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            separators=JSON_SEPARATORS, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "choice":
        options = json.loads(spec.text)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    assert spec.kind == "grammar", spec.kind
    return compiler.compile_grammar(spec.text)


def new_matcher(compiled) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(compiled)


class TokenBitmask:
    """One int32 word per 32 vocabulary ids per constrained row, bit set = allowed (xgrammar's
    layout), filled on the CPU for the whole batch in one call and then moved to the logits'
    device. The bitmask covers the tokenizer's vocabulary as the engine gave it to the compiler
    (the model's logits width)."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int = 256, budget_s: float | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # the engine thread's own core
        self._host = self._allocate(max_rows)
        self.budget_s = budget_s  # StructuredSettings.mask_budget_ms; None: never timed
        self.slow: list[int] = []  # rows of the last fill that alone took over budget_s

    def _allocate(self, rows: int) -> torch.Tensor:
        pin = self.device.type == "cuda"  # pinned: the copy to the GPU can run asynchronously
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)

    def fill(self, matchers: list[xgr.GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32 on the device: each row the tokens its matcher allows next."""
        if len(matchers) > self._host.shape[0]:
            self._host = self._allocate(len(matchers))
        host = self._host[:len(matchers)]
        started = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        self.slow = []
        if self.budget_s is not None and time.perf_counter() - started > self.budget_s:
            self.slow = self._time_rows(matchers, host)
        return host.to(self.device, non_blocking=True)

    def _time_rows(self, matchers: list[xgr.GrammarMatcher], host: torch.Tensor) -> list[int]:
        """The rows whose mask alone takes over budget_s (filled again, one by one: same bits)."""
        slow = []
        for i, matcher in enumerate(matchers):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(host, i)
            if time.perf_counter() - started > self.budget_s:
                slow.append(i)
        return slow


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets to -inf (in place) the logits of the tokens the bitmask forbids, for rows [n, vocab]
    and a bitmask [n, words]; ids past the bitmask's 32 * words (a model's padded vocabulary)
    are forbidden too. Plain torch ops: the same code on CPU and CUDA. Returns `logits`."""
    num_rows, vocab = logits.shape
    assert bitmask.shape[0] == num_rows and bitmask.dtype == torch.int32, (bitmask.shape, bitmask.dtype)
    # One AND with every bit's value and one compare per id (fewer passes than shift, AND, cast).
    forbidden = ((bitmask.unsqueeze(-1) & _bit_values(logits.device)) == 0).view(num_rows, -1)
    width = min(vocab, forbidden.shape[1])
    logits[:, :width].masked_fill_(forbidden[:, :width], float("-inf"))
    if vocab > width:
        logits[:, width:] = float("-inf")
    return logits


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """int32 [32]: 1 << k for bit k (bit 31 is the sign bit, -2**31)."""
    if device not in _BIT_VALUES:
        values = [1 << k for k in range(31)] + [-(1 << 31)]
        _BIT_VALUES[device] = torch.tensor(values, dtype=torch.int32, device=device)
    return _BIT_VALUES[device]
