"""Structured outputs (constrained decoding) and logprobs: the wire fields, the grammar compiler,
the bitmask in the sampler, and the engine on the default model against HF transformers."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import msgpack
import numpy as np
import pytest
import torch
import xgrammar as xgr

from inferline.contract.schema import InvalidRequest, decode_request
from tests.engine_fixtures import greedy, make_engine, prompt_ids
from inferline.worker.engine.request import EngineRequest, SamplingParams, StructuredSpec
from inferline.worker.engine.sampler import Sampler, make_stream
from inferline.worker.engine.structured_output import GrammarCompiler, apply_token_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "member", "role", "tags", "address"],
    "additionalProperties": False,
}
ASK_PERSON = [
    {
        "role": "user",
        "content": "Describe a fictional person as a JSON object with their name, age, "
        "whether they are a member, their role, some tags and their address.",
    }
]
SEEDS = range(6)


def spec(kind: str, text: str, field: str = "structured") -> StructuredSpec:
    return StructuredSpec(field, kind, text)


def schema_spec(schema: dict) -> StructuredSpec:
    return spec("json_schema", json.dumps(schema), "response_format")


def run(engine, reqs: list[EngineRequest]) -> dict[str, dict]:
    """Step until every request finished (grammars still compiling count as unfinished)."""
    for r in reqs:
        engine.add_request(r)
    results: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "logprobs": [], "final": None})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.logprobs or []
            if out.finished:
                r["final"] = out
        engine.check_integrity()
    return results


def sampled(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, **kw)


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# --------------------------------------------------------------------------- the wire fields


def decode(**fields):
    return decode_request(
        msgpack.packb({"v": 1, "id": "r", "reply_topic": "t", "prompt": "x", **fields})
    )


@pytest.mark.parametrize(
    "fields, constraint",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
                }
            },
            ("response_format", "json_schema", '{"type":"object"}'),
        ),
        ({"response_format": {"type": "json_object"}}, ("response_format", "json_object", "")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured": {"regex": "[a-z]+"}}, ("structured", "regex", "[a-z]+")),
        ({"structured": {"choice": ["yes", "no"]}}, ("structured", "choice", '["yes", "no"]')),
        ({"structured": {"grammar": 'root ::= "a"'}}, ("structured", "grammar", 'root ::= "a"')),
        (
            {"response_format": {"type": "text"}, "structured": {"regex": "a"}},
            ("structured", "regex", "a"),
        ),
    ],
)
def test_constraints_decode(fields, constraint):
    assert decode(**fields).output_constraint() == constraint


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad name!", "schema": {}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"a": b"bin"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"a": "x" * 70_000}},
                }
            },
            "response_format",
        ),
        ({"structured": {}}, "structured"),
        ({"structured": {"regex": "a", "choice": ["a"]}}, "structured"),
        ({"structured": {"choice": []}}, "structured"),
        ({"structured": {"choice": ["a"] * 257}}, "structured"),
        ({"structured": {"regex": ""}}, "structured"),
        ({"structured": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_broken_constraints_are_rejected_naming_the_field(fields, field):
    with pytest.raises(InvalidRequest) as err:
        decode(**fields)
    assert err.value.field == field and err.value.message.startswith(field)


def test_logprobs_fields_decode():
    req = decode(logprobs=True, top_logprobs=20)
    assert (req.logprobs, req.top_logprobs) == (True, 20)


# ----------------------------------------------------------------------- compiler, bitmask, sampler


@pytest.fixture(scope="module")
def compiler(model_runner) -> GrammarCompiler:
    tokenizer = model_runner.tokenizer
    compiler = GrammarCompiler(tokenizer, model_runner.config.vocab_size, [tokenizer.eos_token_id])
    compiler.compile(spec("regex", "[0-9]")).result(
        timeout=300
    )  # its processes started (slow on a busy machine)
    return compiler


def test_grammars_are_cached_by_their_text(compiler):
    a = compiler.compile(spec("regex", "[0-9]{3}"))
    assert compiler.compile(spec("regex", "[0-9]{3}")) is a
    assert compiler.compile(spec("regex", "[0-9]{4}")) is not a
    assert a.result(timeout=30) is not None


@pytest.mark.parametrize(
    "bad",
    [
        spec("regex", "("),
        spec("grammar", "root ::= ("),
        spec("json_schema", '{"type": "nope"}', "response_format"),
    ],
)
def test_a_grammar_that_cannot_compile_fails_with_a_reason(compiler, bad):
    with pytest.raises(ValueError, match="cannot be compiled: .+"):
        compiler.compile(bad).result(timeout=30)


def random_bitmask(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An int32 bitmask [rows, words] and the bool mask it encodes (numpy's own bit order)."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, vocab)) < 0.3
    padded = np.zeros((rows, -(-vocab // 32) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    words = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(words.copy()), torch.from_numpy(allowed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bitmask_masks_exactly_the_forbidden_tokens(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab = 100
    bitmask, allowed = random_bitmask(3, vocab)
    logits = torch.randn(3, vocab + 12, device=device)  # a model's padded vocabulary
    masked = apply_token_bitmask(logits.clone(), bitmask.to(device)).cpu()
    assert torch.equal(masked[:, :vocab].isinf(), ~allowed)
    assert masked[:, vocab:].isinf().all()
    assert torch.equal(masked[:, :vocab][allowed], logits.cpu()[:, :vocab][allowed])


def test_sampler_never_draws_a_forbidden_token():
    vocab = 96
    bitmask, allowed = random_bitmask(2, vocab, seed=1)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=3),
        SamplingParams(temperature=0.0),
    ]
    sampler = Sampler()
    for _ in range(50):
        tokens = sampler(
            logits, params, [[]] * 3, [[]] * 3, [None, make_stream(_), None], bitmask, [0, 1]
        )
        assert allowed[0, tokens[0]] and allowed[1, tokens[1]]
    assert tokens[0] == logits[0].masked_fill(~allowed[0], float("-inf")).argmax()
    assert tokens[2] == logits[2].argmax()  # an unconstrained row is untouched
    assert torch.equal(logits, before)


def test_sampler_logprobs_are_log_softmax_after_penalties():
    logits = torch.randn(2, 64)
    params = [
        SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.3, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler().sample(logits, params, [[3, 4], [1]], [[5], []], [make_stream(1), None])
    penalized = logits.clone()
    for t in (3, 4, 5):
        v = penalized[0, t]
        penalized[0, t] = v / 1.3 if v > 0 else v * 1.3
    expected = torch.log_softmax(penalized, dim=-1)
    first = out.logprobs[0]
    assert first["logprob"] == pytest.approx(expected[0, out.token_ids[0]].item(), abs=1e-6)
    top = expected[0].topk(5)
    assert [e["token_id"] for e in first["top_logprobs"]] == top.indices.tolist()
    assert [e["logprob"] for e in first["top_logprobs"]] == pytest.approx(
        top.values.tolist(), abs=1e-6
    )
    assert out.logprobs[1]["top_logprobs"] == [] and out.token_ids[1] == logits[1].argmax()


# ------------------------------------------------------------------------ the engine, default model


def test_json_schema_holds_where_free_sampling_breaks_it(shallow_runner):
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    engine = make_engine(model_runner)
    free = [EngineRequest(f"free-{s}", sampled(160, s), messages=ASK_PERSON) for s in SEEDS]
    bound = [
        EngineRequest(
            f"json-{s}", sampled(160, s, structured=schema_spec(PERSON)), messages=ASK_PERSON
        )
        for s in SEEDS
    ]
    results = run(engine, free + bound)
    assert not all(validates(results[r.request_id]["final"].text, PERSON) for r in free)
    for r in bound:
        final = results[r.request_id]["final"]
        assert final.finish_reason == "stop", final.text
        assert validates(final.text, PERSON), final.text


def test_json_object_always_parses(model_runner, compiler):
    """Every output that ends parses as an object; one cut by max_tokens (a sampled small model
    may wander inside a string) is still a prefix the grammar accepts."""
    engine = make_engine(model_runner)
    ask = [
        {
            "role": "system",
            "content": 'You reply with one short JSON object, like {"animal": "cat", "legs": 4}.',
        },
        {"role": "user", "content": "Give me three facts about cats as a JSON object."},
    ]
    json_object = spec("json_object", "", "response_format")
    reqs = [
        EngineRequest(f"obj-{s}", sampled(120, s, structured=json_object), messages=ask)
        for s in SEEDS
    ]
    results = run(engine, reqs)
    finals = [results[r.request_id]["final"] for r in reqs]
    assert sum(f.finish_reason == "stop" for f in finals) >= len(finals) // 2
    for r, final in zip(reqs, finals):
        if final.finish_reason == "stop":
            assert isinstance(json.loads(final.text), dict), final.text
        else:
            matcher = xgr.GrammarMatcher(compiler.compile(json_object).result())
            assert final.finish_reason == "length"
            assert all(matcher.accept_token(t) for t in results[r.request_id]["tokens"])


def test_regex_and_choice_outputs_match(shallow_runner):
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    engine = make_engine(model_runner)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["positive", "negative", "neutral"]
    ask = [{"role": "user", "content": "Is this review positive? 'The food was cold and late.'"}]
    reqs = [
        EngineRequest(f"re-{s}", sampled(30, s, structured=spec("regex", phone)), messages=ask)
        for s in SEEDS
    ]
    reqs += [
        EngineRequest(
            f"ch-{s}", sampled(30, s, structured=spec("choice", json.dumps(choices))), messages=ask
        )
        for s in SEEDS
    ]
    results = run(engine, reqs)
    for r in reqs:
        final = results[r.request_id]["final"]
        assert final.finish_reason == "stop"
        if r.request_id.startswith("re-"):
            assert re.fullmatch(phone, final.text), final.text
        else:
            assert final.text in choices


def hf_constrained_greedy(hf_model, info, compiled, ids: list[int], max_tokens: int) -> list[int]:
    """The reference: HF logits, the grammar's bitmask unpacked by numpy, argmax, in a plain
    loop."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    out, cache, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        while len(out) < max_tokens and not matcher.is_terminated():
            res = hf_model(x, cache=cache, use_cache=True)
            cache, logits = res.cache, res.logits[0, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            allowed = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[
                : logits.shape[0]
            ]
            logits[torch.from_numpy(allowed == 0)] = float("-inf")
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            x = torch.tensor([[token]])
    return out


@pytest.mark.slow
def test_greedy_under_a_grammar_equals_a_plain_pytorch_reference(
    shallow_runner, shallow_hf_model, compiler
):
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    hf_model = shallow_hf_model
    engine = make_engine(model_runner)
    schema = {
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": 30},
            "words": {"type": "integer", "minimum": 1, "maximum": 999},
            "tone": {"enum": ["formal", "casual"]},
        },
        "required": ["topic", "words", "tone"],
        "additionalProperties": False,
    }
    cases = [
        (schema_spec(schema), 0),
        (spec("regex", r"[A-Z][a-z]+( [a-z]+){2,5}\."), 1),
        (spec("choice", '["alpha", "beta", "gamma delta"]'), 2),
    ]
    reqs = [
        EngineRequest(
            f"g{i}",
            greedy(48, structured=s),
            prompt_token_ids=prompt_ids(model_runner.tokenizer, p),
        )
        for i, (s, p) in enumerate(cases)
    ]
    results = run(engine, reqs)
    for r, (s, _) in zip(reqs, cases):
        expected = hf_constrained_greedy(
            hf_model, compiler.info, compiler.compile(s).result(), r.prompt_token_ids, 48
        )
        assert results[r.request_id]["tokens"] == expected
        assert results[r.request_id]["final"].finish_reason == "stop"


