"""What ``inferline bench`` reports: per-request samples, latency distributions, throughput, the
summary, bench.json and plots."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferline.producer.reassembly import RequestHandle


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
        "n": len(values),
    }


def inter_token_latencies(token_times: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps: an event carrying n tokens after a gap g adds n samples of g/n."""
    out = []
    for (t0, _), (t1, n) in zip(token_times, token_times[1:]):
        if n > 0:
            out.extend([(t1 - t0) / n] * n)
    return out


@dataclass
class Sample:
    ok: bool
    code: str | None
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None
    output_tokens: int
    itl: list[float]
    token_times: list[tuple[float, int]]  # absolute monotonic times, for throughput over time
    attempts: int


def sample_of(handle: RequestHandle) -> Sample:
    r = handle.partial_result()
    failure = handle.failure
    return Sample(
        ok=failure is None,
        code=None if failure is None else failure.code,
        ttft_s=r.client_ttft_s,
        e2e_s=r.client_total_s,
        queue_s=r.timing.queue_s if r.timing else None,
        output_tokens=r.usage.completion_tokens if r.usage else len(r.token_ids),
        itl=inter_token_latencies(handle.token_times),
        token_times=list(handle.token_times),
        attempts=r.attempts,
    )


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The bench report: throughput, latency distributions and errors by code."""
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.code or "unknown"] = errors.get(s.code or "unknown", 0) + 1
    tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples),
        "completed": len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_s": distribution([s.ttft_s for s in ok if s.ttft_s is not None]),
        "itl_s": distribution([x for s in ok for x in s.itl]),
        "e2e_s": distribution([s.e2e_s for s in ok if s.e2e_s is not None]),
        "queue_s": distribution([s.queue_s for s in ok if s.queue_s is not None]),
        "restarted_requests": sum(1 for s in samples if s.attempts > 1),
    }


def throughput_series(
    samples: list[Sample], t0: float, bucket_s: float = 1.0
) -> list[tuple[float, float]]:
    """(time since start, output tokens/s) per bucket."""
    counts: dict[int, int] = {}
    for s in samples:
        for t, n in s.token_times:
            b = int((t - t0) // bucket_s)
            counts[b] = counts.get(b, 0) + n
    if not counts:
        return []
    return [(b * bucket_s, counts.get(b, 0) / bucket_s) for b in range(max(counts) + 1)]


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"requests     {report['completed']}/{report['requests']} ok in {report['wall_s']:.2f} s"
        f"  ({_fmt(report['requests_per_s'])} req/s, "
        f"{_fmt(report['output_tokens_per_s'])} output tok/s)",
        f"errors       {report['errors'] or 'none'}",
    ]
    for key, label in (
        ("ttft_s", "TTFT"),
        ("itl_s", "ITL"),
        ("e2e_s", "e2e"),
        ("queue_s", "queue"),
    ):
        d = report[key]
        lines.append(
            f"{label:<12} p50 {_ms(d['p50'])}  p90 {_ms(d['p90'])}  p99 {_ms(d['p99'])}  "
            f"mean {_ms(d['mean'])}"
        )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "      -" if x is None else f"{x * 1000:7.1f} ms"


def write_outputs(
    out: Path, report: dict[str, Any], samples: list[Sample], t0: float, plots: bool
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "throughput_over_time": throughput_series(samples, t0)}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    written = [out / "bench.json"]
    if plots and importlib.util.find_spec("matplotlib") is None:  # the light client has no plotting
        print(
            "no plots: matplotlib is not installed (pip install 'inferline[plots]')",
            file=sys.stderr,
        )
    elif plots:
        written += plot(out, samples, report["throughput_over_time"])
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)


def plot(out: Path, samples: list[Sample], series: list[tuple[float, float]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.ok]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in (
        ("TTFT", [s.ttft_s for s in ok if s.ttft_s is not None]),
        ("ITL", [x for s in ok for x in s.itl]),
        ("end-to-end", [s.e2e_s for s in ok if s.e2e_s is not None]),
    ):
        if values:
            xs = sorted(values)
            ax.plot(
                [x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label
            )
    ax.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of samples", title="latency CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    cdf = out / "latency_cdf.png"
    fig.savefig(cdf, dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t for t, _ in series], [v for _, v in series], drawstyle="steps-post")
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="throughput over time")
    ax.grid(alpha=0.3)
    tput = out / "throughput.png"
    fig.savefig(tput, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [cdf, tput]
