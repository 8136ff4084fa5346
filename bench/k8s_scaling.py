"""The Helm chart's autoscaling policy over one day of load, against a fixed fleet sized for the peak.

    python -m bench.k8s_scaling                 # the policy of deploy/helm/inferline/values.yaml (~5 min)
    python -m bench.k8s_scaling --sweep         # and 9 variants, one change each (~16 min)
    python -m bench.k8s_scaling --quick         # one hour, for the test

A simulation, not a cluster: one-second steps over 24 hours of diurnal load with spikes and
batch dumps, through what the chart configures (docs/operations.md, "Autoscaling"):

- **the workers**, from their measured capacity (docs/benchmarks.md): a CPU worker with
  SmolLM2-135M saturates at 200 output tokens/s (`bench.kafka_e2e`, stop 14: 195-203 tokens/s
  with 64 requests at once), the workload's mean output is 121 tokens (the same 64 requests: 7,771
  tokens), so 1.65 requests/s per worker; a decode step costs `STEP_BASE_S` + `STEP_PER_SEQ_S` per
  running sequence (the base from `bench.decode_step`, the slope from that saturation), so a
  worker's running requests follow Little's law. TTFT = the wait in Kafka and in the pool (FIFO per
  partition) + the engine's own TTFT, t0 (1 + k rho / (1 - rho)) at throughput utilization rho,
  through two measured points: 0.334 s idle (`bench.kafka_e2e` idle probe, stop 14) and 0.663 s
  p50 at 66% of saturation (`bench.gateway` run A, 16 in flight, 131.7 tokens/s).
- **Kafka**: P partitions, each owned by one worker (round robin, aiokafka's default; with P
  not a multiple of the fleet some workers own one partition more); lag = what is not finished (in Kafka, in the
  pools, running), as the workers' committed watermark counts it.
- **KEDA and the HPA**: every `sync_s` (the HPA's 15 s), desired = max(ceil(lag / lag
  threshold), capped at P, and ceil(sum of utilization / target)), each kept when within the HPA's
  10% tolerance; utilization = max(running / max_num_seqs, KV usage) + waiting / max_num_seqs,
  averaged over 1 min and 15 s old (a scrape); scale-up at most +100% or +4 per 60 s; scale-down the highest
  desired of the stabilization window, at most one worker per period.
- **What a step costs**: a new worker is ready `startup_s` after its pod is created (model load
  ~10-15 s on the dev VM, docs/reliability.md, plus scheduling and start), then joins: a
  rebalance. A removed worker drains (no intake; running requests finish, the rest requeued after
  drain_timeout_s); as a static member it does not leave, so its partitions wait the session
  timeout, then a rebalance. A rebalance today is eager (issue 37: a join requeued 48 of 48
  running requests): every worker stops for `rebalance_pause_s` and every running request of the
  fleet is requeued and computed again; `--rebalance incremental` models issue 37's goal (only
  the moved partitions' requests). Requeued requests go first, before new ones.

Reports worker-hours (pods alive, starting and draining included), TTFT p50 / p99 / p99.9 over
all requests, requests requeued, rebalances, the largest lag; a plot of the day
(bench/results/k8s_scaling.png) and JSON (bench/results/k8s_scaling.json). Every figure here is a
model's: the inputs are measured, the fleet is not.
"""
from __future__ import annotations

import argparse
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "results"

# Measured (docs/benchmarks.md), see the module docstring.
SATURATED_TOKENS_PER_S = 200.0
MEAN_OUTPUT_TOKENS = 121.0
MEAN_CONTEXT_TOKENS = 230.0      # prompt ~170 + half the output, for the KV term
KV_SLOTS = 21_696                # 1 GB of fp32 KV for SmolLM2-135M (docs/operations.md)
TTFT_IDLE_S = 0.334
TTFT_POINT = (0.66, 0.663)       # (throughput utilization, TTFT p50 s)
STEP_BASE_S = 0.030


