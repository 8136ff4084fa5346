"""The benchmarks' one stats helper: percentiles, a run's requests summed up, runs compared per
path against a baseline, the run order that cancels a drifting load, the machine, the JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Timed:
    """One request on its run's clock, in seconds: sent, first token (None: none), done."""

    start: float
    first: float | None
    end: float
    tokens: int
    ok: bool = True


def pct(values, q: float) -> float | None:
    """The q-th percentile, linearly interpolated; None for no values."""
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def dist(values) -> dict:
    values = list(values)
    return {
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
    }


def summarize(timed: list[Timed], want_tokens: int) -> dict:
    """Throughput (output tokens of completed requests over first send to last answer) and
    latencies of one run; complete when every request ended well with the tokens asked for."""
    ok = [t for t in timed if t.ok]
    wall = max(t.end for t in timed) - min(t.start for t in timed) if timed else 0.0
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(timed),
        "completed": len(ok),
        "useful_tokens": tokens,
        "complete": len(ok) == len(timed) and tokens == want_tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_s": dist(t.first - t.start for t in ok if t.first is not None),
        "e2e_s": dist(t.end - t.start for t in ok),
    }


def compare(runs: list[dict], baseline: str, key: str = "path") -> dict:
    """Per path (runs[i][key]): the median over its runs of tokens/s and TTFT p50/p99; every other
    path against the baseline's (tokens/s and TTFT p99 as ratios, TTFT p50 as a difference)."""

    def med(rs, get):
        values = [v for v in map(get, rs) if v is not None]
        return statistics.median(values) if values else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    paths: dict[str, list[dict]] = {}
    for r in runs:
        paths.setdefault(r[key], []).append(r)
    table = {
        p: {
            "tokens_per_s": med(rs, lambda r: r["tokens_per_s"]),
            "ttft_p50_s": med(rs, lambda r: r["ttft_s"]["p50"]),
            "ttft_p99_s": med(rs, lambda r: r["ttft_s"]["p99"]),
            "runs": len(rs),
            "complete": all(r["complete"] for r in rs),
        }
        for p, rs in paths.items()
    }
    base = table.get(baseline)
    for path, row in table.items():
        if base and path != baseline:
            diff = (
                None
                if row["ttft_p50_s"] is None or base["ttft_p50_s"] is None
                else 1e3 * (row["ttft_p50_s"] - base["ttft_p50_s"])
            )
            row["vs_baseline"] = {
                "tokens_per_s": ratio(row["tokens_per_s"], base["tokens_per_s"]),
                "ttft_p50_diff_ms": diff,
                "ttft_p99": ratio(row["ttft_p99_s"], base["ttft_p99_s"]),
            }
    return table


def abba(names: list, repeats: int) -> list:
    """The run order: every other round reversed (A B, B A, ...), so a drift cancels."""
    return [n for r in range(repeats) for n in (names if r % 2 == 0 else names[::-1])]


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def machine_info() -> dict:
    torch = sys.modules.get("torch")  # where the benchmark imported it
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    return {
        "python": platform.python_version(),
        "torch": torch and torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch and torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def parser(name: str, doc: str, threads: int | None = None, out: str | None = None):
    """`python -m bench.NAME`'s parser: the docstring's first paragraph for a description, and
    where given --threads (the measuring thread's torch threads; 0: torch's) and --out."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.split("\n\n")[0])
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch threads (0: torch's)")
    if out:
        p.add_argument("--out", type=Path, default=RESULTS / out)
    return p


def header(name: str, argv, **extra) -> dict:
    """A result's first keys: the command that wrote it, the machine, then `extra`."""
    argv = argv if argv is not None else sys.argv[1:]
    return {
        "command": f"python -m bench.{name} " + " ".join(argv),
        "machine": machine_info(),
        **extra,
    }


def median_run(runs: list, key):
    """The median of `runs` by `key` (the lower one of an even count)."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def save(results: dict, out: Path, started: float, report) -> dict:
    """Stamp the run's length, write the JSON, print the report and where it went."""
    results["elapsed_s"] = time.time() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    report(results)
    print(f"\nwrote {out} ({results['elapsed_s']:.0f} s)")
    return results
