"""The linear layers' backends side by side: one pass over every linear weight of the model (30
decoder layers + the LM head, as one step computes them) at a given number of rows, on the C
GEMM (kernels/cpu/gemm.py) over fp32 panels and over 8-bit codes (where the weights have exact ones,
as a GGUF model's do), oneDNN and F.linear (MKL), alternated (ABCD DCBA ...) in one process.

    python -m bench.linear_backends                       # rows 1 8 16 32 64 128 512, 2 threads
    python -m bench.linear_backends --rows 32 60 --repeats 9

Prints GFLOP/s (the model's linear FLOPs x rows / the median pass) per backend and row count, and
each backend's time over the C GEMM's. The weights come from memory every pass (~540 MB for
SmolLM2-135M in fp32, ~170 MB as codes, past the caches either way), as in a real step; the rows
are random.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import roofline
from inferline.kernels.cpu.gemm import CodedWeight


def pass_seconds(ops, x_by_in: dict[int, torch.Tensor]) -> float:
    from inferline.worker.engine.models.linear import linear

    start = time.perf_counter()
    for w, packed in ops:
        linear(x_by_in[w.shape[1]], w, packed=packed)
    return time.perf_counter() - start


@torch.inference_mode()
def measure(args) -> dict:
    from inferline.config.settings import Settings
    from inferline.worker.engine.models.loader import load_model

    settings = Settings()  # the default model (SmolLM2-135M) or INFERLINE_MODEL__*
    model, _config, _tok = load_model(settings.model.path, settings.model.load_format, torch.float32,
                                      torch.device("cpu"), max_positions=settings.model.max_model_len)
    ops = {"c": roofline.linear_ops(model, "c"), "c+codes": roofline.linear_ops(model, "c+codes"),
           "onednn": roofline.linear_ops(model, "onednn"), "mkl": [(w, None) for w, _ in roofline.linear_ops(model)]}
    if not any(isinstance(p, CodedWeight) for _, p in ops["c+codes"]):
        del ops["c+codes"]  # no weight has exact 8-bit codes: the same as "c"
    ops = {name: o for name, o in ops.items() if all(p is not None for _, p in o) or name == "mkl"}
    flops = roofline.flops_per_token(model)["total"]
    table = {}
    for rows in args.rows:
        x_by_in = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in ops["mkl"]}
        times = {name: [] for name in ops}
        names = list(ops)
        for r in range(args.repeats + 1):
            for name in names if r % 2 == 0 else names[::-1]:
                t = pass_seconds(ops[name], x_by_in)
                if r:  # the first round warms up
                    times[name].append(t)
        table[rows] = {name: statistics.median(ts) for name, ts in times.items()}
        line = "  ".join(f"{name} {rows * flops / t / 1e9:6.1f}" for name, t in table[rows].items())
        ratios = "  ".join(f"{name}/c {t / table[rows]['c']:.2f}x" for name, t in table[rows].items() if name != "c")
        print(f"rows {rows:4d}  GFLOP/s: {line}   time {ratios}", flush=True)
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    p.add_argument("--repeats", type=int, default=5, help="timed passes per backend and row count")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    return roofline.in_thread(lambda: measure(args), threads=args.threads)


if __name__ == "__main__":
    main()
