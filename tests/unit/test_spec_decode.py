"""Speculative decoding with n-gram drafts: the proposer, the acceptance rule, the scheduler's
rules for drafts, and the engine's greedy output (equal to HF's and to decoding without drafts)."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferline.config.settings import Settings, load_settings
from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.request import EngineRequest, SamplingParams
from inferline.worker.engine.scheduler import Scheduler
from inferline.worker.engine.sequence import Sequence
from inferline.worker.engine.spec_decode import NgramProposer, accept, can_speculate, find_last
from tests.engine_fixtures import NEW_TOKENS, greedy, make_engine, run_to_completion
from tests.unit.test_scheduler import FakeKV, check, fits

NGRAM = {"method": "ngram", "num_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}

# ---- the proposer ----------------------------------------------------------------------------


def naive_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, written plainly: longest n first, the most recent earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(num_tokens=3, max_n=3, min_n=1)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" occurs at 1 and 5 (3-gram "2 6 7" does not recur); the most recent (5) is
    # followed by 9 2 6
    assert p.propose(tokens) == [9, 2, 6]
    assert p.propose(tokens, limit=2) == [9, 2]
    assert p.propose(tokens, limit=0) == []
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert NgramProposer(3, max_n=3, min_n=3).propose(tokens) == []  # only 3-grams count


def test_a_match_ends_before_the_last_token_and_may_run_into_the_suffix():
    p = NgramProposer(num_tokens=4, max_n=2, min_n=1)
    assert p.propose([3, 3]) == [3]  # the earlier "3" is followed by the last one
    assert p.propose([1, 2, 1, 2]) == [1, 2]  # "1 2" at 0 is followed by the suffix itself


def test_byte_matches_that_straddle_tokens_are_not_token_matches():
    # As int32 bytes, [256, 0] contains the bytes of token 1 at an offset of one byte:
    # 256 = 00 01 00 00, then 00 00 00 00; the needle 1 = 01 00 00 00 occurs at byte 1.
    tokens = [256, 0, 7, 1]
    assert find_last(array("i", tokens).tobytes(), array("i", [1]).tobytes(), end=3) == -1
    assert NgramProposer(2, max_n=1, min_n=1).propose(tokens) == []
    assert NgramProposer(2, max_n=1, min_n=1).propose([1, 256, 0, 9, 1]) == [256, 0]


def test_the_proposer_equals_the_plain_definition_on_random_texts():
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 300, 70000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, max_n = rng.randrange(1, 6), rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        got = NgramProposer(k, max_n, min_n).propose(tokens)
        assert got == naive_propose(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_accept_keeps_drafts_up_to_the_first_miss_then_the_models_token():
    assert accept([], [9]) == [9]
    assert accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted + the bonus token
    assert accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]  # the first miss gives the model's token
    assert accept([1, 2, 3], [7, 2, 3, 4]) == [7]
    with pytest.raises(AssertionError):
        accept([1, 2], [1, 2])


def test_only_greedy_requests_without_penalties_are_drafted_for():
    assert can_speculate(SamplingParams(temperature=0.0))
    assert can_speculate(SamplingParams(temperature=0.0, top_k=5, seed=3, stop=("x",)))
    assert not can_speculate(SamplingParams(temperature=0.7))
    assert not can_speculate(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not can_speculate(SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert not can_speculate(SamplingParams(temperature=0.0, frequency_penalty=0.5))
    # drafts are checked against plain argmaxes: a bias would change them (issue 50, item 5)
    assert not can_speculate(SamplingParams(temperature=0.0, logit_bias=((7, 1.0),)))


def test_settings_refuse_an_empty_lookup_range():
    assert Settings().speculative.method == "none"
    with pytest.raises(SystemExit, match="INFERLINE_SPECULATIVE"):
        load_settings(
            speculative={"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}
        )
    with pytest.raises(SystemExit, match="INFERLINE_SPECULATIVE__NUM_TOKENS"):
        load_settings(speculative={"num_tokens": 0})


# ---- the scheduler ---------------------------------------------------------------------------

REPEATING = [1, 2, 3, 4] * 4  # 16 tokens: every 1..4-gram recurs


def scheduler_with(
    seqs: list[Sequence],
    num_blocks: int = 64,
    budget: int = 512,
    disable_by_batch_size: int | None = None,
) -> Scheduler:
    """Admitted and prefilled, so each of `seqs` decodes next (blocks of 4 tokens, no prefix cache);
    the token "sampled" continues the 1 2 3 4 pattern."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(
        bm,
        64,
        budget,
        proposer=NgramProposer(4, 4, 1),
        spec_disable_batch_size=disable_by_batch_size,
    )
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()  # admits them and computes their whole prompts: a token is sampled
    for chunk in out.scheduled:
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
        chunk.seq.output_token_ids.append(REPEATING[len(chunk.seq.token_ids) % 4])
    return sched


