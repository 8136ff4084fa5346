"""Sampler: greedy, penalties, filters, seeded reproducibility, distribution sanity."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.dispatched_ops import DispatchedOps
from inferline.worker.engine import sampler
from inferline.worker.engine.device import host_to_device
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.sampler import (
    Sampler,
    _uniforms,
    apply_filters,
    apply_penalties,
    counter_uniforms,
    make_stream,
)

VOCAB = 64
CPU = torch.device("cpu")


def call(logits, params, prompt_ids=None, output_ids=None, streams=None):
    n = logits.shape[0]
    return Sampler()(
        logits,
        params,
        prompt_ids if prompt_ids is not None else [[] for _ in range(n)],
        output_ids if output_ids is not None else [[] for _ in range(n)],
        streams if streams is not None else [None] * n,
    )


# --- greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax_and_leaves_logits_alone(dtype):
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=7)] * 16
    assert call(logits, params) == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_one_definition_of_greedy():
    """A near-zero temperature is greedy for the sampler and for speculative decoding alike."""
    from inferline.worker.engine.spec_decode import can_speculate

    tiny, small = SamplingParams(temperature=1e-6, seed=1), SamplingParams(temperature=0.01, seed=1)
    assert tiny.greedy and can_speculate(tiny) and not small.greedy and not can_speculate(small)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    assert call(logits, [tiny, tiny], streams=[make_stream(1)] * 2) == logits.argmax(-1).tolist()


def test_non_contiguous_logits():
    # e.g. a padded LM head sliced to the tokenizer's vocab
    wide = torch.randn(6, VOCAB + 7, generator=torch.Generator().manual_seed(6))
    logits = wide[:, :VOCAB]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(top_p=0.9, seed=1),
    ] * 3
    gens = lambda: [make_stream(p.seed) for p in params]  # noqa: E731
    tokens = call(logits, params, [[1]] * 6, [[2]] * 6, gens())
    assert tokens == call(logits.contiguous(), params, [[1]] * 6, [[2]] * 6, gens())
    assert all(0 <= t < VOCAB for t in tokens)


def test_greedy_row_consumes_no_randomness():
    stream = make_stream(3)
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)]
    call(torch.randn(1, VOCAB), params, streams=[stream])
    assert stream.num_draws == 0


def test_make_stream_unseeded_is_none():
    assert make_stream(None) is None
    a, b = make_stream(11), make_stream(11)
    assert [_uniforms([a], CPU).item() for _ in range(4)] == [
        _uniforms([b], CPU).item() for _ in range(4)
    ]
    assert a.num_draws == 4


# --- penalties ----------------------------------------------------------------------------------


def reference_penalties(row, params, prompt, output):
    """Slow per-token version of the documented penalty rules."""
    row = [float(x) for x in row]
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            rp = params.repetition_penalty
            row[token] = row[token] / rp if row[token] > 0 else row[token] * rp
    for token in set(output):
        count = output.count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def random_penalty_case(rng: random.Random, n: int):
    params, prompts, outputs = [], [], []
    for _ in range(n):
        params.append(
            SamplingParams(
                temperature=0.0,
                repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
                presence_penalty=rng.choice([0.0, -1.5, 0.5, 2.0]),
                frequency_penalty=rng.choice([0.0, -0.5, 0.3, 2.0]),
            )
        )
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))])
        outputs.append([rng.randrange(VOCAB // 4) for _ in range(rng.randrange(0, 30))])
    return params, prompts, outputs


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_slow_reference(seed):
    rng = random.Random(seed)
    params, prompts, outputs = random_penalty_case(rng, 12)
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got = apply_penalties(logits, params, prompts, outputs)
    want = torch.tensor(
        [reference_penalties(logits[i], params[i], prompts[i], outputs[i]) for i in range(12)]
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_greedy_with_penalties_in_a_mixed_batch():
    rng = random.Random(1)
    params, prompts, outputs = random_penalty_case(rng, 10)
    params += [SamplingParams(temperature=1.0, seed=i) for i in range(6)]  # sampled rows alongside
    prompts += [[1, 2]] * 6
    outputs += [[3]] * 6
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    gens = [None] * 10 + [make_stream(i) for i in range(6)]
    before = logits.clone()
    got = call(logits, params, prompts, outputs, gens)[:10]
    assert torch.equal(logits, before)  # the caller's logits are untouched
    want = [
        torch.tensor(reference_penalties(logits[i], params[i], prompts[i], outputs[i]))
        .argmax()
        .item()
        for i in range(10)
    ]
    assert got == want


def test_repetition_penalty_covers_prompt_but_presence_does_not():
    logits = torch.zeros(1, 4)
    logits[0, 1] = 2.0
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)]
    out = apply_penalties(logits, params, [[1]], [[2]])
    assert out.tolist() == [[0.0, 1.0, -1.0, 0.0]]


# --- filters ------------------------------------------------------------------------------------


def reference_allowed(row: list[float], params: SamplingParams, margin: float = 1e-4):
    """(must, may): tokens the documented top-k -> top-p -> min-p rules keep for sure, and those
    they keep allowing float slack at the top-p / min-p boundaries."""
    x = [v / params.temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if 0 < params.top_k < len(x):
        order = order[: params.top_k]
    z = sum(math.exp(x[i] - x[order[0]]) for i in order)
    probs = {i: math.exp(x[i] - x[order[0]]) / z for i in order}
    must, may, mass = set(), set(), 0.0
    for i in order:
        if mass < params.top_p - margin or i == order[0]:
            must.add(i)
        if mass < params.top_p + margin:
            may.add(i)
        mass += probs[i]
    if params.min_p > 0:
        top = probs[order[0]]
        must = {i for i in must if probs[i] >= params.min_p * top * (1 + margin)}
        may = {i for i in may if probs[i] >= params.min_p * top * (1 - margin)}
    return must, may


def filter_cases():
    return [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.5, top_k=10, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0),
    ]


def test_filters_keep_exactly_the_reference_set():
    params = filter_cases() * 4
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    temps = torch.tensor([[p.temperature] for p in params])
    kept = torch.isfinite(apply_filters(logits / temps, params))
    for i, p in enumerate(params):
        must, may = reference_allowed(logits[i].tolist(), p)
        got = set(kept[i].nonzero().flatten().tolist())
        assert must <= got <= may, (i, p)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat: the nucleus outgrows the candidates
def test_filters_on_a_large_vocab_match_the_reference(scale):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.3, min_p=0.5),
        SamplingParams(temperature=1.0, top_k=3000, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=7),
    ]
    logits = torch.randn(len(params), 5000, generator=torch.Generator().manual_seed(4)) * scale
    kept = torch.isfinite(apply_filters(logits.clone(), params))
    for i, p in enumerate(params):
        must, may = reference_allowed(logits[i].tolist(), p)
        assert must <= set(kept[i].nonzero().flatten().tolist()) <= may, (scale, p)


def test_kept_set_with_ties_does_not_depend_on_the_batch():
    # bf16 logits tie a lot; the kept set must not depend on how a topk orders tied values,
    # which changes with the batch's largest top_k.
    row = (torch.randn(1, 2000, generator=torch.Generator().manual_seed(5)) * 2).bfloat16().float()
    params = SamplingParams(temperature=1.0, top_p=0.6, top_k=40)
    alone = torch.isfinite(apply_filters(row.clone(), [params]))
    other = SamplingParams(temperature=1.0, top_k=1500)
    batch = torch.cat([torch.randn(1, 2000), row])
    together = torch.isfinite(apply_filters(batch, [other, params]))[1:]
    assert torch.equal(alone, together)
    values = row[alone]
    assert not ((row >= values.min()) & ~alone).any()  # ties at the boundary are all kept


def test_sampling_never_leaves_the_allowed_set():
    torch.manual_seed(0)
    params = filter_cases()[:-1] * 300
    base = (
        torch.randn(len(filter_cases()) - 1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    )
    logits = base.repeat(300, 1)
    gens = [make_stream(i) if i % 2 else None for i in range(len(params))]
    tokens = call(logits, params, streams=gens)
    seen: dict[int, set[int]] = {}
    for i, token in enumerate(tokens):
        _, may = reference_allowed(logits[i].tolist(), params[i])
        assert token in may, (i, params[i], token)
        seen.setdefault(i % base.shape[0], set()).add(token)
    # and it does sample: a case that keeps several tokens shows more than one
    assert len(seen[0]) > 1


# --- reproducibility ----------------------------------------------------------------------------


def run_steps(position: int, others: int, seed: int, steps: int, dtype=torch.float32):
    """Tokens of one seeded request at batch row `position` among `others` random requests,
    over several steps (its stream carries over, as in the engine)."""
    target_logits = torch.randn(steps, VOCAB, generator=torch.Generator().manual_seed(100)).to(
        dtype
    )
    target = SamplingParams(
        temperature=0.9, top_k=30, top_p=0.95, min_p=0.01, presence_penalty=0.3, seed=seed
    )
    stream = make_stream(seed)
    noise_rng = random.Random(position * 1000 + others)
    history: list[int] = []
    for step in range(steps):
        others_params = [
            SamplingParams(
                temperature=noise_rng.choice([0.0, 0.5, 1.0]),
                top_p=noise_rng.choice([1.0, 0.9]),
                seed=noise_rng.choice([None, noise_rng.randrange(99)]),
            )
            for _ in range(others)
        ]
        params = others_params[:position] + [target] + others_params[position:]
        logits = torch.randn(others + 1, VOCAB).to(dtype)
        logits[position] = target_logits[step]
        gens = [make_stream(p.seed) for p in params]
        gens[position] = stream
        outputs = [[noise_rng.randrange(VOCAB)] for _ in params]
        outputs[position] = history
        history = history + [
            call(logits, params, [[1, 2, 3]] * len(params), outputs, gens)[position]
        ]
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_request_is_reproducible_inside_any_batch(dtype):
    alone = run_steps(0, 0, seed=42, steps=20, dtype=dtype)
    assert run_steps(0, 0, seed=42, steps=20, dtype=dtype) == alone
    assert run_steps(3, 7, seed=42, steps=20, dtype=dtype) == alone
    assert run_steps(0, 31, seed=42, steps=20, dtype=dtype) == alone
    assert run_steps(9, 9, seed=43, steps=20, dtype=dtype) != alone  # the seed matters


# --- the counter stream -------------------------------------------------------------------------


def test_a_seeded_rows_uniforms_do_not_depend_on_the_batch():
    alone = make_stream(42)
    want = [_uniforms([alone], CPU).item() for _ in range(5)]
    crowds = [
        [None] * 3,
        [make_stream(7), None, make_stream(42)],
        [make_stream(s) for s in range(40)],
    ]
    for position, others in enumerate(crowds):
        stream = make_stream(42)
        got = [
            _uniforms(others[:position] + [stream] + others[position:], CPU)[position].item()
            for _ in range(5)
        ]
        assert got == want, position


def test_the_stream_is_splitmix64_on_a_mixed_seed():
    """The int64 tensor ops equal exact uint64 arithmetic, over the whole seed range."""

    def mix(z):
        z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ z >> 27) * 0x94D049BB133111EB % 2**64
        return z ^ z >> 31

    pairs = [
        (0, 0),
        (1, 0),
        (42, 7),
        (2**64 - 1, 3),
        (-(2**63), 0),
        (2**63, 5),
        (12345678901234, 10**9),
    ]
    want = [
        (mix((mix(seed % 2**64) + (i + 1) * 0x9E3779B97F4A7C15) % 2**64) >> 11) / 2**53
        for seed, i in pairs
    ]
    seeds = torch.tensor([(seed + 2**63) % 2**64 - 2**63 for seed, _ in pairs])
    assert counter_uniforms(seeds, torch.tensor([i for _, i in pairs])).tolist() == want
    assert (
        _uniforms([make_stream(-1)], CPU).item() == _uniforms([make_stream(2**64 - 1)], CPU).item()
    )


# Critical values at p = 0.001 (fixed seeds: each test is one deterministic draw, it cannot flake).
_KS_999 = 1.95  # Kolmogorov-Smirnov, times sqrt(n)
_CHI2_999_99 = 148.23  # chi-square, 99 degrees of freedom


def assert_uniform(u: torch.Tensor):
    n = u.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    u = u.sort().values
    ks = torch.maximum(ranks / n - u, u - (ranks - 1) / n).max().item()
    assert ks * math.sqrt(n) < _KS_999, ks
    counts = torch.bincount((u * 100).long(), minlength=100).tolist()
    assert chi_square(counts, [0.01] * 100) < _CHI2_999_99
    assert 0.0 <= u.min() and u.max() < 1.0


def test_the_stream_is_uniform_and_differs_by_seed_and_index():
    n = 100_000
    one_seed = counter_uniforms(torch.full((n,), 7), torch.arange(n))
    first_draws = counter_uniforms(
        torch.arange(n), torch.zeros(n, dtype=torch.int64)
    )  # n samples' seeds
    assert_uniform(one_seed)
    assert_uniform(first_draws)
    assert one_seed.unique().numel() == n and first_draws.unique().numel() == n
    neighbour = counter_uniforms(torch.full((n,), 8), torch.arange(n))
    shifted = counter_uniforms(torch.full((n,), 7), torch.arange(1, n + 1))
    for other in (neighbour, shifted):
        assert not (other == one_seed).any()
        assert abs(torch.corrcoef(torch.stack([one_seed, other]))[0, 1].item()) < 4 / math.sqrt(n)
    # Plain splitmix64 would give seed + gamma seed's stream one draw on; the mixed seed does not.
    gamma_on = counter_uniforms(torch.full((n,), 7 + sampler._GAMMA - 2**64), torch.arange(n))
    assert not (gamma_on == shifted).any()


@pytest.mark.parametrize("unseeded", [0, 3])
def test_uniforms_cost_the_same_ops_for_any_number_of_seeded_rows(unseeded, monkeypatch):
    copies = []
    monkeypatch.setattr(
        sampler, "host_to_device", lambda *a: copies.append(a) or host_to_device(*a)
    )

    def ops(num_seeded):
        copies.clear()
        with DispatchedOps() as mode:
            _uniforms([make_stream(s) for s in range(num_seeded)] + [None] * unseeded, CPU)
        assert len(copies) == 1  # every row's seed and draw index in one host-to-device copy
        return mode.names

    few, many = ops(2), ops(64)
    assert few == many and sum("rand" in name for name in many) == (1 if unseeded else 0)


# --- distribution -------------------------------------------------------------------------------

# chi-square critical values at p = 0.001, by degrees of freedom
_CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(1)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    tokens = call(row.repeat(30000, 1), [SamplingParams(temperature=temperature)] * 30000)
    probs = torch.softmax(row / temperature, -1).tolist()
    counts = [tokens.count(t) for t in range(6)]
    assert chi_square(counts, probs) < _CHI2_999[5], counts


def test_draw_across_blocks_follows_softmax():
    # Mass spread over several 256-token blocks and their edges: the two-level draw must pick the
    # block and then the token in proportion.
    torch.manual_seed(2)
    positions = [0, 255, 256, 300, 511, 700, 1000, 1023]
    row = torch.full((1024,), -40.0)
    row[positions] = torch.tensor([0.0, 1.0, -0.5, 0.5, 2.0, -1.0, 1.5, 0.2])
    tokens = call(row.repeat(20000, 1), [SamplingParams(temperature=1.0)] * 20000)
    assert set(tokens) <= set(positions)
    probs = torch.softmax(row[positions], -1).tolist()
    assert chi_square([tokens.count(t) for t in positions], probs) < _CHI2_999[7]


def test_seeded_stream_follows_softmax_and_top_k_renormalises():
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    params = [SamplingParams(temperature=1.3, top_k=4, seed=5)]
    stream = make_stream(5)
    tokens = [call(row, params, streams=[stream])[0] for _ in range(4000)]
    kept = [5, 0, 1, 2]  # the four largest logits
    assert set(tokens) <= set(kept)
    probs = torch.softmax(row[0, kept] / 1.3, -1).tolist()
    assert chi_square([tokens.count(t) for t in kept], probs) < _CHI2_999[3]


# --- device -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_and_seeded():
    logits = torch.randn(8, 1000, device="cuda", dtype=torch.bfloat16)
    assert call(logits, [SamplingParams(temperature=0.0)] * 8) == logits.argmax(-1).tolist()
    params = [
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.2, seed=3
        )
    ] * 8
    gens = lambda: [make_stream(3) for _ in range(8)]  # noqa: E731
    runs = [call(logits, params, [[1, 2]] * 8, [[3]] * 8, gens()) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 1  # same logits, same seed: same token in every row
    # Integer arithmetic: the stream is the CPU's, bit for bit.
    seeds, indexes = torch.arange(-500, 500) * 7919, torch.arange(1000) % 37
    assert torch.equal(
        counter_uniforms(seeds.cuda(), indexes.cuda()).cpu(), counter_uniforms(seeds, indexes)
    )


# --- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens_in_the_rows_that_have_it():
    """OpenAI's logit_bias (issue 50, item 5): added to the logits before sampling, greedy too;
    +100 forces a token, -100 bans the one greedy would pick; rows without it are untouched."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    argmax = logits.argmax(-1).tolist()
    forced = (argmax[0] + 1) % VOCAB
    params = [
        SamplingParams(temperature=0.0, logit_bias=((forced, 100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((argmax[1], -100.0),)),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=5, logit_bias=((forced, 100.0),)),
    ]
    second = logits[1].topk(2).indices[1].item()
    assert call(logits, params) == [forced, second, argmax[2], forced]
    assert torch.equal(logits, before)


def test_logit_bias_shifts_the_sampled_distribution_and_the_logprobs():
    logits = torch.zeros(1, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=1, logit_bias=((7, math.log(3)),))]
    out = Sampler().sample(logits, params, [[]], [[]], [make_stream(1)])
    top = out.logprobs[0]["top_logprobs"][0]
    assert top["token_id"] == 7 and top["logprob"] == pytest.approx(math.log(3 / (VOCAB + 2)))


def test_a_batch_without_logit_bias_takes_the_greedy_fast_path(monkeypatch):
    monkeypatch.setattr(sampler, "_biased", lambda *a: pytest.fail("biased a plain batch"))
    logits = torch.randn(3, VOCAB)
    assert call(logits, [SamplingParams(temperature=0.0)] * 3) == logits.argmax(-1).tolist()
