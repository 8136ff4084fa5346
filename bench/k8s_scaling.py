"""The chart's autoscaling signal under mixed request lengths: Kafka's lag against the workers'
backlog (issue 51), replayed through one policy, side by side on the same arrivals.

    python -m bench.k8s_scaling                  # 6 hours of load (~1 min)
    python -m bench.k8s_scaling --quick          # 20 minutes, for the test
    python -m bench.k8s_scaling --long-share 0   # one length: both signals should agree

A simulation, not a cluster, one second at a time, each request tracked:

- **Load**: Poisson arrivals whose rate rises from `low_rps` to `high_rps` and back over the run;
  a `long_share` of the requests generate `long_tokens` (a long answer, ~2 minutes), the others a
  short one (exponential, mean `short_tokens`), each on a random one of `partitions` partitions.
- **Workers** (docs/operations.md, "Why 16 requests per worker"): `seats` each; a decode step
  costs 30 ms plus 4.5 ms per running sequence (64 sequences: 200 tokens/s, a CPU worker of the
  default model), so every running request gains one token per step. A worker takes the oldest
  waiting requests of the partitions it owns as seats free. TTFT = the wait for a seat plus one
  step.
- **Signals**, read every `sync_s`: the backlog (requests not finished: in Kafka, waiting or
  running; `inferline_partition_backlog` summed) or Kafka's lag (per partition, the records from
  the lowest unfinished one to the end: finished records above a long request count too).
- **Policy** (the chart's defaults): desired = ceil(signal / `threshold`) within [min, max]; up at
  most +100% or +4 workers per minute, a new worker serving `startup_s` later; down to the highest
  desired of the last `down_window_s`, one worker per `down_period_s`. A step moves the fewest
  partitions (KIP-848's incremental protocol); the requests running on a moved partition start
  again on its new owner (counted as computed again).

Reports worker-hours, TTFT p50 / p99, requests computed again and the largest fleet per signal,
as a table and as JSON (bench/results/k8s_scaling.json). Every figure is the model's.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "k8s_scaling.json"
STEP_BASE_S, STEP_PER_SEQ_S = 0.030, 0.0045  # 64 sequences: 0.318 s a step, 200 tokens/s
SIGNALS = ("backlog", "lag")


@dataclass(frozen=True)
class Load:
    hours: float = 6.0
    partitions: int = 48
    low_rps: float = 2.0
    high_rps: float = 12.0
    short_tokens: float = 121.0
    long_tokens: int = 1_200
    long_share: float = 0.05
    seed: int = 0


@dataclass(frozen=True)
class Policy:
    threshold: float = 16.0
    min_workers: int = 2
    max_workers: int = 48
    seats: int = 64
    sync_s: int = 15
    up_pods: int = 4
    up_period_s: int = 60
    down_window_s: int = 1_200
    down_period_s: int = 120
    startup_s: int = 30


@dataclass
class Requests:
    """Every request of the run, in arrival order (so a partition's offsets are increasing)."""

    arrival: np.ndarray  # seconds
    partition: np.ndarray
    offset: np.ndarray  # within its partition
    tokens: np.ndarray  # to generate

    @classmethod
    def of(cls, load: Load) -> Requests:
        rng = np.random.default_rng(load.seed)
        seconds = int(load.hours * 3600)
        t = np.arange(seconds)
        rate = load.low_rps + (load.high_rps - load.low_rps) * np.sin(np.pi * t / seconds) ** 2
        counts = rng.poisson(rate)
        arrival = np.repeat(t, counts) + rng.uniform(0, 1, counts.sum())
        n = len(arrival)
        partition = rng.integers(0, load.partitions, n)
        offset = np.zeros(n, dtype=int)
        for p in range(load.partitions):
            mine = partition == p
            offset[mine] = np.arange(mine.sum())
        long = rng.uniform(size=n) < load.long_share
        short = np.maximum(1, rng.exponential(load.short_tokens, n)).astype(int)
        return cls(arrival, partition, offset, np.where(long, load.long_tokens, short))


class Fleet:
    """Workers, partition ownership and every request's progress, one second at a time."""

    def __init__(self, reqs: Requests, load: Load, policy: Policy) -> None:
        self.r, self.load, self.policy = reqs, load, policy
        n = len(reqs.arrival)
        self.done = np.zeros(n)  # tokens generated so far
        self.started = np.full(n, np.nan)  # first step (the first token's time)
        self.finished = np.zeros(n, dtype=bool)
        self.running = np.zeros(n, dtype=bool)
        self.owner = np.arange(load.partitions) % policy.min_workers  # partition -> worker slot
        self.ready_at = [0.0] * policy.min_workers  # per worker slot; inf: removed
        self.recomputed = 0
        self.worker_seconds = 0.0

    def workers(self, now: float) -> list[int]:
        return [w for w, at in enumerate(self.ready_at) if at <= now]

    def scale_to(self, n: int, now: float) -> None:
        alive = [w for w, at in enumerate(self.ready_at) if at != math.inf]
        for _ in range(n - len(alive)):
            self.ready_at.append(now + self.policy.startup_s)
        for w in alive[n:] if n < len(alive) else []:
            self.ready_at[w] = math.inf

    def rebalance(self, now: float) -> None:
        """Orphaned partitions, then the busiest workers' extras, go to the least loaded."""
        live = self.workers(now)
        share = math.ceil(self.load.partitions / len(live))
        counts = {w: int((self.owner == w).sum()) for w in live}
        for p in range(self.load.partitions):
            w = int(self.owner[p])
            if w in counts and counts[w] <= share:
                continue
            if w in counts:
                counts[w] -= 1
            to = min(counts, key=counts.get)
            counts[to] += 1
            self.move(p, to)

    def move(self, p: int, to: int) -> None:
        moved = self.running & (self.r.partition == p)
        self.recomputed += int(moved.sum())
        self.running[moved], self.done[moved] = False, 0.0
        self.owner[p] = to

    def second(self, now: float, arrived: int) -> None:
        """Admit and run for one second; `arrived`: requests visible so far."""
        live = self.workers(now)
        self.worker_seconds += sum(1 for at in self.ready_at if at != math.inf)
        lo = self.oldest_unfinished
        window = slice(lo, arrived)
        owner = self.owner[self.r.partition[window]]
        for w in live:
            mine = owner == w
            running = self.running[window] & mine
            free = self.policy.seats - int(running.sum())
            waiting = np.flatnonzero(mine & ~self.running[window] & ~self.finished[window])
            take = waiting[:free] + lo
            self.running[take] = True
            k = int(running.sum()) + len(take)
            steps = 1.0 / (STEP_BASE_S + STEP_PER_SEQ_S * k)
            first = take[np.isnan(self.started[take])]
            self.started[first] = now + 1.0 / steps  # arrived by `now`: a TTFT of a step at least
            on = np.flatnonzero(self.running[window] & mine) + lo
            self.done[on] += steps
            over = on[self.done[on] >= self.r.tokens[on]]
            self.finished[over], self.running[over] = True, False

    @property
    def oldest_unfinished(self) -> int:
        unfinished = np.flatnonzero(~self.finished)
        return int(unfinished[0]) if len(unfinished) else len(self.finished)

    def signal(self, kind: str, arrived: int) -> float:
        lo = self.oldest_unfinished
        if kind == "backlog":
            return float((~self.finished[lo:arrived]).sum())
        ends = np.zeros(self.load.partitions)
        np.maximum.at(ends, self.r.partition[:arrived], self.r.offset[:arrived] + 1)
        marks = ends.copy()  # a partition with nothing unfinished has no lag
        todo = np.flatnonzero(~self.finished[lo:arrived]) + lo
        np.minimum.at(marks, self.r.partition[todo], self.r.offset[todo])
        return float((ends - marks).sum())


def replay(reqs: Requests, load: Load, policy: Policy, kind: str) -> dict:
    fleet = Fleet(reqs, load, policy)
    seconds, arrived = int(load.hours * 3600), 0
    desired_log: list[tuple[float, int]] = []
    last_up = last_down = -math.inf
    peak = policy.min_workers
    live = fleet.workers(0)
    for now in range(seconds + 3_600):  # an hour past the last arrival to finish
        if fleet.workers(now) != live:  # a worker ready or removed: the group rebalances
            fleet.rebalance(now)
            live = fleet.workers(now)
        arrived = int(np.searchsorted(reqs.arrival, now))
        fleet.second(now, arrived)
        if now % policy.sync_s:
            continue
        want = math.ceil(fleet.signal(kind, arrived) / policy.threshold)
        want = min(policy.max_workers, max(policy.min_workers, want))
        desired_log = [(t, d) for t, d in desired_log if t > now - policy.down_window_s]
        desired_log.append((now, want))
        replicas = sum(1 for at in fleet.ready_at if at != math.inf)
        if want > replicas and now - last_up >= policy.up_period_s:
            fleet.scale_to(min(want, replicas + max(replicas, policy.up_pods)), now)
            last_up = now
        elif (target := max(d for _, d in desired_log)) < replicas:
            if now - last_down >= policy.down_period_s:
                fleet.scale_to(max(target, replicas - 1), now + 1)
                last_down = now
        peak = max(peak, replicas)
    ttft = fleet.started - reqs.arrival
    ttft = ttft[~np.isnan(ttft)]
    return {
        "worker_hours": round(fleet.worker_seconds / 3600, 1),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 2),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 2),
        "unfinished": int((~fleet.finished).sum()),
        "computed_again": fleet.recomputed,
        "peak_workers": peak,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 minutes of load, 24 partitions")
    ap.add_argument("--long-share", type=float, default=Load.long_share, help="0: one length")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    load = Load(hours=1 / 3, partitions=24) if args.quick else Load()
    load = replace(load, long_share=args.long_share)
    policy = Policy(max_workers=load.partitions)
    reqs = Requests.of(load)
    runs = {kind: replay(reqs, load, policy, kind) for kind in SIGNALS}
    report = {
        "command": " ".join(["python -m bench.k8s_scaling", *argv]),
        "machine": platform.processor() or platform.machine(),
        "load": asdict(load),
        "policy": asdict(policy),
        "requests": len(reqs.arrival),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{len(reqs.arrival)} requests, {load.long_share:.0%} of {load.long_tokens} tokens")
    print("signal  | worker-hours | TTFT p50 | TTFT p99 | computed again | peak workers")
    for kind, r in runs.items():
        print(
            f"{kind:7} | {r['worker_hours']:12} | {r['ttft_p50_s']:7} s | {r['ttft_p99_s']:7} s |"
            f" {r['computed_again']:14} | {r['peak_workers']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