@pytest.mark.slow
def test_logprobs_equal_hf_log_softmax(shallow_runner, shallow_hf_model):
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    hf_model = shallow_hf_model
    engine = make_engine(model_runner)
    reqs = [
        EngineRequest(
            f"lp{i}", greedy(16, logprobs=5), prompt_token_ids=prompt_ids(model_runner.tokenizer, i)
        )
        for i in range(3)
    ]
    results = run(engine, reqs)
    for r in reqs:
        tokens, logprobs = results[r.request_id]["tokens"], results[r.request_id]["logprobs"]
        assert len(logprobs) == len(tokens) == 16
        ids = r.prompt_token_ids + tokens
        with torch.inference_mode():
            logits = (
                hf_model(torch.tensor([ids[:-1]])).logits[0, len(r.prompt_token_ids) - 1 :].float()
            )
        expected = torch.log_softmax(logits, dim=-1)
        for j, (token, lp) in enumerate(zip(tokens, logprobs)):
            assert lp["logprob"] == pytest.approx(expected[j, token].item(), abs=1e-4)
            top = expected[j].topk(5)
            assert [e["logprob"] for e in lp["top_logprobs"]] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            assert lp["top_logprobs"][0]["token_id"] == token == top.indices[0].item()
            assert (
                lp["token"]
                == lp["top_logprobs"][0]["token"]
                == model_runner.tokenizer.decode([token])
            )
        # the tokens' own texts spell the output (ASCII here: no character split across tokens)
        assert "".join(lp["token"] for lp in logprobs) == model_runner.tokenizer.decode(tokens)