@dataclass(frozen=True)
class Worker:
    seats: int = 64              # max_num_seqs
    max_waiting: int = 256

    @property
    def step_per_seq_s(self) -> float:  # a full batch runs at the saturated throughput
        return (self.seats / SATURATED_TOKENS_PER_S - STEP_BASE_S) / self.seats

    @property
    def mu(self) -> float:  # requests/s at saturation
        return SATURATED_TOKENS_PER_S / MEAN_OUTPUT_TOKENS

    def service_s(self, running: np.ndarray) -> np.ndarray:
        return MEAN_OUTPUT_TOKENS * (STEP_BASE_S + self.step_per_seq_s * running)

    def engine_ttft(self, rho: np.ndarray) -> np.ndarray:
        rho_p, t_p = TTFT_POINT
        k = (t_p / TTFT_IDLE_S - 1) * (1 - rho_p) / rho_p
        rho = np.clip(rho, 0.0, 0.98)
        return TTFT_IDLE_S * (1 + k * rho / (1 - rho))


@dataclass(frozen=True)
class Policy:
    """The chart's autoscaling values (deploy/helm/inferline/values.yaml) and the fleet's costs."""
    lag_threshold: float = 16
    util_target: float = 0.5
    min_replicas: int = 2
    max_replicas: int = 48
    sync_s: int = 15
    up_percent: int = 100
    up_pods: int = 4
    up_period_s: int = 60
    down_window_s: int = 1200
    down_pods: int = 1
    down_period_s: int = 120
    tolerance: float = 0.1
    metric_window_s: int = 60
    scrape_delay_s: int = 15
    startup_s: int = 30
    rebalance_pause_s: int = 5
    session_timeout_s: int = 10
    drain_timeout_s: int = 30
    rebalance: str = "eager"
    fixed: int | None = None     # a fixed fleet of this size instead


@dataclass(frozen=True)
class Day:
    hours: float = 24.0
    partitions: int = 48
    trough_rps: float = 1.5      # at 04:00
    peak_rps: float = 14.0       # at 16:00
    spikes: int = 6              # x1.8 the rate for 5-20 min
    dumps: int = 2               # 2,000 requests within a minute (a batch job)
    dump_size: int = 2000
    seed: int = 0


def arrivals(day: Day) -> np.ndarray:
    """Requests arriving in each second of the day (Poisson around the diurnal rate)."""
    rng = np.random.default_rng(day.seed)
    t = np.arange(int(day.hours * 3600))
    phase = 2 * np.pi * (t / 3600 - 4) / 24
    rate = day.trough_rps + (day.peak_rps - day.trough_rps) * (1 - np.cos(phase)) / 2
    for start in rng.uniform(0, len(t) - 1200, day.spikes).astype(int):
        rate[start:start + int(rng.uniform(300, 1200))] *= SPIKE
    counts = rng.poisson(rate).astype(float)
    for start in rng.uniform(0, len(t) - 60, day.dumps).astype(int):
        counts[start:start + 60] += day.dump_size / 60
    return counts


@dataclass
class Pod:
    uid: int                     # the slot of its state in the Fleet's arrays
    ordinal: int
    ready_at: float
    member: bool = False         # in the consumer group: owns partitions
    leaving_at: float | None = None   # SIGTERM
    exit_at: float | None = None


