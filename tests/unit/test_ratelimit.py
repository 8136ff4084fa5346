"""Token buckets per tenant: requests/s and generated tokens/min."""

from inferline.config.settings import LimitsSettings, TenantLimit
from inferline.worker.service.ratelimit import RateLimiter


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def limiter(**kw):
    clock = Clock()
    return RateLimiter(LimitsSettings(**kw), clock=clock), clock


def test_unlimited_by_default():
    rl, _ = limiter()
    assert all(rl.admit("anyone", 10_000) for _ in range(1000))


def test_requests_per_second_with_burst():
    rl, clock = limiter(default_tenant=TenantLimit(requests_per_s=2, burst_requests=3))
    assert [rl.admit("a", 1) for _ in range(4)] == [True, True, True, False]
    clock.t += 0.5  # one request's worth refills
    assert rl.admit("a", 1) and not rl.admit("a", 1)


def test_tenants_are_independent_and_overrides_apply():
    rl, _ = limiter(
        default_tenant=TenantLimit(requests_per_s=1),
        tenants={"big": TenantLimit(requests_per_s=100)},
    )
    assert rl.admit("a", 1) and not rl.admit("a", 1)
    assert rl.admit("b", 1)
    assert sum(rl.admit("big", 1) for _ in range(150)) == 100


def test_tokens_per_minute_charged_up_front_and_refunded():
    rl, clock = limiter(default_tenant=TenantLimit(tokens_per_min=600))  # 10 tokens/s
    assert rl.admit("a", 400)
    assert rl.admit("a", 200)
    assert not rl.admit("a", 1)
    rl.refund("a", 150)  # generated 50 of its 200
    assert rl.admit("a", 150) and not rl.admit("a", 1)
    clock.t += 3.0
    assert rl.admit("a", 30)


def test_request_larger_than_capacity_needs_a_full_bucket():
    rl, clock = limiter(default_tenant=TenantLimit(tokens_per_min=60))
    assert rl.admit("a", 1000)  # would never fit: admitted on a full bucket, leaves debt
    clock.t += 30.0
    assert not rl.admit("a", 1)


def test_idle_tenants_are_pruned(monkeypatch):
    import inferline.worker.service.ratelimit as mod

    monkeypatch.setattr(mod, "MAX_TENANTS", 10)
    rl, clock = limiter(default_tenant=TenantLimit(requests_per_s=1))
    for i in range(50):
        rl.admit(f"t{i}", 1)
        clock.t += 2.0
    assert len(rl._tenants) <= 10
