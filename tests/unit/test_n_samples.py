"""n > 1 samples of one prompt (issue #28): the prompt is computed once and its full KV blocks
are shared; sample i draws with seed + i and equals that sample run alone."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.contract.schema import MAX_N, InvalidRequest, Request, decode_request, encode_request
from tests.engine_fixtures import make_engine
from inferline.worker.engine.engine import LLMEngine, sample_seed
from inferline.worker.engine.request import EngineRequest, SamplingParams, StructuredSpec

HOT = dict(temperature=0.9, top_p=0.95, top_k=50)


def run(engine: LLMEngine, *reqs: EngineRequest, abort_after: int | None = None) -> dict:
    """Step until idle; per request: tokens and text per sample index, the final output, the
    prompt tokens computed (all steps' batched tokens) and how often it started."""
    for req in reqs:
        engine.add_request(req)
    results: dict[str, dict] = {}
    computed, step = 0, 0
    while engine.has_unfinished_requests():
        if step == abort_after:
            for req in reqs:
                engine.abort(req.request_id, "cancelled")
        for out in engine.step():
            r = results.setdefault(
                out.request_id,
                {"tokens": {}, "text": {}, "logprobs": {}, "final": None, "started": 0},
            )
            r["tokens"].setdefault(out.index, []).extend(out.new_token_ids)
            r["text"][out.index] = r["text"].get(out.index, "") + out.text_delta
            r["logprobs"].setdefault(out.index, []).extend(out.logprobs or [])
            r["started"] += out.started
            if out.finished:
                assert r["final"] is None, "finished twice"
                r["final"] = out
        computed += engine.stats().num_batched_tokens
        engine.check_integrity()
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    results["computed"] = computed
    return results


def req(rid: str, ids: list[int], **sampling) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(**sampling))


@pytest.fixture(scope="module")
def prompt(prompts) -> list[int]:
    return prompts[7]  # ~40 tokens: a few full blocks and a partial one


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_each_sample_equals_its_seed_alone(model_runner, prompt, prefix_caching):
    n, seed, max_tokens = 4, 1234, 16
    engine = make_engine(model_runner, enable_prefix_caching=prefix_caching)
    r = run(
        engine, req("r", prompt, n=n, seed=seed, max_tokens=max_tokens, ignore_eos=True, **HOT)
    )["r"]
    final = r["final"]
    assert r["started"] == 1 and sorted(r["tokens"]) == list(range(n))
    assert [s.index for s in final.samples] == list(range(n))
    for i in range(n):
        alone = run(
            make_engine(model_runner, enable_prefix_caching=prefix_caching),
            req("a", prompt, seed=seed + i, max_tokens=max_tokens, ignore_eos=True, **HOT),
        )["a"]
        assert r["tokens"][i] == alone["tokens"][0], (
            f"sample {i} differs from seed {seed + i} alone"
        )
        assert final.samples[i].text == r["text"][i] == alone["final"].text
        assert (
            final.samples[i].finish_reason == "length"
            and final.samples[i].num_output_tokens == max_tokens
        )
    assert len({tuple(t) for t in r["tokens"].values()}) > 1, (
        "the samples should differ at temperature 0.9"
    )
    assert final.finish_reason == "length" and final.text == r["text"][0]
    assert final.num_output_tokens == n * max_tokens and final.num_prompt_tokens == len(prompt)


def test_the_prompt_is_computed_once(model_runner, prompt):
    # Without the prefix cache, only the fork can share: samples 1..n-1 compute the partial
    # last block alone, not the prompt.
    n, max_tokens = 4, 8
    engine = make_engine(model_runner, enable_prefix_caching=False)
    bs = engine.block_manager.block_size
    results = run(
        engine, req("r", prompt, n=n, seed=1, max_tokens=max_tokens, ignore_eos=True, **HOT)
    )
    tail = len(prompt) - (len(prompt) - 1) // bs * bs
    decoded = n * (max_tokens - 1)  # each sampled token but the last is computed once
    assert results["computed"] == len(prompt) + (n - 1) * tail + decoded
    assert engine.stats().num_forks == n - 1


def test_greedy_samples_are_identical_and_equal_hf_generate(model_runner, hf_model, prompt):
    max_tokens = 24
    r = run(
        make_engine(model_runner), req("g", prompt, n=2, max_tokens=max_tokens, temperature=0.0)
    )["g"]
    with torch.inference_mode():
        x = torch.tensor([prompt])
        y = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    expected = y[0, len(prompt) :].tolist()
    assert r["tokens"][0] == r["tokens"][1] == expected[: len(r["tokens"][0])]
    assert r["final"].samples[0].text == r["final"].samples[1].text


def test_cancel_ends_every_sample(model_runner, prompt):
    engine = make_engine(model_runner)
    r = run(
        engine, req("c", prompt, n=3, seed=5, max_tokens=200, ignore_eos=True, **HOT), abort_after=4
    )["c"]
    final = r["final"]
    assert final.finish_reason == "cancelled" and final.error_code == "cancelled"
    assert [s.finish_reason for s in final.samples] == ["cancelled"] * 3
    assert all(0 < s.num_output_tokens < 200 for s in final.samples)  # all were running
    assert not engine.has_unfinished_requests()