def test_an_uncompilable_grammar_is_rejected_naming_its_field(model_runner):
    engine = make_engine(model_runner)
    reqs = [
        EngineRequest(
            "bad-schema",
            greedy(8, structured=spec("json_schema", '{"type": 3}', "response_format")),
            prompt="hi",
        ),
        EngineRequest("bad-regex", greedy(8, structured=spec("regex", "a{2,1}")), prompt="hi"),
    ]
    results = run(engine, reqs)
    for r in reqs:
        final = results[r.request_id]["final"]
        assert final.finish_reason == "rejected" and final.error_code == "invalid_request"
        assert final.error_message.startswith(r.sampling.structured.field + ": cannot be compiled")


def test_a_compiling_grammar_never_stalls_the_batch(model_runner, monkeypatch):
    """A request whose grammar is still compiling waits outside the batch; the others decode."""
    from inferline.worker.engine import structured_output

    release, real = threading.Event(), structured_output.compile_spec
    monkeypatch.setattr(
        structured_output, "compile_spec", lambda *a: (release.wait(30), real(*a))[1]
    )
    engine = make_engine(model_runner)
    # no budget here; in the threads, where the patched compile_spec runs
    engine._structured = engine._structured.model_copy(
        update={"compile_timeout_s": 3600.0, "compile_processes": False}
    )
    engine.add_request(EngineRequest("free", greedy(6), prompt="Say hello."))
    engine.add_request(
        EngineRequest("slow", greedy(8, structured=spec("regex", "slow[0-9]")), prompt="Say hello.")
    )
    done = {}
    for _ in range(10):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "free" in done and "slow" not in done and engine.stats().num_waiting == 1
    release.set()
    done.update({r: res["final"] for r, res in run(engine, []).items()})
    assert done["slow"].finish_reason == "stop" and re.fullmatch("slow[0-9]", done["slow"].text)


