"""Grammar compiles a hostile producer cannot turn against everyone (issue 38): a pool that takes
tenants in turn, abandoned compiles, a cache bounded in bytes, `choice` under the size cap and
JSON without whitespace runs. Real xgrammar compiles over a tiny vocabulary (no model needed);
the engine's time budget is in tests/unit/test_structured_output.py."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import xgrammar as xgr

from contract.schema import MAX_GRAMMAR_BYTES, InvalidRequest, decode_request
from worker.engine import structured_output
from worker.engine.request import StructuredSpec
from worker.engine.structured_output import GrammarCompiler

VOCAB = ["<eos>", "a", "b", "c", "0", "1", "{", "}", '"', ":", ",", " ", "\n", "ab", "x", "y"]


def tiny_compiler(**kw) -> GrammarCompiler:
    return GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[0]), len(VOCAB), [0], **kw)


def regex(text: str) -> StructuredSpec:
    return StructuredSpec("structured", "regex", text)


@pytest.fixture
def gated(monkeypatch):
    """compile_spec that blocks on `gate` for regexes starting with 'slow', and counts calls."""
    gate, calls, real = threading.Event(), [], structured_output.compile_spec

    def compile_spec(compiler, spec):
        calls.append(spec.text)
        if spec.text.startswith("slow"):
            gate.wait(30)
        return real(compiler, spec)

    monkeypatch.setattr(structured_output, "compile_spec", compile_spec)
    yield gate, calls
    gate.set()


def test_one_tenants_heavy_grammars_do_not_hold_up_anothers(gated):
    gate, _ = gated
    compiler = tiny_compiler(threads=2)
    hostile = [compiler.compile(regex(f"slow{i}[ab]"), tenant="mallory") for i in range(6)]
    honest = compiler.compile(regex("[ab]{2}"), tenant="alice")
    assert honest.result(timeout=10) is not None  # while every hostile compile is stuck
    assert not any(f.done() for f in hostile)
    gate.set()
    assert all(f.result(timeout=30) is not None for f in hostile)
    compiler.shutdown()


def test_an_abandoned_compile_never_starts(gated):
    gate, calls = gated
    compiler = tiny_compiler(threads=1)
    running = compiler.compile(regex("slow[ab]"), tenant="t")
    time.sleep(0.05)
    queued = compiler.compile(regex("slowc[ab]"), tenant="t")
    assert compiler.abandon(queued) and not compiler.abandon(running)  # running ones finish
    gate.set()
    running.result(timeout=30)
    time.sleep(0.05)
    assert calls == ["slow[ab]"]
    again = compiler.compile(regex("slowc[ab]"), tenant="t")  # asked again: compiled afresh
    assert again is not queued and again.result(timeout=30) is not None
    compiler.shutdown()


def test_the_cache_is_bounded_in_bytes():
    compiler = tiny_compiler(threads=1, cache_bytes=20_000)
    futures = [compiler.compile(regex(f"[ab]{{{i}}}c")) for i in range(1, 40)]
    for f in futures:
        f.result(timeout=30)
    time.sleep(0.05)
    assert 0 < compiler.num_bytes <= 20_000
    assert compiler.compile(regex("[ab]{39}c")) is futures[-1]  # the latest stay
    assert compiler.compile(regex("[ab]{1}c")) is not futures[0]  # the oldest went
    compiler.shutdown()


def test_choice_counts_against_the_grammar_size_cap():
    def decode(choice):
        return decode_request(msgpack.packb({"v": 1, "id": "c", "reply_topic": "t", "prompt": "x",
                                             "structured": {"choice": choice}}))

    with pytest.raises(InvalidRequest, match=f"structured.choice: .* at most {MAX_GRAMMAR_BYTES}"):
        decode(["a" * 1024] * 256)  # each option within its own cap, 256 of them: 256 KiB
    assert decode(["a" * 1024] * 60).structured.choice


def test_json_grammars_allow_no_whitespace_between_tokens():
    """Compact separators and no free whitespace (xgrammar's any_whitespace=False): a sampled
    small model cannot wander into a run of blanks between JSON tokens."""
    compiler = tiny_compiler(threads=1)
    for spec in (StructuredSpec("response_format", "json_object", ""),
                 StructuredSpec("response_format", "json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}')):
        matcher = xgr.GrammarMatcher(compiler.compile(spec).result(timeout=30))
        assert matcher.accept_string("{")
        assert not matcher.accept_string(" ") and not matcher.accept_string("\n")
    compiler.shutdown()