class Fleet:
    """Pods, the group's assignment and the engines, one second at a time (arrays over partitions
    and pod slots, so a day of a large fleet takes seconds)."""

    def __init__(self, day: Day, policy: Policy, worker: Worker):
        self.policy, self.worker = policy, worker
        self.P = day.partitions
        slots = 4 * policy.max_replicas + 16
        self.backlog = np.zeros(self.P)       # new requests not started
        self.redo = np.zeros(self.P)          # requeued requests, started first
        self.paused_until = np.zeros(self.P)
        self.owner = np.full(self.P, -1)      # pod uid, -1 none
        self.running = np.zeros(slots)
        self.serving = np.zeros(slots, dtype=bool)   # a member taking records (not draining)
        self.pods: list[Pod] = []
        self.gone: list[Pod] = []             # exited, still static members until the session timeout
        self.pod_seconds = 0.0
        self.requeued = 0.0
        self.rebalances = 0

    def scale_to(self, n: int, t: float) -> None:
        alive = sorted((p for p in self.pods if p.leaving_at is None), key=lambda p: p.ordinal)
        for ordinal in range(len(alive), n):
            self.pods.append(Pod(uid=self.free_slot(), ordinal=ordinal, ready_at=t + self.policy.startup_s))
        for pod in alive[n:]:           # the StatefulSet removes the highest ordinals
            pod.leaving_at = t
            self.serving[pod.uid] = False

    def free_slot(self) -> int:
        used = {p.uid for p in self.pods + self.gone} | set(self.owner.tolist())
        slot = next(i for i in range(len(self.running)) if i not in used)
        self.running[slot], self.serving[slot] = 0.0, False
        return slot

    def replicas(self) -> int:
        return sum(p.leaving_at is None for p in self.pods)

    def rebalance(self, t: float) -> None:
        members = [p for p in self.pods if p.member] + self.gone
        members.sort(key=lambda p: (p.ordinal, p.uid))
        uids = [p.uid for p in members]
        new = sticky(self.owner, uids) if self.policy.rebalance == "incremental" else round_robin(self.P, uids)
        moved = new != self.owner
        for pod in (p for p in self.pods if p.member):
            own = np.flatnonzero(self.owner == pod.uid)
            share = 1.0 if self.policy.rebalance == "eager" else (moved[own].mean() if len(own) else 0.0)
            self.requeue(pod, own, self.running[pod.uid] * share)
        pause = moved if self.policy.rebalance == "incremental" else np.ones(self.P, dtype=bool)
        self.paused_until[pause] = t + self.policy.rebalance_pause_s
        self.owner = new
        self.rebalances += 1

    def requeue(self, pod: Pod, own: np.ndarray, count: float) -> None:
        if count <= 0:
            return
        if len(own):
            self.redo[own] += count / len(own)
        else:
            self.redo += count / self.P
        self.running[pod.uid] -= count
        self.requeued += count

    def lifecycle(self, t: float) -> None:
        changed = False
        for pod in self.pods:
            if not pod.member and pod.leaving_at is None and t >= pod.ready_at:
                pod.member = self.serving[pod.uid] = changed = True
            if pod.leaving_at is not None and pod.exit_at is None and (
                    self.running[pod.uid] < 0.5 or t >= pod.leaving_at + self.policy.drain_timeout_s):
                self.requeue(pod, np.flatnonzero(self.owner == pod.uid), self.running[pod.uid])
                self.running[pod.uid] = 0.0
                pod.exit_at = t
        for pod in [p for p in self.pods if p.exit_at is not None]:
            self.pods.remove(pod)
            if pod.member:
                self.gone.append(pod)   # a static member: the group waits the session timeout
        for pod in [p for p in self.gone if t >= p.exit_at + self.policy.session_timeout_s]:
            self.gone.remove(pod)
            changed = True
        if changed:
            self.rebalance(t)

    def step(self, t: float, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """One second: arrivals, finishes, then each serving pod starts requeued and new requests
        of its open partitions into its free seats. Returns (new requests started per partition,
        the engine TTFT per partition, the sum of the pods' utilization)."""
        w = self.worker
        self.pod_seconds += len(self.pods)
        self.backlog += new
        run = self.running
        run -= np.minimum(run, run / w.service_s(run))
        owned = self.owner >= 0
        slot = np.where(owned, self.owner, 0)
        takes = owned & self.serving[slot] & (self.paused_until <= t)
        seats = np.maximum(w.seats - run, 0.0)
        n = len(run)
        redo_sum = np.bincount(slot[takes], self.redo[takes], minlength=n)
        take_redo = np.minimum(redo_sum, seats)
        self.redo[takes] *= 1 - ratio(take_redo, redo_sum)[slot[takes]]
        new_sum = np.bincount(slot[takes], self.backlog[takes], minlength=n)
        take_new = np.minimum(new_sum, seats - take_redo)
        fresh = np.zeros(self.P)
        fresh[takes] = self.backlog[takes] * ratio(take_new, new_sum)[slot[takes]]
        self.backlog -= fresh
        run += take_redo + take_new
        rho = run / w.service_s(run) / w.mu
        ttft = np.where(owned, w.engine_ttft(rho)[slot], TTFT_IDLE_S)
        queued = np.bincount(slot[owned], (self.backlog + self.redo)[owned], minlength=n)
        util = np.maximum(run / w.seats, run * MEAN_CONTEXT_TOKENS / KV_SLOTS) + np.minimum(queued, w.max_waiting) / w.seats
        return fresh, ttft, float(util[self.serving].sum())

    def lag(self) -> float:
        return float(self.backlog.sum() + self.redo.sum() + self.running.sum())


def round_robin(partitions: int, uids: list[int]) -> np.ndarray:
    """aiokafka's default assignor (RoundRobinPartitionAssignor): partition i to member i mod M."""
    return np.array([uids[i % len(uids)] for i in range(partitions)]) if uids else np.full(partitions, -1)


def sticky(owner: np.ndarray, uids: list[int]) -> np.ndarray:
    """An incremental, sticky assignment (KIP-848's uniform assignor, issue 37's goal): every member
    keeps what it can of its partitions within an even share; only the rest move."""
    P = len(owner)
    if not uids:
        return np.full(P, -1)
    quota = {u: P // len(uids) + (i < P % len(uids)) for i, u in
             enumerate(sorted(uids, key=lambda u: -(owner == u).sum()))}
    new = np.full(P, -1)
    for p in range(P):
        if owner[p] in quota and quota[owner[p]] > 0:
            new[p] = owner[p]
            quota[owner[p]] -= 1
    free = iter(u for u in uids for _ in range(quota[u]))
    for p in np.flatnonzero(new < 0):
        new[p] = next(free)
    return new


def ratio(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    return np.divide(part, whole, out=np.zeros_like(part), where=whole > 0)


class Autoscaler:
    """KEDA's two triggers through the HPA's algorithm and the chart's behavior."""

    def __init__(self, policy: Policy, partitions: int):
        self.policy, self.P = policy, partitions
        self.util: deque[float] = deque(maxlen=policy.metric_window_s + policy.scrape_delay_s)
        self.history: deque[tuple[float, int]] = deque()   # (t, recommendation)
        self.changes: deque[tuple[float, int]] = deque()   # (t, replicas added, or removed if < 0)

    def desired(self, lag: float, current: int) -> int:
        p = self.policy
        window = list(self.util)[p.scrape_delay_s:]   # newest first: a scrape old, a window long
        util = sum(window) / len(window) if window else 0.0
        out = []
        for value, target, cap in ((lag, p.lag_threshold, self.P), (util, p.util_target, p.max_replicas)):
            ratio_ = value / (target * current) if current else math.inf
            out.append(current if abs(ratio_ - 1) <= p.tolerance else min(cap, math.ceil(value / target)))
        return max(p.min_replicas, min(p.max_replicas, max(out)))

    def decide(self, t: float, lag: float, current: int) -> int:
        p = self.policy
        want = self.desired(lag, current)
        self.history.append((t, want))
        while self.history[0][0] <= t - p.down_window_s:
            self.history.popleft()
        while self.changes and self.changes[0][0] <= t - max(p.up_period_s, p.down_period_s):
            self.changes.popleft()
        if want > current:
            base = current - sum(d for s, d in self.changes if d > 0 and s > t - p.up_period_s)
            want = min(want, max(base * (100 + p.up_percent) // 100, base + p.up_pods))
        elif want < current:
            want = min(current, max(n for _, n in self.history))   # the window's highest
            base = current - sum(d for s, d in self.changes if d < 0 and s > t - p.down_period_s)
            want = max(want, base - p.down_pods)
        if want != current:
            self.changes.append((t, want - current))
        return want


def simulate(day: Day, policy: Policy, worker: Worker = Worker(), load: np.ndarray | None = None) -> dict:
    load = arrivals(day) if load is None else load
    seconds = len(load)
    fleet = Fleet(day, policy, worker)
    scaler = Autoscaler(policy, day.partitions)
    n0 = policy.fixed or policy.min_replicas
    fleet.scale_to(n0, -policy.startup_s)
    per_partition = np.full(day.partitions, 1.0 / day.partitions)
    arrived = np.zeros((seconds + 1, day.partitions))
    started = np.zeros((seconds + 1, day.partitions))
    engine_ttft = np.zeros((seconds, day.partitions))
    replicas = np.zeros(seconds, dtype=int)
    lag = np.zeros(seconds)
    for t in range(seconds):
        fleet.lifecycle(t)
        new = load[t] * per_partition
        fresh, ttft, util = fleet.step(t, new)
        scaler.util.appendleft(util)
        arrived[t + 1] = arrived[t] + new
        started[t + 1] = started[t] + fresh
        engine_ttft[t] = ttft
        lag[t] = fleet.lag()
        if policy.fixed is None and t % policy.sync_s == 0:
            fleet.scale_to(scaler.decide(t, lag[t], fleet.replicas()), t)
        replicas[t] = len(fleet.pods)
    waits = ttft_of_requests(arrived, started, engine_ttft)
    p99_10min = waits.pop("_ttft")
    return {"policy": asdict(policy), "day": asdict(day), "worker": asdict(worker),
            "worker_hours": fleet.pod_seconds / 3600, "requests": float(load.sum()),
            "requeued": fleet.requeued, "rebalances": fleet.rebalances, "max_lag": float(lag.max()),
            "max_replicas_seen": int(replicas.max()), **waits,
            "series": {"load": load, "replicas": replicas, "lag": lag, "ttft_p99_10min": p99_10min}}


def ttft_of_requests(arrived: np.ndarray, started: np.ndarray, engine: np.ndarray) -> dict:
    """Each second's arrivals on a partition wait (FIFO) until the partition's fresh starts reach
    them, then take the engine's TTFT of that moment. Percentiles weigh each cohort by its size;
    requests not started by the end of the day count as waiting until then."""
    seconds, P = engine.shape
    ttft = np.full((seconds, P), np.nan)
    weights = np.diff(arrived, axis=0)
    for p in range(P):
        middle = (arrived[:-1, p] + arrived[1:, p]) / 2
        at = np.searchsorted(started[1:, p], middle, side="left")   # the second it starts in
        done = at < seconds
        t0 = np.arange(seconds)
        wait = np.where(done, at - t0, seconds - t0).astype(float)
        eng = engine[np.minimum(at, seconds - 1), p]
        ttft[:, p] = np.maximum(wait, 0) + eng
    w, v = weights.ravel(), ttft.ravel()
    pick = lambda q: weighted_quantile(v, w, q)  # noqa: E731
    windows = [weighted_quantile(ttft[i:i + 600].ravel(), weights[i:i + 600].ravel(), 0.99)
               for i in range(0, seconds, 600)]
    return {"ttft_p50_s": pick(0.5), "ttft_p99_s": pick(0.99), "ttft_p999_s": pick(0.999),
            "ttft_over_10s": float(w[v > 10].sum() / w.sum()), "_ttft": np.array(windows)}


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    keep = weights > 0
    if not keep.any():
        return float("nan")
    order = np.argsort(values[keep])
    cum = np.cumsum(weights[keep][order]) / weights[keep].sum()
    return float(values[keep][order][min(np.searchsorted(cum, q), keep.sum() - 1)])


SPIKE = 1.8   # the spikes' factor on the diurnal rate


def fixed_size(day: Day, policy: Policy, worker: Worker, factor: float = 1.0) -> int:
    """The smallest fleet that divides the partitions evenly and carries the diurnal peak (times
    `factor`) at 75% of its saturated throughput."""
    need = factor * day.peak_rps / (worker.mu * 0.75)
    return min(n for n in range(1, day.partitions + 1) if day.partitions % n == 0 and n >= need)


# --sweep: one change at a time from the chart's defaults.
SWEEP = {
    "lag 8": {"lag_threshold": 8},
    "lag 24": {"lag_threshold": 24},
    "lag 40, util 0.75": {"lag_threshold": 40, "util_target": 0.75},
    "util 0.25": {"util_target": 0.25},
    "lag only (no utilization trigger)": {"util_target": 1e9},
    "down window 600 s": {"down_window_s": 600},
    "down 2 pods / 300 s": {"down_pods": 2, "down_period_s": 300},
    "startup 120 s": {"startup_s": 120},
    "session timeout 60 s": {"session_timeout_s": 60},
}


def summary(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "series"}


def row(name: str, r: dict) -> str:
    return (f"{name:<34} {r['worker_hours']:8.1f} {r['ttft_p50_s']:7.2f} {r['ttft_p99_s']:8.2f} "
            f"{r['ttft_p999_s']:8.2f} {100 * r['ttft_over_10s']:6.2f}% {r['requeued']:9.0f} "
            f"{r['rebalances']:5d} {r['max_lag']:8.0f}")


HEADER = (f"{'policy':<34} {'w-hours':>8} {'p50 s':>7} {'p99 s':>8} {'p99.9 s':>8} {'>10 s':>7} "
          f"{'requeued':>9} {'rebal':>5} {'max lag':>8}")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    any_r = next(iter(results.values()))
    minutes = np.arange(len(any_r["series"]["load"])) / 3600
    load = any_r["series"]["load"]
    axes[0].plot(minutes, np.convolve(load, np.ones(60) / 60, mode="same"), lw=0.8)
    axes[0].set_ylabel("requests/s (1 min mean)")
    for name, r in results.items():
        axes[1].plot(minutes, r["series"]["replicas"], lw=1, label=name)
        p99 = r["series"]["ttft_p99_10min"]
        axes[2].step((np.arange(len(p99)) + 1) / 6, p99, lw=0.9, label=name)
    axes[1].set_ylabel("worker pods")
    axes[1].legend(fontsize=8)
    axes[2].set_ylabel("TTFT p99 of each 10 min (s)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("hour of the day")
    fig.suptitle("bench.k8s_scaling: KEDA policy vs a fixed fleet (modeled from measured worker capacity)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one hour near the peak, one spike and one batch job")
    ap.add_argument("--sweep", action="store_true", help="also the variants of SWEEP, one change each")
    ap.add_argument("--rebalance", choices=("eager", "incremental"), default="eager")
    ap.add_argument("--startup-s", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    day = Day(seed=args.seed, hours=1.0 if args.quick else 24.0, spikes=1 if args.quick else 6,
              dumps=1 if args.quick else 2, trough_rps=10.0 if args.quick else 1.5)
    worker = Worker()
    base = Policy(rebalance=args.rebalance, startup_s=args.startup_s)
    load = arrivals(day)
    n_fixed, n_spike = fixed_size(day, base, worker), fixed_size(day, base, worker, SPIKE)
    runs = {f"fixed {n_fixed} (diurnal peak)": replace(base, fixed=n_fixed),
            f"fixed {n_spike} (spike peak)": replace(base, fixed=n_spike),
            "chart defaults": base,
            "chart, incremental rebalance": replace(base, rebalance="incremental")}
    if args.sweep:
        runs |= {name: replace(base, **change) for name, change in SWEEP.items()}
    results = {}
    print(HEADER)
    for name, policy in runs.items():
        results[name] = simulate(day, policy, worker, load)
        print(row(name, results[name]), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot({k: results[k] for k in list(runs)[:4]}, args.out_dir / "k8s_scaling.png")
    out = {"capacity": {"requests_per_s_per_worker": worker.mu, "saturated_tokens_per_s": SATURATED_TOKENS_PER_S,
                        "mean_output_tokens": MEAN_OUTPUT_TOKENS, "fixed_fleets": [n_fixed, n_spike]},
           "runs": {k: summary(v) for k, v in results.items()}}
    (args.out_dir / "k8s_scaling.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out_dir / 'k8s_scaling.json'} and k8s_scaling.png")
    return out


if __name__ == "__main__":
    main()