def test_constrained_and_logprob_requests_get_no_drafts(shallow_runner):
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    looping = "red, green, blue, red, green, blue, red, green, blue, red, green, blue,"
    params = [
        greedy(12, structured=spec("regex", "(red|green|blue)(, (red|green|blue)){1,8}")),
        greedy(12, logprobs=1),
    ]
    reqs = lambda: [EngineRequest(f"s{i}", p, prompt=looping) for i, p in enumerate(params)]  # noqa: E731
    expected = run(make_engine(model_runner), reqs())
    spec_engine = make_engine(
        model_runner, speculative={"method": "ngram"}
    )  # claims the runner's cache
    got = run(spec_engine, reqs())
    assert spec_engine.stats().spec_draft_tokens == 0
    for rid in expected:
        assert got[rid]["tokens"] == expected[rid]["tokens"]
    control = make_engine(model_runner, speculative={"method": "ngram"})
    run(control, [EngineRequest("plain", greedy(12), prompt=looping)])
    assert control.stats().spec_draft_tokens > 0  # the same text unconstrained does get drafts


def test_the_gateway_maps_response_format_and_logprobs():
    from inferline.producer.gateway.openai_mapping import chat_request

    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "hi"}]
    assert (
        chat_request({"messages": messages, "response_format": fmt}).fields["response_format"]
        == fmt
    )
    assert "response_format" not in chat_request({"messages": messages}).fields
    fields = chat_request({"messages": messages, "logprobs": True, "top_logprobs": 3}).fields
    assert (fields["logprobs"], fields["top_logprobs"]) == (True, 3)


def test_no_grammar_engine_rejects_the_request_not_the_engine(model_runner, monkeypatch):
    from inferline.worker.engine import engine as engine_module

    def broken(*args):
        raise RuntimeError("tokenizer not supported")

    monkeypatch.setattr(engine_module, "GrammarCompiler", broken)
    engine = make_engine(model_runner)
    results = run(
        engine,
        [
            EngineRequest("c", greedy(4, structured=spec("regex", "a")), prompt="hi"),
            EngineRequest("p", greedy(4), prompt="hi"),
        ],
    )
    assert results["c"]["final"].finish_reason == "rejected"
    assert results["c"]["final"].error_message.startswith("structured: ")
    assert results["p"]["final"].finish_reason == "length"