def test_greedy_decodes_get_drafts_and_sampled_ones_do_not():
    g = Sequence("g", list(REPEATING), greedy(64), arrival_time=1.0)
    s = Sequence(
        "s", list(REPEATING), SamplingParams(max_tokens=64, temperature=0.8), arrival_time=2.0
    )
    sched = scheduler_with([g, s])
    out = sched.schedule()
    by_id = {c.seq.request_id: c for c in out.scheduled}
    assert by_id["g"].spec_token_ids == [2, 3, 4, 1] and by_id["g"].num_new_tokens == 5
    assert by_id["s"].spec_token_ids == [] and by_id["s"].num_new_tokens == 1
    assert by_id["g"].samples and by_id["s"].samples
    # Slots for every row of the chunk: the last token, then the four drafts.
    assert len(g.block_table) * 4 >= g.num_computed_tokens + 5
    sched.block_manager.check_integrity(sched.running)


def test_drafts_fit_the_token_budget_and_max_tokens():
    g = Sequence("g", list(REPEATING), greedy(3), arrival_time=1.0)
    sched = scheduler_with([g])
    assert sched.schedule().scheduled[0].spec_token_ids == [
        2
    ]  # 1 output so far: 1 + 1 draft + 1 = 3
    g2 = Sequence("g2", list(REPEATING), greedy(64), arrival_time=1.0)
    sched = scheduler_with([g2], budget=16)
    sched.max_num_batched_tokens = 3
    assert sched.schedule().scheduled[0].spec_token_ids == [2, 3]


def test_drafts_never_take_blocks_later_sequences_need():
    # Two 15-token prompts, blocks of 4: after prefill each holds 4 blocks and its 16th token (the
    # first sampled) is computed next in the last slot of its 4th block. 9 blocks: 1 free. Drafts
    # for g0 would need it, and g1 after it may: g0 gets none. g1, the last, may take it.
    seqs = [Sequence(f"g{i}", REPEATING[:15], greedy(64), arrival_time=float(i)) for i in range(2)]
    sched = scheduler_with(seqs, num_blocks=9)
    out = sched.schedule()
    assert [c.spec_token_ids for c in out.scheduled] == [[], [1, 2, 3, 4]]
    assert not out.preempted and sched.num_preemptions == 0
    sched.block_manager.check_integrity(sched.running)


def test_drafts_take_no_new_block_while_a_request_waits():
    g = Sequence("g", list(REPEATING), greedy(64), arrival_time=1.0)
    sched = scheduler_with([g])  # 17 tokens in 4-token blocks: the 5th block is needed anyway
    sched.add(Sequence("w", list(range(100, 140)), greedy(8), arrival_time=2.0))
    sched.max_num_seqs = 1  # w cannot be admitted this step: it waits
    chunk = sched.schedule().scheduled[0]
    # The next token's block has 3 free slots after it: drafts fit there, a 6th block is not taken.
    assert chunk.spec_token_ids == [2, 3, 4] and len(g.block_table) == 5
    sched.waiting.clear()
    g.num_computed_tokens += 1
    g.output_token_ids.append(2)
    assert (
        len(sched.schedule().scheduled[0].spec_token_ids) == 4
    )  # nobody waits: a new block is fine


