"""Padded decode steps on the Triton kernels under the interpreter, in its own process.

    python tests/padded_decode_cases.py CONFIG_DIR      one JSON line

A Llama-shaped dummy model (fp32) on the Triton kernels as `auto` sets them up on CUDA, with
buckets up to 4 (max_num_seqs 4): the same requests run as flat batches, as padded decode steps
(INFERLINE_MODEL__CUDA_GRAPHS=eager), and through DecodeGraphs with a fake capture (the capture's
forwards on padding rows first: they must write no K/V). tests/kernels/test_padded_decode_triton.py
checks the three give the same tokens. Last, the step a graph captures runs once under a
TorchDispatchMode that records device syncs (`_local_scalar_dense`: .item(), int(); `nonzero`),
which a capture refuses, with the launchers' range checks off as on CUDA.
The decode plans are a small GPU's (4 SMs) with splits of at least 16 tokens, so these short
contexts split as long ones do on a big one: each step's split length (written to the padded
step's buffer) is recorded with its longest context.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# As a script its folder (tests/, which holds a `kernels` package) comes first on the path: drop
# it, and find `tests` after site-packages (where Hugging Face's `kernels` and inferline live).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from inferline.kernels.triton import decode, launch  # noqa: E402
from tests.engine_fixtures import greedy, make_engine, run_to_completion  # noqa: E402
from tests.triton_engine_cases import cuda_like_settings  # noqa: E402
from inferline.worker.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from inferline.worker.engine.model_runner import ModelRunner  # noqa: E402
from inferline.worker.engine.request import EngineRequest  # noqa: E402


class EagerGraph:
    """A fake CUDA graph: replay() runs the step eagerly."""

    def __init__(self, step):
        self.step = step

    def replay(self):
        self.step()

    def pool(self):
        return None


def fake_capture(step, pool):
    step()
    return EagerGraph(step)


class Syncs(TorchDispatchMode):
    """Records the ops that sync a CUDA device with the host. On CPU tensors .tolist() and .cpu()
    dispatch nothing, so this sees only the syncs that go through an op."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            self.log.append(func.__name__)
        return func(*args, **(kwargs or {}))


def syncs_in_the_captured_step(padded) -> list[str]:
    os.environ["INFERLINE_KERNEL_CHECKS"] = "0"  # as on CUDA: the range checks read values
    log = []
    try:
        padded.load_padding(4)
        with torch.inference_mode(), Syncs(log):
            padded.forward(4)
    finally:
        del os.environ["INFERLINE_KERNEL_CHECKS"]
    return log


def served(runner: ModelRunner) -> tuple[dict, list]:
    """Three requests finishing one after another (decode batches of 3, 2, 1 rows:
    buckets 4, 2, 1)."""
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(140)]
    arrivals = {
        0: [
            EngineRequest(request_id=f"r{n}", prompt_token_ids=prompt[:n], sampling=greedy(t))
            for n, t in ((20, 6), (40, 4), (140, 3))
        ]
    }
    steps, padded = [], runner.padded_decode
    if padded is not None:
        load = padded.load
        padded.load = lambda step: (
            load(step),
            steps.append(
                [
                    step.tokens.shape[1],
                    len(step.ordered),
                    step.max_context,
                    int(padded.buffers.split_len[0]),
                ]
            ),
        )[0]
    try:
        results = run_to_completion(make_engine(runner), arrivals)
    finally:
        if padded is not None:
            del padded.load
    return {rid: r["tokens"] for rid, r in results.items()}, steps


def main() -> None:
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    launch.INTERPRETER = launch.Target(num_sms=4, interpreter=True)
    decode.MIN_SPLIT_TOKENS = 16
    settings = cuda_like_settings(
        path=sys.argv[1],
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        cuda_graphs="eager",
    )
    settings.scheduler.max_num_seqs = 4
    runner = ModelRunner(settings)
    padded_tokens, padded_steps = served(runner)
    padded, runner.padded_decode = runner.padded_decode, None
    flat_tokens, _ = served(runner)
    runner.padded_decode = padded
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    graphs = DecodeGraphs(padded, fake_capture)
    report = graphs.capture_all()
    untouched = all(
        torch.equal(k, k0) and torch.equal(v, v0)
        for (k, v), (k0, v0) in zip(runner.kv_cache, before)
    )
    runner.decode_graphs = graphs
    graph_tokens, graph_steps = served(runner)
    syncs = syncs_in_the_captured_step(padded)
    print(
        json.dumps(
            {
                "backends": runner.backends.__dict__,
                "buckets": padded.sizes,
                "captured": report.buckets,
                "kv_untouched": untouched,
                "padded": padded_tokens,
                "flat": flat_tokens,
                "graphs": graph_tokens,
                "padded_steps": padded_steps,
                "graph_steps": graph_steps,
                "syncs": syncs,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
