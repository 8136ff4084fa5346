"""32 constrained against 32 unconstrained requests: what a grammar costs the engine.

    python -m bench.structured_output                  # 32 + 32 requests, 64 tokens each at most
    python -m bench.structured_output --num-requests 32 --max-tokens 64

Two ModelRunners (the same model twice), loaded and warmed on this thread, each under its own
engine: `free` gets `--num-requests` chat requests without a grammar (temperature 0.9, seeds
0..n-1, ignoring EOS so its batch stays full), `json` the same requests constrained to a nested
JSON schema (bench.grammar_engines.SCHEMA). The two engines step in turns, the order swapped
every pair (ABBA), so a shared machine's changing load falls on both alike. Reported per mode:
generated tokens per second of its own step time, the mean and median time of decode-only steps
at the full batch, the bitmask fill's part of them, how many requests ended by themselves (`stop`:
the grammar completed) and how many outputs are valid for the schema (an output cut by max_tokens
is a valid prefix, not a document); and the median of the per-pair step-time ratios.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from bench.grammar_engines import SCHEMA

ASK = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, whether active, role, "
                                   "a few tags and an address."}]
MODES = ("free", "json")


def requests(mode: str, n: int, max_tokens: int):
    from inferline.worker.engine.request import EngineRequest, SamplingParams, StructuredSpec

    structured = StructuredSpec("response_format", "json_schema", json.dumps(SCHEMA)) if mode == "json" else None
    return [EngineRequest(f"{mode}-{i}", SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=i,
                                                        structured=structured, ignore_eos=mode == "free"),
                          messages=ASK) for i in range(n)]


class FillTimer:
    """Wraps the runner's TokenBitmask.fill to add up its time (instance attribute only)."""

    def __init__(self, bitmask):
        self.seconds, self._fill = 0.0, bitmask.fill
        bitmask.fill = self

    def __call__(self, matchers):
        t0 = time.perf_counter()
        out = self._fill(matchers)
        self.seconds += time.perf_counter() - t0
        return out


class Run:
    """One engine and what its steps measured."""

    def __init__(self, runner, settings, mode: str, n: int, max_tokens: int):
        from inferline.worker.engine.engine import LLMEngine

        self.mode, self.n, self.engine = mode, n, LLMEngine(runner, settings)
        for req in requests(mode, n, max_tokens):
            self.engine.add_request(req)
        self.timer = FillTimer(runner.token_bitmask)
        self.seconds, self.full_steps, self.fills, self.finals = 0.0, [], [], {}

    def step(self) -> float | None:
        """One step; its time if every request decoded in it, else None."""
        t0, f0 = time.perf_counter(), self.timer.seconds
        for out in self.engine.step():
            if out.finished:
                self.finals[out.request_id] = (out.finish_reason, out.text)
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        stats = self.engine.stats()
        if stats.batch_size == self.n and stats.num_batched_tokens == self.n:  # every request decoding
            self.full_steps.append(elapsed)
            self.fills.append(self.timer.seconds - f0)
            return elapsed
        return None

    def summary(self) -> dict:
        tokens = self.engine.stats().num_generated_tokens
        nan = float("nan")  # no full-batch step (bench.hostile_grammar: its hostile request ends early)
        return {"mode": self.mode, "tokens_per_s": tokens / self.seconds, "tokens": tokens,
                "full_steps": len(self.full_steps),
                "full_step_ms": 1e3 * statistics.fmean(self.full_steps) if self.full_steps else nan,
                "median_step_ms": 1e3 * statistics.median(self.full_steps) if self.full_steps else nan,
                "fill_ms": 1e3 * statistics.fmean(self.fills) if self.fills else nan,
                "stopped": sum(reason == "stop" for reason, _ in self.finals.values()),
                "valid": sum(valid(text) for _, text in self.finals.values())}


def in_turns(free: Run, bound: Run) -> list[float]:
    """Step both engines in turns (ABBA) until both are done; the json/free ratios of the pairs
    of full-batch steps."""
    ratios, turn = [], 0
    while free.engine.has_unfinished_requests() or bound.engine.has_unfinished_requests():
        order = (free, bound) if turn % 2 == 0 else (bound, free)
        times = {r.mode: r.step() if r.engine.has_unfinished_requests() else None for r in order}
        if times["free"] and times["json"]:
            ratios.append(times["json"] / times["free"])
        turn += 1
    return ratios


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from bench.engine import engine_settings, warm_up_engine
    from inferline.worker.engine.model_runner import ModelRunner

    settings = engine_settings("continuous", args.num_requests, 2048)
    runners = [ModelRunner(settings) for _ in MODES]
    for runner in runners:
        warm_up_engine(runner)
    gc.freeze()  # as the worker's EngineLoop does once its engine is built
    free, bound = (Run(r, settings, m, args.num_requests, args.max_tokens) for r, m in zip(runners, MODES))
    ratios = in_turns(free, bound)
    print(f"{'mode':5} {'tokens/s':>9} {'tokens':>7} {'full steps':>10} {'ms/full step':>12} {'median ms':>9} "
          f"{'fill ms':>8} {'stop':>5} {'valid':>6}")
    for r in (free.summary(), bound.summary()):
        print(f"{r['mode']:5} {r['tokens_per_s']:9.1f} {r['tokens']:7d} {r['full_steps']:10d} "
              f"{r['full_step_ms']:12.1f} {r['median_step_ms']:9.1f} {r['fill_ms']:8.2f} {r['stopped']:5d} {r['valid']:6d}")
    print(f"json / free, full-batch step time: median of {len(ratios)} pairs x{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