def test_no_drafts_at_or_above_the_disable_batch_size():
    seqs = [Sequence(f"g{i}", list(REPEATING), greedy(64), arrival_time=float(i)) for i in range(3)]
    assert all(
        c.spec_token_ids for c in scheduler_with(seqs, disable_by_batch_size=4).schedule().scheduled
    )
    seqs = [Sequence(f"g{i}", list(REPEATING), greedy(64), arrival_time=float(i)) for i in range(3)]
    assert not any(
        c.spec_token_ids for c in scheduler_with(seqs, disable_by_batch_size=3).schedule().scheduled
    )


# ---- the engine: greedy output is unchanged ---------------------------------------------------


def request(rid: str, ids: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=params)


def tokens_of(results: dict) -> dict[str, list[int]]:
    return {rid: r["tokens"] for rid, r in results.items()}


def test_drafted_greedy_output_equals_hf_generate(model_runner, prompts, hf_outputs):
    engine = make_engine(model_runner, speculative=NGRAM)
    arrivals = {i: [request(f"r{i}", ids, greedy(NEW_TOKENS))] for i, ids in enumerate(prompts)}
    results = run_to_completion(engine, arrivals)
    for i, want in enumerate(hf_outputs):
        assert results[f"r{i}"]["tokens"] == want, f"prompt {i}"
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens


def repetitive_prompt(tokenizer) -> list[int]:
    """A plain-text prompt SmolLM2 continues with the same few words in loops: n-gram heaven.
    (Chat answers of this small model repeat themselves far less: ~10% of steps gain a token.)"""
    return tokenizer(
        "red, green, blue, yellow, purple, red, green, blue, yellow, purple, red, green,"
    )["input_ids"]


def test_a_repetitive_text_takes_fewer_steps_with_the_same_tokens(model_runner):
    ids = repetitive_prompt(model_runner.tokenizer)
    plain = make_engine(model_runner)  # an engine takes the runner's KV cache over: one at a time
    want = run_to_completion(plain, {0: [request("a", ids, greedy(64, ignore_eos=True))]})["a"][
        "tokens"
    ]
    drafted = make_engine(model_runner, speculative=NGRAM)
    got = run_to_completion(drafted, {0: [request("a", ids, greedy(64, ignore_eos=True))]})["a"][
        "tokens"
    ]
    assert got == want
    stats = drafted.stats()
    # The model loops over the colours: ~half the drafts are right, and there are far fewer steps
    # than tokens (64 tokens took 23 steps with these settings).
    assert stats.spec_accepted_tokens > 0.3 * stats.spec_draft_tokens > 0
    assert stats.num_steps < 0.6 * plain.stats().num_steps


def mixed_requests(prompts, tokenizer) -> list[EngineRequest]:
    rep = repetitive_prompt(tokenizer)
    return [
        request("greedy", rep, greedy(40, ignore_eos=True)),
        request("stop-string", rep, greedy(40, stop=("blue, yellow",))),
        request("short", rep, greedy(5, ignore_eos=True)),
        request(
            "seeded", prompts[1], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7)
        ),
        request("penalty", rep, greedy(30, repetition_penalty=1.3)),
        request("eos", prompts[2], greedy(60)),
    ]


def test_every_kind_of_request_gets_the_same_output_with_drafts(model_runner, prompts):
    """Stops inside accepted drafts, max_tokens, seeded sampling and penalties beside drafted
    rows."""
    plain = run_to_completion(
        make_engine(model_runner), {0: mixed_requests(prompts, model_runner.tokenizer)}
    )
    engine = make_engine(model_runner, speculative=NGRAM)
    drafted = run_to_completion(engine, {0: mixed_requests(prompts, model_runner.tokenizer)})
    assert tokens_of(drafted) == tokens_of(plain)
    for rid in plain:
        assert drafted[rid]["text"] == plain[rid]["text"] == drafted[rid]["final"].text, rid
        assert drafted[rid]["final"].finish_reason == plain[rid]["final"].finish_reason, rid
    assert "blue, yellow" not in drafted["stop-string"]["text"]
    assert drafted["stop-string"]["final"].finish_reason == "stop"
    assert len(drafted["short"]["tokens"]) == 5
    assert engine.stats().spec_accepted_tokens > 0


