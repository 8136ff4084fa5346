"""What one hostile grammar in a batch costs everyone else's steps (issue 38).

    python -m bench.hostile_grammar                    # a batch of 64, 24 tokens each at most
    python -m bench.hostile_grammar --num-requests 64 --max-tokens 24

Two ModelRunners (the same model twice), each under its own engine, stepped in turns with the
order swapped every pair (ABBA, bench.structured_output.in_turns): `json` runs --num-requests
requests constrained to the nested JSON schema of bench.grammar_engines; `hostile` the same, but
its first request carries an ambiguous EBNF grammar (HOSTILE_EBNF: every split of a run of
letters is a parse) instead. Reported: the median ratio of
hostile / json step time over the pairs of steps where both batches were full and decoding, and
each mode's mean bitmask fill time per full step; and the ratio of the mean time of every step
(the hostile request is ended once its mask is over INFERLINE_STRUCTURED__MASK_BUDGET_MS in 3
steps, after which its batch is one short and no pair is "full").
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics

from bench.grammar_engines import SCHEMA
from bench.structured_output import ASK, Run, in_turns

# Ambiguous: `x ::= x x` splits any run of letters in every way, and 200 x's in a row (at least
# 200 characters: the request cannot end within the benchmark's tokens) multiply the parses.
HOSTILE_EBNF = "root ::= " + " ".join(["x"] * 200) + '\nx ::= x x | [a-z] | " "'


def requests(mode: str, n: int, max_tokens: int):
    from inferline.worker.engine.request import EngineRequest, SamplingParams, StructuredSpec

    schema = StructuredSpec("response_format", "json_schema", json.dumps(SCHEMA))
    hostile = StructuredSpec("structured", "grammar", HOSTILE_EBNF)
    return [EngineRequest(f"{mode}-{i}", SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=i,
                                                        structured=hostile if mode == "free" and i == 0 else schema),
                          messages=ASK, tenant=f"t{i}") for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    import bench.structured_output as so
    from bench.engine import engine_settings, warm_up_engine
    from inferline.worker.engine.model_runner import ModelRunner

    so.requests = requests  # Run builds its requests through this name; "free" is the hostile batch here
    settings = engine_settings("continuous", args.num_requests, 2048)
    runners = [ModelRunner(settings) for _ in so.MODES]
    for runner in runners:
        warm_up_engine(runner)
    gc.freeze()
    hostile, plain = (Run(r, settings, m, args.num_requests, args.max_tokens) for r, m in zip(runners, so.MODES))
    ratios = in_turns(hostile, plain)  # json / free pairs, i.e. plain / hostile
    h, p = hostile.summary(), plain.summary()
    print(f"full steps: hostile {h['full_steps']}, json {p['full_steps']}; mean ms/full step: hostile "
          f"{h['full_step_ms']:.1f}, json {p['full_step_ms']:.1f}; bitmask fill ms: hostile {h['fill_ms']:.2f}, "
          f"json {p['fill_ms']:.2f}")
    if ratios:
        print(f"hostile / json, full-batch step time: median of {len(ratios)} pairs "
              f"x{statistics.median(1 / r for r in ratios):.3f}")
    mean_step = {r.mode: r.seconds / r.engine.stats().num_steps for r in (hostile, plain)}
    ended = hostile.finals.get("free-0", ("?", ""))[0]
    print(f"every step: mean ms hostile {1e3 * mean_step['free']:.1f}, json {1e3 * mean_step['json']:.1f}: "
          f"x{mean_step['free'] / mean_step['json']:.3f}; the hostile request ended as {ended!r} after "
          f"{hostile.engine.stats().num_steps} steps of its engine")
    print(json.dumps({"hostile": h, "json": p, "pairs": len(ratios), "mean_step_ratio": mean_step["free"] / mean_step["json"],
                      "ratio_median": statistics.median(1 / r for r in ratios) if ratios else None, "hostile_end": ended}))


if __name__ == "__main__":
    main()
