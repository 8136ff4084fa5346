"""Speculative decoding with n-gram drafts (prompt lookup, vLLM's `ngram`): output is exactly
greedy decoding's. design: docs/operations.md#speculative-decoding
"""

from __future__ import annotations

from array import array

from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.sampler import has_penalties

_ITEM = array("i").itemsize  # token ids are searched as packed int32 bytes


def can_speculate(params: SamplingParams) -> bool:
    """Drafts are checked against argmaxes: greedy rows with no penalties, logit_bias, grammar or
    logprobs."""
    return (
        params.greedy
        and not has_penalties(params)
        and not params.logit_bias
        and params.structured is None
        and params.logprobs is None
    )


class NgramProposer:
    """Proposes up to `num_tokens` drafts: what followed the most recent earlier occurrence of
    the last n tokens, for the longest n in [min_n, max_n] found."""

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1):
        assert num_tokens >= 1 and 1 <= min_n <= max_n
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Drafts to follow `token_ids` (at most `limit`; [] when no match)."""
        limit = self.num_tokens if limit is None else min(limit, self.num_tokens)
        if limit <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = array("i", token_ids)
        packed = tokens.tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = find_last(packed, tokens[-n:].tobytes(), end=len(tokens) - 1)
            if start >= 0:
                follow = start + n  # the match ends before the last token
                return tokens[follow : follow + limit].tolist()
        return []


def find_last(packed: bytes, needle: bytes, end: int) -> int:
    """The last token index i with tokens[i:i + n] == needle and i + n <= end, or -1; a hit must
    start on a token's first byte."""
    stop = end * _ITEM
    while True:
        at = packed.rfind(needle, 0, stop)
        if at < 0 or at % _ITEM == 0:
            return at // _ITEM if at >= 0 else -1
        stop = at + len(needle) - 1  # misaligned: look again before it


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens one step yields: drafts up to the first that differs from its row's target,
    then that target."""
    assert len(targets) == len(drafts) + 1
    for i, draft in enumerate(drafts):
        if draft != targets[i]:
            return targets[: i + 1]
    return list(targets)