def test_preemption_with_drafts_keeps_the_tokens(model_runner, prompts, hf_outputs):
    engine = make_engine(model_runner, num_blocks=24, speculative=NGRAM)
    arrivals = {0: [request(f"r{i}", prompts[i], greedy(NEW_TOKENS)) for i in range(6)]}
    results = run_to_completion(engine, arrivals)  # check_integrity after every step
    assert engine.stats().num_preemptions > 0
    for i in range(6):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i], f"prompt {i}"


# ---- the scheduler and acceptance under random traffic, against a fake model ---------------------


def fake_model(tokens: list[int]) -> int:
    """A deterministic "greedy model": mostly repeats its text with period 3 (drafts often right),
    sometimes breaks the pattern (drafts then wrong)."""
    if len(tokens) % 7 == 0 or len(tokens) < 3:
        return len(tokens) % 5
    return tokens[-3]


def spec_step(sched: Scheduler, kv, outputs: dict) -> None:
    """One engine step as LLMEngine does it: compute every row (K/V of each row's own prefix, drafts
    included), take each row's "argmax" from fake_model, accept, move the counter, retire at
    max_tokens."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    for chunk in out.scheduled:
        s, drafts = chunk.seq, chunk.spec_token_ids
        known = s.token_ids + drafts
        start = s.num_computed_tokens
        assert len(s.block_table) * sched.block_manager.block_size >= start + chunk.num_new_tokens
        for pos in range(start, start + chunk.num_new_tokens):
            kv.slots[kv.slot(s, pos)] = tuple(known[: pos + 1])
        new_tokens = []
        if chunk.samples:
            first_row = s.num_tokens - 1  # the last known token's row, then one per draft
            rows = range(first_row, first_row + 1 + len(drafts))
            new_tokens = accept(drafts, [fake_model(known[: p + 1]) for p in rows])
        s.num_computed_tokens += chunk.num_new_tokens - len(drafts) + max(0, len(new_tokens) - 1)
        sched.block_manager.cache_computed_blocks(s)
        for token in new_tokens:
            s.output_token_ids.append(token)
            outputs.setdefault(s.request_id, []).append(token)
            if s.num_output_tokens >= s.sampling.max_tokens:
                sched.remove(s)
                s.finish("length")
                break


def run_traffic(reqs, num_blocks: int, budget: int, max_seqs: int, policy: str, proposer) -> dict:
    bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_seqs, budget, policy, proposer=proposer)
    kv, outputs = FakeKV(4), {}
    pending = sorted((t, i, plen, m, pr) for i, (plen, m, pr, t) in enumerate(reqs))
    for step in range(5000):
        while pending and pending[0][0] <= step:
            _, i, plen, m, pr = pending.pop(0)
            s = Sequence(
                f"r{i}",
                [(i + j) % 3 for j in range(plen)],
                greedy(m),
                priority=pr,
                arrival_time=float(step),
            )
            if fits(sched, s):
                sched.add(s)
        spec_step(sched, kv, outputs)
        check(sched)
        kv.check(
            sched.running
        )  # every computed position holds its own prefix: no rejected draft counted
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
    return outputs


traffic = st.lists(  # (prompt length, max_tokens, priority, arrival step)
    st.tuples(st.integers(1, 30), st.integers(1, 24), st.integers(0, 2), st.integers(0, 15)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=traffic,
    num_blocks=st.integers(12, 40),
    budget=st.sampled_from([8, 24, 100]),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["continuous", "static"]),
    k=st.integers(1, 5),
    min_n=st.integers(1, 2),
)
def test_random_traffic_with_drafts_gives_the_tokens_without_them(
    reqs, num_blocks, budget, max_seqs, policy, k, min_n
):
    plain = run_traffic(reqs, num_blocks, budget, max_seqs, policy, None)
    drafted = run_traffic(reqs, num_blocks, budget, max_seqs, policy, NgramProposer(k, 3, min_n))
    assert drafted == plain
