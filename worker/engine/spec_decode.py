"""Speculative decoding with n-gram drafts (prompt lookup): guesses to verify, never to trust.

A decode step reads every weight of the model to compute one token per sequence; for a few
sequences that step is bound by memory, and verifying several tokens of one sequence costs
about what computing one does. So before a step, a greedy sequence's last few tokens are
looked up earlier in its own text (prompt and output): if they occurred before, the tokens that
followed them then are proposed as its next tokens ("drafts"). The step computes the sequence's
last token and the drafts as one chunk, one row each; row i's argmax is the token greedy
decoding would pick after draft i-1. The drafts are accepted while they equal those argmaxes,
and the first row that disagrees gives its own argmax instead, so every step still yields at
least one token, and the tokens are exactly greedy decoding's: a draft only decides how many of
them one step computes. (Exact to the bit where the rows of a chunk are computed as decode rows
are: the CPU path, kernels/cpu/, and oneDNN's row-invariant linear layers.)

Code, quoted passages, lists and the loops of a small model's greedy text repeat themselves; free
prose does not, and then a draft costs its rows' compute for nothing. Only greedy sequences
without penalties are drafted for (a sampled token cannot be checked against one argmax).

vLLM's `ngram` method (prompt lookup decoding, Saxena 2023) is the same idea.
"""
from __future__ import annotations

from array import array

from worker.engine.request import SamplingParams
from worker.engine.sampler import has_penalties, is_greedy

_ITEM = array("i").itemsize  # token ids are searched as packed int32 bytes


def can_speculate(params: SamplingParams) -> bool:
    """Drafts are checked against argmaxes: greedy rows whose logits nothing else changes."""
    return is_greedy(params) and not has_penalties(params)


class NgramProposer:
    """Proposes up to `num_tokens` drafts: the tokens that followed the most recent earlier
    occurrence of the sequence's last n tokens, for the longest n in [min_n, max_n] found."""

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1):
        assert num_tokens >= 1 and 1 <= min_n <= max_n
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Drafts to follow `token_ids` (at most `limit`, default num_tokens; [] when no match)."""
        limit = self.num_tokens if limit is None else min(limit, self.num_tokens)
        if limit <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = array("i", token_ids)
        packed = tokens.tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = find_last(packed, tokens[-n:].tobytes(), end=len(tokens) - 1)
            if start >= 0:
                follow = start + n  # <= len - 1: the match ends before the last token
                return tokens[follow:follow + limit].tolist()
        return []


def find_last(packed: bytes, needle: bytes, end: int) -> int:
    """The last token index i with tokens[i:i + n] == needle and i + n <= end, or -1.
    bytes.rfind does the scanning in C; a hit must start on a token's first byte."""
    stop = end * _ITEM
    while True:
        at = packed.rfind(needle, 0, stop)
        if at < 0 or at % _ITEM == 0:
            return at // _ITEM if at >= 0 else -1
        stop = at + len(needle) - 1  # a misaligned hit: look again, ending before it


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens one step yields: the drafts up to the first that differs from the target
    (row i's argmax), then that row's target. len(targets) == len(drafts) + 1."""
    assert len(targets) == len(drafts) + 1
    for i, draft in enumerate(drafts):
        if draft != targets[i]:
            return targets[:i + 1]
    return list(targets)
