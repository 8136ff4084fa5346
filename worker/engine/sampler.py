"""Batched sampling: one call turns a step's logits into each row's next token.
design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from inferline.worker.engine.device import host_to_device, tensor_to_device
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.structured_output import apply_token_bitmask

# Top-p looks at this many candidates first; a row whose nucleus is wider retries with 16x more.
_TOP_P_CANDIDATES = 256
# The draw picks a block of this many tokens, then a token inside it.
_DRAW_BLOCK = 256


@dataclass(eq=False)
class SeededStream:
    """A seeded request's random numbers: draw i is counter_uniforms(seed, i), one a sampled row."""

    seed: int
    num_draws: int = 0

    def take(self) -> int:
        self.num_draws += 1
        return self.num_draws - 1


def make_stream(seed: int | None) -> SeededStream | None:
    return None if seed is None else SeededStream(seed)


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or the wire's TokenLogprob shape for rows that ask for logprobs.
    logprobs: list[dict | None]


class Sampler:
    """Picks the next token of every sequence in a batch. Stateless; never modifies `logits`."""

    def __call__(
        self,
        logits,
        params,
        prompt_ids,
        output_ids,
        streams,
        bitmask=None,
        grammar_rows: list[int] = (),
    ) -> list[int]:
        return self.sample(
            logits, params, prompt_ids, output_ids, streams, bitmask, grammar_rows
        ).token_ids

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        streams: list[SeededStream | None],
        bitmask: torch.Tensor | None = None,
        grammar_rows: list[int] = (),
    ) -> SamplerOutput:
        """logits [num_seqs, vocab], rows aligned with params, prompt_ids, output_ids and streams;
        `bitmask` [len(grammar_rows), words] int32: the tokens allowed in those rows."""
        next_ids, logprobs = self.sample_on_device(
            logits, params, prompt_ids, output_ids, streams, bitmask, grammar_rows
        )
        return SamplerOutput(next_ids.tolist(), logprobs)

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        streams: list[SeededStream | None],
        bitmask: torch.Tensor | None = None,
        grammar_rows: list[int] = (),
    ) -> tuple[torch.Tensor, list[dict | None]]:
        """sample()'s tokens left on the logits' device (int64 [num_seqs]), and the logprobs; no
        device sync without logprobs (an overlapped step reads the tokens later)."""
        num_seqs = logits.shape[0]
        assert logits.dim() == 2, logits.shape
        assert len(params) == len(prompt_ids) == len(output_ids) == len(streams) == num_seqs
        wants_logprobs = any(p.logprobs is not None for p in params)
        if (
            not grammar_rows
            and not wants_logprobs
            and all(p.greedy and not has_penalties(p) and not p.logit_bias for p in params)
        ):
            return logits.argmax(dim=-1), [None] * num_seqs
        # Rows are viewed flat and in blocks below; a padded-vocab slice would not view.
        work = _biased(logits.contiguous(), params)
        work = _penalized(work, params, prompt_ids, output_ids)
        if grammar_rows:
            work = _masked(work, logits, list(grammar_rows), bitmask)
        next_ids = self._pick(work, params, streams)
        logprobs = _logprobs(work, next_ids, params) if wants_logprobs else [None] * num_seqs
        return next_ids, logprobs

    def _pick(
        self, work: torch.Tensor, params: list[SamplingParams], streams: list
    ) -> torch.Tensor:
        num_seqs = work.shape[0]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        next_ids = torch.empty(num_seqs, dtype=torch.int64, device=work.device)
        if greedy:
            _put_rows(next_ids, greedy, _rows(work, greedy).argmax(dim=-1))
        if sampled:
            rows = [params[i] for i in sampled]
            draws = _sample(_rows(work, sampled), rows, [streams[i] for i in sampled])
            _put_rows(next_ids, sampled, draws)
        return next_ids