def test_cancel_before_the_fork_ends_samples_that_never_ran(model_runner, prompt):
    engine = make_engine(model_runner)
    r = run(engine, req("c", prompt, n=3, max_tokens=50, **HOT), abort_after=0)["c"]
    assert [(s.finish_reason, s.text) for s in r["final"].samples] == [("cancelled", "")] * 3


def test_deadline_ends_every_sample(model_runner, prompt):
    import time

    engine = make_engine(model_runner)
    engine.add_request(
        EngineRequest(
            request_id="t",
            prompt_token_ids=prompt,
            deadline=time.time() + 3600,
            sampling=SamplingParams(n=2, max_tokens=200, ignore_eos=True, **HOT),
        )
    )
    for _ in range(3):
        engine.step()
    engine.requests["t"][0].deadline = time.time() - 1  # the deadline passes mid-run
    (out,) = [o for o in engine.step() if o.finished]
    assert (
        out.finish_reason == "timeout" and [s.finish_reason for s in out.samples] == ["timeout"] * 2
    )
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_samples_survive_preemption(model_runner, prompt):
    # A pool that holds every sample of `p` (the fit check counts n), but not `p` and `q` at
    # once: sequences preempt each other and recompute.
    n, max_tokens = 4, 40
    params = dict(n=n, seed=77, max_tokens=max_tokens, ignore_eos=True, **HOT)
    roomy = run(make_engine(model_runner), req("p", prompt, **params))["p"]
    engine = make_engine(
        model_runner, num_blocks=engine_blocks(model_runner, len(prompt), max_tokens, n)
    )
    tight = run(
        engine,
        req("p", prompt, **params),
        req("q", prompt[::-1], n=2, seed=5, max_tokens=max_tokens, ignore_eos=True, **HOT),
    )["p"]
    assert engine.scheduler.num_preemptions > 0
    assert tight["tokens"] == roomy["tokens"]


