"""The ``inferline bench`` load generator: a workload reproducible from a seed, submitted through
one InferenceClient with Poisson arrivals."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferline.producer.bench_report import Sample, sample_of
from inferline.producer.client import InferenceClient


@dataclass
class Length:
    """A token-length distribution: ``fixed:N`` or ``uniform:A,B`` (both ends included)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Length:
        kind, _, spec = text.partition(":")
        try:
            if kind == "fixed":
                n = int(spec)
                return cls._checked(n, n)
            if kind == "uniform":
                a, b = (int(x) for x in spec.split(","))
                return cls._checked(a, b)
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(
            f"bad length {text!r}: use fixed:N or uniform:A,B with 1 <= A <= B"
        )

    @classmethod
    def _checked(cls, a: int, b: int) -> Length:
        if not 1 <= a <= b:
            raise ValueError
        return cls(a, b)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


def make_workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The request fields of each bench request, reproducible from --seed."""
    rng = random.Random(args.seed)
    common = {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos}
    if args.timeout is not None:
        common["timeout_s"] = args.timeout
    if args.dataset:
        rows = load_dataset(args.dataset)
        return [{**common, **rows[i % len(rows)]} for i in range(args.num_requests)]
    prompt_len, output_len = Length.parse(args.prompt_len), Length.parse(args.output_len)
    lo, hi = (int(x) for x in args.vocab.split(","))
    return [
        {
            **common,
            "prompt_token_ids": [rng.randrange(lo, hi) for _ in range(prompt_len.sample(rng))],
            "max_tokens": output_len.sample(rng),
        }
        for _ in range(args.num_requests)
    ]


def load_dataset(path: str) -> list[dict[str, Any]]:
    """JSONL rows: one of prompt / prompt_token_ids / messages, optional max_tokens (or
    output_len)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        row = {
            k: obj[k] for k in ("prompt", "prompt_token_ids", "messages", "max_tokens") if k in obj
        }
        if "output_len" in obj:
            row["max_tokens"] = obj["output_len"]
        rows.append(row)
    if not rows:
        raise SystemExit(f"inferline bench: {path} has no rows")
    return rows


async def run_load(
    client: InferenceClient,
    workload: list[dict[str, Any]],
    rate: float,
    rng: random.Random,
    progress: bool,
) -> tuple[list[Sample], float, float]:
    """Submit the workload (Poisson arrivals at ``rate``, or all at once); wait for every result."""
    from tqdm import tqdm

    bar = tqdm(
        total=len(workload), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    tokens = 0
    t0 = time.monotonic()

    async def one(fields: dict[str, Any]) -> Sample:
        nonlocal tokens
        handle = await client.submit(**fields)
        await handle.result(check=False)
        sample = sample_of(handle)
        tokens += sample.output_tokens
        bar.update(1)
        bar.set_postfix_str(f"{tokens / (time.monotonic() - t0):.1f} tok/s")
        return sample

    tasks = []
    for fields in workload:
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(fields)))
    samples = await asyncio.gather(*tasks)
    bar.close()
    return list(samples), time.monotonic() - t0, t0
