"""The real Scheduler in virtual time: batch beside interactive work under a step-cost model.

    python -m bench.scheduler_sim                          # CPU costs; limit off, on at 8..64 seats
    python -m bench.scheduler_sim --cost gpu --seats 16,64
    python -m bench.scheduler_sim --fixed-ms 30 --row-ms 4.5 --prefill-ms 4.0

Measured through Kafka, a round takes 20 minutes on a shared machine (docs/batch.md); this
replays the workload in seconds through worker/engine/scheduler.py and block_manager.py, with no
model: a step costs `fixed + row x decode rows + prefill x prompt tokens` ms, and the clock moves
by that, so a background limit can be chosen before the slow measurement confirms it. Not
simulated: Kafka and the client, sampling, prefix caching, the waiting pool's cap. Per policy,
three loads: interactive alone (Poisson arrivals of short chats, priority 0), the batch alone
(1,000 lines at priority 100, `--in-flight` at a time), both. Idle capacity two ways: the batch's
alone rate less the interactive tokens/s, and the batch's alone rate times the engine's idle
share under the interactive load.
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
from dataclasses import dataclass, field

from bench import stats
from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.scheduler import BackgroundLimit, Scheduler
from inferline.worker.engine.sequence import Sequence

# ms per step: fixed, per decode row, per prompt token. cpu: 30 ms + 4.5 ms a running sequence,
# SmolLM2 on the 2-core VM, a prompt token about a row. gpu: an assumption for a small model on
# one GPU (launch-bound steps), unmeasured.
COSTS = {"cpu": (30.0, 4.5, 4.0), "gpu": (8.0, 0.05, 0.02)}
BATCH_PRIORITY = 100


@dataclass
class Load:
    rate: float = 2.0  # interactive requests/s
    interactive: int = 120
    interactive_prompt: int = 30
    interactive_tokens: int = 16
    batch_lines: int = 1000  # the batch alone (its rate is the capacity); beside, it never runs out
    batch_prompt: int = 25
    batch_tokens: int = 32
    in_flight: int = 64


@dataclass
class Engine:
    """A Scheduler and a clock (ms). Arrivals wait in a heap until the clock reaches them."""

    scheduler: Scheduler
    cost: tuple[float, float, float]
    now: float = 0.0
    busy: float = 0.0
    arrivals: list = field(default_factory=list)  # (time, n, seq)
    first_token: dict = field(default_factory=dict)  # seq -> ms
    finished: list = field(default_factory=list)  # (ms, seq)

    def submit(self, at: float, seq: Sequence) -> None:
        heapq.heappush(self.arrivals, (at, id(seq), seq))

    def step(self) -> list[Sequence]:
        """One engine step (or a jump to the next arrival when idle); the sequences it finished."""
        while self.arrivals and self.arrivals[0][0] <= self.now:
            at, _, seq = heapq.heappop(self.arrivals)
            seq.arrival_time = at  # a request arriving mid-step waits for the step's end
            self.scheduler.add(seq)
        if not self.scheduler.has_unfinished():
            self.now = max(self.now, self.arrivals[0][0]) if self.arrivals else self.now
            return []
        out = self.scheduler.schedule()
        fixed, row, prefill = self.cost
        rows = sum(1 for c in out.scheduled if c.num_new_tokens == 1)
        prompt_tokens = sum(c.num_new_tokens for c in out.scheduled if c.num_new_tokens > 1)
        took = fixed + row * rows + prefill * prompt_tokens
        self.now += took
        self.busy += took
        return self._advance(out)

    def _advance(self, out) -> list[Sequence]:
        done = []
        for chunk in out.scheduled:
            seq, samples = chunk.seq, chunk.samples
            seq.num_computed_tokens += chunk.num_new_tokens
            if not samples:
                continue
            seq.output_token_ids.append(1)
            self.first_token.setdefault(seq, self.now)
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                self.scheduler.remove(seq)
                seq.finish("length")
                self.finished.append((self.now, seq))
                done.append(seq)
        return done


def _seq(rid: str, prompt: int, tokens: int, priority: int) -> Sequence:
    return Sequence(rid, [1] * prompt, SamplingParams(max_tokens=tokens), priority=priority)


def run(
    load: Load, cost, background: BackgroundLimit | None, interactive: bool, batch: bool, seed=0
):
    """One load on a fresh engine (64 seats, 512 tokens a step, the 1 GB cache's 1,356 blocks):
    with `batch`, the lines run at full width first; with `interactive`, Poisson arrivals start
    then (after 5 s of batch alone)."""
    scheduler = Scheduler(BlockManager(1356, 16), 64, 512, background=background)
    engine = Engine(scheduler, cost)
    scheduler.clock = lambda: engine.now / 1000
    rng = random.Random(seed)
    lines = iter(range(load.batch_lines if not interactive else 10**9))  # beside: outlasts chats

    def next_line() -> None:
        i = next(lines, None)
        if i is not None:
            engine.submit(
                engine.now, _seq(f"b{i}", load.batch_prompt, load.batch_tokens, BATCH_PRIORITY)
            )

    for _ in range(load.in_flight if batch else 0):
        next_line()
    start = 5000.0 if batch else 0.0
    chats, t = [], start
    if interactive:
        for i in range(load.interactive):
            chats.append(_seq(f"i{i}", load.interactive_prompt, load.interactive_tokens, 0))
            engine.submit(t, chats[-1])
            t += rng.expovariate(load.rate) * 1000
    end = None
    while engine.arrivals or engine.scheduler.has_unfinished():
        for seq in engine.step():
            if seq.priority == BATCH_PRIORITY:
                next_line()
        if interactive and end is None and all(s.is_finished for s in chats):
            end = engine.now
            if batch:
                break
    t0, t1 = start, end if interactive else engine.now
    in_window = [s for t, s in engine.finished if s.priority == BATCH_PRIORITY and t0 <= t < t1]
    batch_tokens, chat_tokens = (sum(s.num_output_tokens for s in ss) for ss in (in_window, chats))
    seconds = (t1 - t0) / 1000
    ttfts = sorted(engine.first_token[s] - s.arrival_time for s in chats)
    return {
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "batch_tokens_per_s": batch_tokens / seconds if seconds else 0.0,
        "interactive_tokens_per_s": chat_tokens / seconds if chats else 0.0,
        "busy_share": engine.busy / engine.now if engine.now else 0.0,
    }


def compare(load: Load, cost, background: BackgroundLimit | None, seed: int = 0) -> dict:
    alone = run(load, cost, None, interactive=True, batch=False, seed=seed)
    capacity = run(load, cost, None, interactive=False, batch=True, seed=seed)["batch_tokens_per_s"]
    both = run(load, cost, background, interactive=True, batch=True, seed=seed)
    by_tokens = capacity - alone["interactive_tokens_per_s"]
    by_time = capacity * (1 - alone["busy_share"])
    return {
        "seats": background.max_tokens if background else None,
        "alone": background.alone_max_tokens if background else None,
        "ttft_p50_ratio": both["ttft_p50_ms"] / alone["ttft_p50_ms"],
        "ttft_p99_ratio": both["ttft_p99_ms"] / alone["ttft_p99_ms"],
        "ttft_p99_ms": (round(alone["ttft_p99_ms"]), round(both["ttft_p99_ms"])),
        "batch_alone": round(capacity, 1),
        "batch_beside": round(both["batch_tokens_per_s"], 1),
        "idle_used_by_tokens": both["batch_tokens_per_s"] / by_tokens,
        "idle_used_by_time": both["batch_tokens_per_s"] / by_time,
        "interactive_busy_share": round(alone["busy_share"], 3),
    }


def main(argv=None) -> None:
    p = stats.parser("scheduler_sim", __doc__)
    p.add_argument("--cost", choices=sorted(COSTS), default="cpu")
    p.add_argument("--fixed-ms", type=float)
    p.add_argument("--row-ms", type=float)
    p.add_argument("--prefill-ms", type=float)
    seats = "background_max_tokens values to try (beside 'off')"
    p.add_argument("--seats", default="8,16,24,32,64", help=seats)
    alone = "alone_max_tokens values to try with each --seats value (no interactive work)"
    p.add_argument("--alone", default="", help=alone)
    quiet = "seconds without interactive work after which --alone applies"
    p.add_argument("--quiet-s", type=float, default=BackgroundLimit.quiet_s, help=quiet)
    p.add_argument("--rate", type=float, default=Load.rate)
    p.add_argument("--interactive", type=int, default=Load.interactive, help="requests per load")
    p.add_argument("--seeds", type=int, default=3, help="runs per policy (Poisson); medians")
    args = p.parse_args(argv)
    fixed, row, prefill = COSTS[args.cost]
    cost = (args.fixed_ms or fixed, args.row_ms or row, args.prefill_ms or prefill)
    load = Load(rate=args.rate, interactive=args.interactive)
    print(f"cost model (ms): fixed, per decode row, per prompt token {cost}; {load}")
    alone = [None, *(int(n) for n in args.alone.split(",") if n)]
    seats = [int(n) for n in args.seats.split(",")]
    limits = [BackgroundLimit(BATCH_PRIORITY, n, a, args.quiet_s) for n in seats for a in alone]
    for background in [None, *limits]:
        runs = [compare(load, cost, background, seed) for seed in range(args.seeds)]
        row_ = dict(runs[0])
        for k in [k for k, v in row_.items() if isinstance(v, float)]:
            row_[k] = round(statistics.median(r[k] for r in runs), 3)
        print(json.dumps(row_))


if __name__ == "__main__":
    main()