def engine_blocks(model_runner, num_prompt_tokens: int, max_tokens: int, n: int) -> int:
    """The prompt's full blocks once, each sample's own blocks n times."""
    bs = model_runner.block_size
    shared = (num_prompt_tokens - 1) // bs if n > 1 else 0
    return shared + n * (-(-(num_prompt_tokens + max_tokens) // bs) - shared)


def test_the_fit_check_counts_every_sample(model_runner, prompt):
    """A request whose n samples cannot all be in the KV cache at once is rejected at once
    (naming n), instead of thrashing by recompute; one block more and it runs (issue 38)."""
    n, max_tokens = 4, 40
    needed = engine_blocks(model_runner, len(prompt), max_tokens, n)
    engine = make_engine(model_runner, num_blocks=needed - 1)
    assert (
        engine.num_blocks_needed(len(prompt), max_tokens, n)
        == needed
        > engine_blocks(model_runner, len(prompt), max_tokens, 1)
    )
    final = run(engine, req("p", prompt, n=n, max_tokens=max_tokens, ignore_eos=True, **HOT))["p"][
        "final"
    ]
    assert final.finish_reason == "rejected" and final.error_code == "prompt_too_long"
    assert final.error_message.startswith(f"n ({n}) samples")
    engine = make_engine(model_runner, num_blocks=needed)
    r = run(engine, req("p", prompt, n=n, max_tokens=max_tokens, ignore_eos=True, **HOT))["p"]
    assert r["final"].finish_reason == "length" and engine.scheduler.num_preemptions == 0


def test_structured_output_and_logprobs_per_sample(model_runner, prompt):
    choices = ["positive", "negative", "neutral"]
    spec = StructuredSpec("structured", "choice", json.dumps(choices))
    r = run(
        make_engine(model_runner),
        req("s", prompt, n=3, seed=3, max_tokens=16, structured=spec, logprobs=2, **HOT),
    )["s"]
    assert all(s.text in choices and s.finish_reason == "stop" for s in r["final"].samples)
    for i in range(3):
        # Tokens the grammar forbids are never listed: at most 2 alternatives, often fewer.
        assert len(r["logprobs"][i]) == len(r["tokens"][i]) and all(
            1 <= len(lp["top_logprobs"]) <= 2 for lp in r["logprobs"][i]
        )


def test_n_1_output_has_no_samples(model_runner, prompt):
    r = run(make_engine(model_runner), req("one", prompt, max_tokens=4, temperature=0.0))["one"]
    assert r["final"].samples is None and set(r["tokens"]) == {0}


def test_sample_seeds_wrap_into_the_seed_range():
    assert sample_seed(None, 3) is None and sample_seed(7, 0) == 7 and sample_seed(7, 2) == 9
    assert sample_seed(2**64 - 1, 1) == 0 and sample_seed(2**64 - 2, 1) == 2**64 - 1
    assert sample_seed(-(2**63), 1) == 1 - 2**63


# ---- the wire -----------------------------------------------------------------------------------


def wire(**fields) -> bytes:
    return encode_request(Request(id="x", reply_topic="inferline.reply.t", prompt="hi", **fields))


def test_n_is_on_the_wire_with_a_cap():
    assert decode_request(wire(n=3)).n == 3 and decode_request(wire()).n == 1
    import msgpack

    for bad in (0, MAX_N + 1):
        raw = msgpack.unpackb(wire())
        raw["n"] = bad
        with pytest.raises(InvalidRequest) as info:
            decode_request(msgpack.packb(raw))
        assert info.value.field == "n"


def test_waiting_forks_let_go_of_their_blocks_when_nothing_else_can_free_memory(
    model_runner, prompt, prompts
):
    # Forks of `r` wait holding its prompt's blocks; `h` (a better priority) preempts `r` and then
    # needs every other block. Nothing running could free them: the forks must let go.
    engine = make_engine(model_runner, num_blocks=12)
    engine.add_request(req("r", prompt, n=4, seed=1, max_tokens=8, ignore_eos=True, **HOT))
    engine.step()  # r computes its prompt; samples 1..3 fork onto its blocks
    assert sum(bool(s.block_table) for s in engine.scheduler.waiting) == 3
    long_prompt = (prompts[4] * 3)[:150]
    engine.add_request(
        EngineRequest(
            request_id="h",
            prompt_token_ids=long_prompt,
            priority=-1,
            sampling=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        )
    )
    finished = set()
    for _ in range(400):
        finished |= {o.request_id for o in engine.step() if o.finished}
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert finished == {"r", "h"}


# ---- the gateway's mapping (no broker) -----------------------------------------------------------


def test_the_gateway_maps_n_and_answers_one_choice_per_sample():
    from inferline.producer.gateway.follower import TextFollower
    from inferline.producer.gateway.openai_mapping import chat_request
    from inferline.producer.gateway.openai_responses import Shape
    from inferline.contract.schema import DoneEvent, Sample, Timing, TokensEvent, Usage

    assert chat_request({"messages": [{"role": "user", "content": "x"}], "n": 3}).fields["n"] == 3
    samples = [
        Sample(index=i, text=t, finish_reason=r, completion_tokens=2)
        for i, (t, r) in enumerate([("a", "stop"), ("b", "length")])
    ]
    body = Shape(True, "r", "m").whole(
        "a", "stop", Usage(prompt_tokens=1, completion_tokens=4), samples
    )
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]
    second = TextFollower(1)
    assert (
        second.feed(TokensEvent(id="r", attempt="a", seq=1, token_ids=[1], text="x", index=0)) == ""
    )
    assert (
        second.feed(TokensEvent(id="r", attempt="a", seq=2, token_ids=[1], text="b", index=1))
        == "b"
    )
    done = DoneEvent(
        id="r",
        attempt="a",
        seq=3,
        finish_reason="stop",
        text="a",
        samples=samples,
        usage=Usage(prompt_tokens=1, completion_tokens=4),
        timing=Timing(queue_s=0, ttft_s=0, total_s=0),
    )
    assert second.feed(done) == "" and TextFollower(0).feed(done) == "a"


# ---- the intake's bound on n x max_tokens (no model) ---------------------------------------------


@pytest.mark.parametrize(
    "n, max_tokens, limits, refused",
    [
        (16, 256, {}, None),  # the default bound admits n=16 at 256 tokens each
        (16, 1024, {}, "n"),
        (4, 5000, {}, "max_tokens"),  # over the cap of 1024: refused, never cut (issue 50)
        (5, 1024, {}, "n"),
        (2, 100, {"max_request_tokens": 150}, "n"),
        (1, 200, {"max_request_tokens": 150, "max_tokens_cap": 150}, "max_tokens"),
        (1, 150, {"max_request_tokens": 150, "max_tokens_cap": 150}, None),
        (16, None, {}, None),  # left out: 4096 / 16 = 256 each, not the cap of 1024 (issue 50)
        (5, None, {"max_request_tokens": 4}, "n"),  # not even one token each
    ],
)
def test_n_times_max_tokens_is_bounded_per_request(n, max_tokens, limits, refused):
    """INFERLINE_LIMITS__MAX_REQUEST_TOKENS bounds n x max_tokens: over it the request is
    rejected naming `n` (issue 38); the rate limiter already charged every sample."""
    import msgpack

    from inferline.config.settings import Settings
    from tests.chaos_fixtures import IntakeHarness

    h = IntakeHarness(Settings(limits=limits))
    sent, added = h.feed(
        msgpack.packb(
            {
                "v": 1,
                "id": "big-n",
                "reply_topic": "inferline.reply.c",
                "prompt": "Hi.",
                "n": n,
                **({} if max_tokens is None else {"max_tokens": max_tokens}),
            }
        )
    )
    assert bool(added) is (refused is None)
    if refused:
        (done,) = sent
        error = msgpack.unpackb(done.value)["error"]
        assert error["code"] == "invalid_request" and error["message"].startswith(f"{refused}: ")