def test_a_grammar_over_its_compile_budget_is_rejected_and_its_compile_killed(model_runner):
    """Issue 38: a grammar that does not compile within INFERLINE_STRUCTURED__COMPILE_TIMEOUT_S
    gets its request rejected naming the field; its compile's process is killed (it costs nobody
    more), a grammar queued behind it is dropped, the same grammar again is refused at once, and
    the others, constrained or not, go on. Default settings: compiles in child processes."""
    from inferline.config.settings import StructuredSettings

    # Seconds of xgrammar on the model's 49K vocabulary (19 s on a busy 2-core machine).
    heavy = json.dumps(
        {
            "type": "object",
            "properties": {
                f"k{i}": {"type": "string", "pattern": "[a-z]{3,90}[0-9]{2,50}"} for i in range(40)
            },
        }
    )
    engine = make_engine(model_runner)
    engine._structured = StructuredSettings(compile_timeout_s=0.3, compile_threads=2)
    engine.grammars.compile(spec("regex", "[0-9]")).result(timeout=300)
    for _ in range(600):  # both processes up (seconds each on a busy machine)
        if len(engine.grammars._children) == 2:
            break
        time.sleep(0.5)
    started = {p.pid for p in engine.grammars._children}
    assert len(started) == 2
    queued = heavy.replace("k0", "q0")
    reqs = [
        EngineRequest(
            "hostile", greedy(4, structured=spec("json_schema", heavy)), prompt="Hi.", tenant="m"
        ),
        EngineRequest(
            "queued", greedy(4, structured=spec("json_schema", queued)), prompt="Hi.", tenant="m"
        ),
        EngineRequest(
            "honest", greedy(4, structured=spec("regex", "[0-9]{2}")), prompt="Hi.", tenant="a"
        ),
        EngineRequest("plain", greedy(4), prompt="Hi."),
    ]
    results = run(engine, reqs)
    for rid in ("hostile", "queued"):
        final = results[rid]["final"]
        assert final.finish_reason == "rejected" and final.error_code == "invalid_request"
        assert final.error_message.startswith(
            "structured: the grammar did not compile within 0.3 s"
        )
    assert (
        results["honest"]["final"].finish_reason == "stop"
        and results["plain"]["final"].finish_reason == "length"
    )
    again = engine.grammars.compile(spec("json_schema", heavy))
    with pytest.raises(ValueError, match="did not compile within 0.3 s"):
        again.result(timeout=60)  # remembered: refused at once, never compiled again
    assert (
        engine.grammars.compile(spec("json_schema", queued)).cancelled() is False
    )  # dropped: asked afresh
    killed = started - {p.pid for p in engine.grammars._children}
    assert len(killed) == 1 and not _running(killed.pop())
    engine.grammars.shutdown()


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_grammar_whose_mask_costs_the_batch_too_much_is_ended(shallow_runner):
    """Issue 38: a row whose token mask alone is over INFERLINE_STRUCTURED__MASK_BUDGET_MS in 3
    steps in a row ends its request (`error`, naming the field); the rest of the batch goes on. A
    budget of 0 makes every constrained row over it."""
    model_runner = shallow_runner  # grammars do not depend on the model's depth
    engine = make_engine(model_runner)
    budget, model_runner.token_bitmask.budget_s = model_runner.token_bitmask.budget_s, 0.0
    try:
        results = run(
            engine,
            [
                EngineRequest(
                    "costly",
                    greedy(16, structured=spec("regex", "[a-z ]{10,40}")),
                    prompt="Say hello.",
                ),
                EngineRequest("plain", greedy(8, ignore_eos=True), prompt="Say hello."),
            ],
        )
    finally:
        model_runner.token_bitmask.budget_s = budget
    final = results["costly"]["final"]
    assert final.finish_reason == "error" and final.error_message.startswith(
        "structured: the grammar's token mask"
    )
    assert len(results["costly"]["tokens"]) == 3  # ended after its third step
    assert results["plain"]["final"].finish_reason == "length"
