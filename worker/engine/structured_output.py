"""Structured outputs (constrained decoding) with xgrammar: grammars, matchers, token bitmasks.

A request with a grammar (a JSON schema, any JSON object, a regex, a choice of strings, or EBNF)
samples only tokens that keep its output a prefix of some string of the grammar. Three parts:

- `GrammarCompiler` compiles grammars on its own thread, never the engine's, and keeps the
  results (or the errors) by their text, so a schema shared by many requests compiles once;
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
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch
import xgrammar as xgr

from worker.engine.request import StructuredSpec

log = structlog.get_logger(__name__)

# Compiled grammars kept (a few MB at most each; hits are the shared schemas of a job stream).
CACHE_SIZE = 256
# xgrammar's messages start with "[07:32:22] /project/cpp/regex_converter.cc:94: ": not the user's business.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# Compact JSON: fewer tokens, and no whitespace run for a sampled small model to wander into.
JSON_SEPARATORS = (",", ":")


class GrammarCompiler:
    """Compiles `StructuredSpec`s off the calling thread: `compile` returns a Future of an
    xgrammar CompiledGrammar that fails with ValueError (its message says why) when the
    grammar is invalid. Futures are cached by (kind, text), failures included."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 1):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="inferline-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is shared with done-callbacks' threads

    def compile(self, spec: StructuredSpec) -> Future:
        key = (spec.kind, spec.text)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, spec)
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def _compile(self, spec: StructuredSpec):
        try:
            return compile_spec(self._compiler, spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad input
            reason = _SOURCE_PREFIX.sub("", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
            raise ValueError(f"cannot be compiled: {reason}"[:300]) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int = 256):
        self.vocab_size = vocab_size
        self.device = device
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # the engine thread's own core
        self._host = self._allocate(max_rows)

    def _allocate(self, rows: int) -> torch.Tensor:
        pin = self.device.type == "cuda"  # pinned: the copy to the GPU can run asynchronously
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)

    def fill(self, matchers: list[xgr.GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32 on the device: each row the tokens its matcher allows next."""
        if len(matchers) > self._host.shape[0]:
            self._host = self._allocate(len(matchers))
        host = self._host[:len(matchers)]
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        return host.to(self.device, non_blocking=True)


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
