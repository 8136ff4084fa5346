"""Where the model is loaded vs where it runs: decode-step time when the engine is built on the
thread that steps it (what EngineLoop does) against built on another thread that stays alive
(what the worker did before: `asyncio.to_thread`, an executor thread).

    python -m bench.load_thread              # 3 processes of each, alternated, batch 29

Why it can differ: every thread that runs OpenMP work keeps its own OpenMP pool for the life of
the process, and once libgomp manages more threads than there are CPUs it stops spinning between
parallel regions, so each region (every oneDNN matmul, every C kernel call) pays a futex wake-up.
The state is process-wide, so each measurement is a process of its own; the modes alternate
(ABAB...) because the machine's load drifts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

MODES = ("same_thread", "other_thread")


def torch_threads_then(threads: int, fn, *args):
    import torch

    torch.set_num_threads(threads)  # OpenMP's thread count is per thread
    return fn(*args)


def child(mode: str, batch: int, steps: int, threads: int) -> dict:
    from bench.decode_step import build_engine
    from bench.roofline import in_thread

    args = argparse.Namespace(batch=batch, max_prompt=270, seed=0, extra_context=128, warmup=3)
    executor = ThreadPoolExecutor(1)  # kept alive to the end, as the worker's default executor is

    def run() -> float:
        if mode == "other_thread":  # built on the executor's thread itself, which lives on
            eng = executor.submit(lambda: torch_threads_then(threads, build_engine, args)).result()
        else:
            eng = build_engine(args)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    median_ms = in_thread(run, threads)  # the stepping thread, as EngineLoop's
    executor.shutdown()
    return {"mode": mode, "median_ms": median_ms}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.load_thread", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="processes per mode")
    p.add_argument("--batch", type=int, default=29)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.steps, args.threads)))
        return {}
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.repeats):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            cmd = [sys.executable, "-m", "bench.load_thread", "--child", mode, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ms = json.loads(out.strip().splitlines()[-1])["median_ms"]
            results[mode].append(ms)
            print(f"  {mode:13s} {ms:6.1f} ms/step (median of {args.steps})", flush=True)
    same, other = (statistics.median(results[m]) for m in MODES)
    print(f"batch {args.batch}: built on the stepping thread {same:.1f} ms, on another live thread {other:.1f} ms "
          f"({other / same:.2f}x)")
    return results


if __name__ == "__main__":
    main()
