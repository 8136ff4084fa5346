"""Grammar compiles a hostile producer cannot turn against everyone (issue 38): a pool that takes
tenants in turn, abandoned compiles, a cache bounded in bytes, `choice` under the size cap and
JSON without whitespace runs. Real xgrammar compiles over a tiny vocabulary (no model needed);
the engine's time budget is in tests/unit/test_structured_output.py."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import TimeoutError as FuturesTimeout

import msgpack
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferline.contract.schema import (
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_DEPTH,
    InvalidRequest,
    decode_request,
)
from inferline.worker.engine import structured_output
from inferline.worker.engine.request import StructuredSpec
from inferline.worker.engine.structured_output import GrammarCompiler

VOCAB = ["<eos>", "a", "b", "c", "0", "1", "{", "}", '"', ":", ",", " ", "\n", "ab", "x", "y"]


def tiny_compiler(**kw) -> GrammarCompiler:
    """In-thread compiles by default: these tests patch compile_spec, which a child process would
    not see (the processes have tests of their own below)."""
    kw.setdefault("processes", False)
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
        return decode_request(
            msgpack.packb(
                {
                    "v": 1,
                    "id": "c",
                    "reply_topic": "t",
                    "prompt": "x",
                    "structured": {"choice": choice},
                }
            )
        )

    with pytest.raises(InvalidRequest, match=f"structured.choice: .* at most {MAX_GRAMMAR_BYTES}"):
        decode(["a" * 1024] * 256)  # each option within its own cap, 256 of them: 256 KiB
    assert decode(["a" * 1024] * 60).structured.choice


def test_json_grammars_allow_no_whitespace_between_tokens():
    """Compact separators and no free whitespace (xgrammar's any_whitespace=False): a sampled
    small model cannot wander into a run of blanks between JSON tokens."""
    compiler = tiny_compiler(threads=1)
    for spec in (
        StructuredSpec("response_format", "json_object", ""),
        StructuredSpec(
            "response_format",
            "json_schema",
            '{"type":"object","properties":{"a":{"type":"integer"}}}',
        ),
    ):
        matcher = xgr.GrammarMatcher(compiler.compile(spec).result(timeout=30))
        assert matcher.accept_string("{")
        assert not matcher.accept_string(" ") and not matcher.accept_string("\n")
    compiler.shutdown()


# ---- fuzz: hostile grammars ----------------------------------------------------------------------


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = [  # (field, kind, text): depth, huge repetition counts, ambiguity, many alternatives
    ("regex", "a{1,100000}"),
    ("regex", "((a|b){50}){50}"),
    ("regex", "((a|ab)*)*b"),
    ("regex", "(a?){300}a{300}"),
    ("regex", "a{99999999}"),
    ("regex", "(" * 2000 + "a" + ")" * 2000),
    ("regex", "[^x]{1,65000}"),
    ("json_schema", json.dumps(nested_schema(30))),
    ("json_schema", '{"type":"string","maxLength":10000000}'),
    ("json_schema", '{"type":"array","minItems":100000,"items":{"type":"integer"}}'),
    ("json_schema", '{"type":"object","properties":{"a":{"$ref":"#"}}}'),
    ("json_schema", json.dumps({"anyOf": [{"const": f"v{i}"} for i in range(2000)]})),
    ("json_schema", '{"type":"string","pattern":"(a|a)*b"}'),
    ("grammar", 'root ::= x\nx ::= x x | "a" | "ab" | "b"'),
    ("grammar", 'root ::= r\nr ::= r "a" | "a"'),
    ("choice", json.dumps(["a" * 200 + str(i) for i in range(250)])),
]


def test_hostile_grammars_are_rejected_or_compiled_and_never_hold_up_others():
    """Each hostile grammar either compiles, fails with a reason (ValueError), or is still
    compiling when its budget is spent (then it is abandoned, as the engine does); an honest
    tenant's grammar compiles meanwhile, whatever the hostile tenant has queued."""
    compiler = tiny_compiler(threads=2)
    hostile = [
        compiler.compile(StructuredSpec("structured", kind, text), tenant="mallory")
        for kind, text in HOSTILE
    ]
    honest = compiler.compile(regex("[01]{8}"), tenant="alice")
    assert honest.result(timeout=60) is not None
    outcomes = Counter()
    for future in hostile:
        try:
            future.result(timeout=2.0)  # the engine's budget, shortened
            outcomes["compiled"] += 1
        except ValueError as exc:
            assert str(exc).startswith("cannot be compiled: "), exc
            outcomes["invalid"] += 1
        except FuturesTimeout:
            compiler.abandon(future)
            outcomes["over_budget"] += 1
    assert sum(outcomes.values()) == len(HOSTILE) and outcomes["invalid"] >= 1, outcomes
    compiler.shutdown()


repetition = st.builds(
    lambda lo, hi: f"{{{lo},{lo + hi}}}", st.integers(0, 10**6), st.integers(0, 10**6)
)
regexes = st.recursive(
    st.sampled_from(["a", "b", "ab", "[ab]", ".", "\\d", "[^a]", "(a|ab)"]),
    lambda inner: st.one_of(
        st.builds(lambda r, q: f"({r}){q}", inner, st.sampled_from(["*", "+", "?"]) | repetition),
        st.builds(lambda a, b: f"{a}|{b}", inner, inner),
        st.builds(lambda a, b: a + b, inner, inner),
    ),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(pattern=regexes)
def test_fuzz_hostile_regexes_end_in_a_bounded_outcome(pattern):
    """Random regexes with nested and huge repetition counts: through the contract (a field
    error, or a request), then the compiler: compiled, refused with a reason, or over budget."""
    data = msgpack.packb(
        {"v": 1, "id": "re", "reply_topic": "t", "prompt": "x", "structured": {"regex": pattern}}
    )
    try:
        req = decode_request(data)
    except InvalidRequest as exc:
        assert exc.field == "structured"
        return
    compiler = FUZZ_COMPILER
    future = compiler.compile(StructuredSpec(*req.output_constraint()), tenant="fuzz")
    try:
        future.result(timeout=2.0)
    except ValueError as exc:
        assert str(exc).startswith("cannot be compiled: ")
    except FuturesTimeout:
        compiler.abandon(future)


FUZZ_COMPILER = tiny_compiler(threads=2, cache_bytes=4 * 2**20)


@pytest.mark.parametrize("depth, ok", [(10, True), (31, True), (32, False), (500, False)])
def test_schema_nesting_is_capped(depth, ok):
    data = msgpack.packb(
        {
            "v": 1,
            "id": "d",
            "reply_topic": "t",
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": nested_schema(depth)},
            },
        }
    )
    if ok:
        assert decode_request(data).response_format.json_schema.schema_
    else:
        with pytest.raises(
            InvalidRequest, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
        ) as exc:
            decode_request(data)
        assert exc.value.field == "response_format"


def test_rows_whose_mask_is_over_budget_are_found():
    """TokenBitmask times each row alone when the batch's fill is over the budget (same bits);
    budget 0 makes every row slow, no budget none (the engine ends a request after 3 such steps)."""
    import torch

    from inferline.worker.engine.structured_output import TokenBitmask

    compiler = tiny_compiler(threads=1)
    matchers = [
        xgr.GrammarMatcher(compiler.compile(regex(r)).result(timeout=30))
        for r in ("[ab]+", "c", "[01]{2}")
    ]
    plain = TokenBitmask(len(VOCAB), torch.device("cpu")).fill(matchers).clone()
    timed = TokenBitmask(len(VOCAB), torch.device("cpu"), budget_s=0.0)
    assert torch.equal(timed.fill(matchers), plain) and timed.slow == [0, 1, 2]
    never = TokenBitmask(len(VOCAB), torch.device("cpu"), budget_s=None)
    never.fill(matchers)
    assert never.slow == []
    compiler.shutdown()


def test_a_compile_process_that_died_is_replaced_and_the_grammar_not_blamed():
    """A child process killed from outside (the OOM killer, say) between compiles: the next
    grammar is compiled by a fresh process, not refused as if it had crashed the compiler."""
    compiler = tiny_compiler(threads=1, processes=True)
    assert compiler.compile(regex("[ab]")).result(timeout=300) is not None
    (first,) = compiler._children
    first.kill()
    assert compiler.compile(regex("[ab]{3}")).result(timeout=300) is not None
    assert [p.pid for p in compiler._children] != [first.pid]
    compiler.shutdown()


def test_compile_processes_end_with_their_compiler():
    """An engine dropped without shutdown leaves no child processes behind (the threads hold
    the compiler weakly; its finalizer kills them)."""
    import gc

    compiler = tiny_compiler(threads=2, processes=True)
    assert compiler.compile(regex("[ab]")).result(timeout=300) is not None
    processes = list(compiler._children)
    del compiler
    gc.collect()
    for process in processes:
        assert process._proc.wait(timeout=30) is not None