def _masked(
    work: torch.Tensor, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    if work.data_ptr() == logits.data_ptr():
        work = work.clone()
    return _put_rows(work, rows, apply_token_bitmask(_rows(work, rows), bitmask))


def _logprobs(
    work: torch.Tensor, next_ids: torch.Tensor, params: list[SamplingParams]
) -> list[dict | None]:
    """The sampled token's logprob and its row's top-k, for rows that ask (-inf tokens left out)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = host_to_device(rows, torch.int64, work.device)
    logprobs = torch.log_softmax(_rows(work, rows), dim=-1)
    chosen = logprobs.gather(1, next_ids.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
    k = max(params[i].logprobs for i in rows)
    top = logprobs.topk(k, dim=-1) if k else None
    values, ids = (
        (top.values.tolist(), top.indices.tolist()) if k else ([[]] * len(rows), [[]] * len(rows))
    )
    out: list[dict | None] = [None] * len(params)
    for j, i in enumerate(rows):
        k_i = params[i].logprobs
        out[i] = {
            "logprob": chosen[j],
            "top_logprobs": [
                {"token_id": t, "logprob": v}
                for t, v in zip(ids[j][:k_i], values[j][:k_i])
                if v != -math.inf
            ],
        }
    return out


def _biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """An fp32 copy with each row's logit_bias added (as vLLM, before penalties); `logits`
    itself when no row has one."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    vocab = logits.shape[1]
    flat = [i * vocab + t for i in rows for t, _ in params[i].logit_bias]
    bias = [b for i in rows for _, b in params[i].logit_bias]
    work = logits.to(torch.float32, copy=True)
    index = host_to_device(flat, torch.int64, logits.device)
    # Keys of one row are distinct token ids, so indices are unique: deterministic.
    work.view(-1).index_add_(0, index, host_to_device(bias, torch.float32, logits.device))
    return work


def _penalized(logits, params, prompt_ids, output_ids) -> torch.Tensor:
    """fp32 logits with penalties applied; a copy whenever anything changed."""
    rows = [i for i, p in enumerate(params) if has_penalties(p)]
    if len(rows) == len(params):
        return apply_penalties(logits, params, prompt_ids, output_ids)
    work = logits.float()
    if rows:
        work = work.clone() if work is logits else work
        pick = lambda seqs: [seqs[i] for i in rows]  # noqa: E731
        fixed = apply_penalties(_rows(work, rows), pick(params), pick(prompt_ids), pick(output_ids))
        work = _put_rows(work, rows, fixed)
    return work


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """Penalized fp32 copy of rows [n, vocab]. Repetition (HF) divides positive and multiplies
    negative logits of seen tokens; presence / frequency (OpenAI) subtract, over the output only."""
    vocab = logits.shape[1]
    out = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    flat = out.view(-1)
    repeat = [p.repetition_penalty != 1.0 for p in params]
    if any(repeat):
        seen = torch.unique(
            _flat_index(
                [
                    ids + out_ids if r else []
                    for ids, out_ids, r in zip(prompt_ids, output_ids, repeat)
                ],
                vocab,
                out.device,
            )
        )
        penalties = _column(params, "repetition_penalty", out.device).flatten()
        penalty = penalties.index_select(0, seen // vocab)
        values = flat.index_select(0, seen)  # index_select: advanced indexing is far slower on CPU
        flat.index_copy_(0, seen, torch.where(values > 0, values / penalty, values * penalty))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counted, counts = torch.unique(
            _flat_index(output_ids, vocab, out.device), return_counts=True
        )
        row = counted // vocab
        frequency = _column(params, "frequency_penalty", out.device).flatten().index_select(0, row)
        presence = _column(params, "presence_penalty", out.device).flatten().index_select(0, row)
        flat.index_add_(
            0, counted, -(frequency * counts + presence)
        )  # indices unique: deterministic
    return out


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks to -inf in place what top-k, top-p and min-p remove (filter_thresholds, readable)."""
    threshold = filter_thresholds(logits, params)
    if threshold is None:
        return logits
    return logits.masked_fill_(logits < threshold, float("-inf"))


def filter_thresholds(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """[n, 1] thresholds (keep logits >= t) for top-k, top-p and min-p; None when no row filters.
    Each filter keeps {logit >= t} and the top token, so together they are the largest t."""
    num_rows, vocab = logits.shape
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    truncated = [i for i, p in enumerate(params) if top_k[i] or p.top_p < 1.0]
    needs_min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not truncated and not needs_min_p:
        return None
    threshold = logits.new_full((num_rows, 1), float("-inf"))
    if truncated:
        by_rank = _top_k_top_p_threshold(
            _rows(logits, truncated),
            [top_k[i] for i in truncated],
            [params[i].top_p for i in truncated],
        )
        threshold = _put_rows(threshold, truncated, by_rank)
    if needs_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p), whatever filter came before.
        min_p = _column([params[i] for i in needs_min_p], "min_p", logits.device)
        by_ratio = _rows(logits, needs_min_p).amax(dim=-1, keepdim=True) + min_p.log()
        combined = torch.maximum(_rows(threshold, needs_min_p), by_ratio)
        threshold = _put_rows(threshold, needs_min_p, combined)
    return threshold


def _sample(logits: torch.Tensor, params: list[SamplingParams], streams: list) -> torch.Tensor:
    scaled = logits / _column(params, "temperature", logits.device)
    return _draw(scaled, filter_thresholds(scaled, params), streams)


def _draw(logits: torch.Tensor, threshold: torch.Tensor | None, streams: list) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row, in two levels (block sums, then inside the
    block): a full-vocab cumsum is slow on CPU."""
    num_rows, vocab = logits.shape
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    if threshold is not None:
        weights.mul_(logits >= threshold)
    if vocab % _DRAW_BLOCK:
        weights = F.pad(weights, (0, -vocab % _DRAW_BLOCK))
    blocks = weights.view(num_rows, -1, _DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    uniform = _uniforms(streams, logits.device)
    block, inner = _search(block_cdf, uniform)
    chosen = blocks.gather(1, block.view(-1, 1, 1).expand(-1, 1, _DRAW_BLOCK)).squeeze(1)
    token, _ = _search(chosen.cumsum(dim=-1, dtype=torch.float64), inner)
    return block * _DRAW_BLOCK + token


def _search(cdf: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First index whose CDF exceeds uniform * total, and the target's place in that step as a
    fresh uniform."""
    total = cdf[:, -1:]
    target = uniform * total
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    upper = cdf.gather(1, index)
    lower = torch.where(
        index > 0, cdf.gather(1, (index - 1).clamp_(min=0)), torch.zeros_like(upper)
    )
    inner = ((target - lower) / (upper - lower)).clamp_(0.0, 1.0 - 2**-40)
    return index.squeeze(1), inner


def _uniforms(streams: list, device: torch.device) -> torch.Tensor:
    """[n, 1] fp64 uniforms: seeded rows from their stream, others from the global RNG."""
    num_rows = len(streams)
    if all(s is None for s in streams):
        return torch.rand(num_rows, 1, dtype=torch.float64, device=device)
    # Draw index -1 marks an unseeded row; its hash is computed and thrown away.
    keys = host_to_device(
        [(_int64(s.seed), s.take()) if s else (0, -1) for s in streams], torch.int64, device
    )
    uniform = counter_uniforms(keys[:, 0], keys[:, 1]).unsqueeze(1)
    if any(s is None for s in streams):
        unseeded = torch.rand(num_rows, 1, dtype=torch.float64, device=device)
        uniform = torch.where(keys[:, 1:] < 0, unseeded, uniform)
    return uniform


# splitmix64 (Steele, Lea, Flood 2014) with Stafford's "Mix13" finalizer, in int64 tensor ops:
# add and multiply wrap as uint64 would; >> is arithmetic, so logical shifts mask the sign bits.
_GAMMA = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def counter_uniforms(seeds: torch.Tensor, indexes: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms: draw `index` of the splitmix64 stream at mix(seed), in exact integer
    arithmetic (the same on every device). Mixed first: in plain splitmix64, seed + gamma's
    stream is seed's one draw on."""
    state = _mix64(seeds) + (indexes + 1) * _int64(_GAMMA)
    return _shift_right(_mix64(state), 11).double() * 2.0**-53


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _int64(_MIX[0])
    z = (z ^ _shift_right(z, 27)) * _int64(_MIX[1])
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _int64(value: int) -> int:
    """`value` mod 2**64 as a signed int64 (the seed range is [-2**63, 2**64))."""
    return (value + 2**63) % 2**64 - 2**63


def _top_k_top_p_threshold(
    logits: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    num_candidates: int = _TOP_P_CANDIDATES,
) -> torch.Tensor:
    """[n, 1] thresholds: the top_k largest, then the smallest prefix whose renormalised mass
    reaches top_p, from a few hundred candidates (a full sort is slow on CPU)."""
    vocab = logits.shape[1]
    device = logits.device
    num_candidates = min(vocab, max(max(top_k), num_candidates))
    values = logits.topk(num_candidates, dim=-1).values  # sorted descending
    ranks = torch.arange(num_candidates, device=device).unsqueeze(0)
    k = host_to_device([k or vocab for k in top_k], torch.int64, device).unsqueeze(1)
    values = values.masked_fill(ranks >= k, float("-inf"))
    probs = (values - values[:, :1]).exp()
    probs = probs / _top_p_normaliser(logits, values, probs, top_k)
    mass_before = probs.cumsum(dim=-1) - probs
    p = host_to_device([tp if tp < 1.0 else 2.0 for tp in top_p], torch.float32, device).unsqueeze(
        1
    )
    num_kept = ((mass_before < p) & (ranks < k)).sum(dim=-1, keepdim=True)  # a prefix, >= 1
    threshold = values.gather(1, num_kept - 1)
    unresolved = (
        ((num_kept == num_candidates) & (k == vocab)).squeeze(1).nonzero().flatten().tolist()
    )
    if unresolved and num_candidates < vocab:
        wider = _top_k_top_p_threshold(
            _rows(logits, unresolved),
            [0] * len(unresolved),
            [top_p[i] for i in unresolved],
            num_candidates * 16,
        )
        threshold = _put_rows(threshold, unresolved, wider)
    return threshold


def _top_p_normaliser(logits, values, probs, top_k: list[int]) -> torch.Tensor:
    # With top-k the mass is over the k candidates; without, over the whole row.
    normaliser = probs.sum(dim=-1, keepdim=True)
    no_top_k = [i for i, k in enumerate(top_k) if not k]
    if no_top_k:
        rows = _rows(logits, no_top_k)
        full = (rows - _rows(values, no_top_k)[:, :1]).exp_().sum(dim=-1, keepdim=True)
        normaliser = _put_rows(normaliser, no_top_k, full)
    return normaliser


def _flat_index(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    tokens = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    return tensor_to_device(rows * vocab + tokens, device)


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # Selecting copies; skip it when every row is wanted (the common all-sampled batch).
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor.index_select(0, host_to_device(rows, torch.int64, tensor.device))


def _put_rows(tensor: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    if len(rows) == tensor.shape[0]:
        if values is not tensor:
            tensor.copy_(values)
        return tensor
    return tensor.index_copy_(0, host_to_device(rows, torch.int64, tensor.device), values)


def _column(params: list[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    values = [float(getattr(p, name)) for p in params]
    return host_to_device(values, torch.float32, device).unsqueeze(1)
