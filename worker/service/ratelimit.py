"""Per-tenant token buckets: requests per second, and tokens per minute charged `max_tokens` up
front (else a burst of long requests gets through) and refunded at `done`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inferline.config.settings import LimitsSettings, TenantLimit

MAX_TENANTS = 10_000


@dataclass
class TokenBucket:
    rate: float  # units per second
    capacity: float
    level: float
    stamp: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> "TokenBucket":
        return cls(rate, capacity, capacity, now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def can_take(self, amount: float, now: float) -> bool:
        self.refill(now)
        # A cost above the capacity could never be paid: a full bucket pays for it.
        return self.level >= min(amount, self.capacity)

    def take(self, amount: float) -> None:
        self.level -= amount  # may go below zero when capped: debt repaid by time

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class _Tenant:
    def __init__(self, limit: TenantLimit, now: float) -> None:
        self.requests = self.tokens = None
        if limit.requests_per_s:
            burst = limit.burst_requests or max(1.0, limit.requests_per_s)
            self.requests = TokenBucket.full(limit.requests_per_s, burst, now)
        if limit.tokens_per_min:
            self.tokens = TokenBucket.full(limit.tokens_per_min / 60.0, limit.tokens_per_min, now)


class RateLimiter:
    """`admit` decides and charges; `refund` returns the tokens a request did not generate."""

    def __init__(self, limits: LimitsSettings, clock=time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            if len(self._tenants) >= MAX_TENANTS:
                self._prune()
            limit = self._limits.tenants.get(name, self._limits.default_tenant)
            t = self._tenants[name] = _Tenant(limit, self._clock())
        return t

    def _prune(self) -> None:
        # Tenant names come from producers: forget idle (full) buckets so made-up names cannot
        # grow memory; a new tenant gets a full bucket anyway.
        now = self._clock()
        for name, t in list(self._tenants.items()):
            if all(
                b is None or (b.refill(now) or b.level >= b.capacity)
                for b in (t.requests, t.tokens)
            ):
                del self._tenants[name]

    def admit(self, tenant: str, max_tokens: int) -> bool:
        """True (and charged) when the tenant may run one more request of `max_tokens`."""
        t, now = self._tenant(tenant), self._clock()
        if t.requests and not t.requests.can_take(1, now):
            return False
        if t.tokens and not t.tokens.can_take(max_tokens, now):
            return False
        if t.requests:
            t.requests.take(1)
        if t.tokens:
            t.tokens.take(max_tokens)
        return True

    def refund(self, tenant: str, unused_tokens: int) -> None:
        t = self._tenants.get(tenant)
        if t and t.tokens and unused_tokens > 0:
            t.tokens.give(unused_tokens)
