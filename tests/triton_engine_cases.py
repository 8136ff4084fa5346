"""The whole engine on the Triton kernels under the interpreter, in its own process.

    python tests/triton_engine_cases.py smollm2 < cases.json    greedy tokens of each request
    python tests/triton_engine_cases.py dummy-bf16 CONFIG_DIR   logits: Triton vs the torch path

TRITON_INTERPRET must be set before triton is first imported (and an out-of-range load kills the
process), so tests/kernels/test_triton_engine.py runs this script in a subprocess and reads JSON
lines. The runner is set up as `auto` sets it up on CUDA: attention (prefill, decode) and the
fused elementwise ops (RMSNorm with the residual add, SiLU-and-mul, rotary with the K/V store) on
Triton, linear layers on PyTorch.
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

from inferline.config.settings import Settings  # noqa: E402
from tests.engine_fixtures import BlockWatch, greedy, make_engine, run_to_completion  # noqa: E402
from inferline.worker.engine.model_runner import ModelRunner  # noqa: E402
from inferline.worker.engine.request import EngineRequest  # noqa: E402


def cuda_like_settings(attention: str = "triton", **model) -> Settings:
    settings = Settings()
    settings.model.attention_backend = attention
    settings.model.cpu_linear = "torch"
    settings.model.cpu_fused_ops = "auto"  # Triton, with the Triton attention
    for key, value in model.items():
        setattr(settings.model, key, value)
    settings.cache.num_blocks = 64
    return settings


def run_smollm2(cases: dict) -> None:
    """cases: {"model": HF directory (optional), "block_size": int (optional), "runs": [{"name",
    "scheduler": {...}, "arrivals": {step: [[id, prompt_ids, max_tokens]]}, "logits": bool
    (optional)}]}; each run is one engine over the same runner; prints each request's tokens and
    the run's stats (with "watch": true, BlockWatch's too; with "logits", every sampled logits
    row in step order)."""
    settings = cuda_like_settings(path=cases.get("model", ""))
    settings.cache.block_size = cases.get("block_size", settings.cache.block_size)
    runner = ModelRunner(settings)
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in runner.model.parameters())
    print(json.dumps({"backends": runner.backends.__dict__, "fp8_weights": fp8}), flush=True)
    for run in cases["runs"]:
        rows = capture_logits(runner) if run.get("logits") else None
        engine = make_engine(runner, **run.get("scheduler", {}))
        arrivals = {
            int(step): [
                EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=greedy(n))
                for rid, ids, n in reqs
            ]
            for step, reqs in run["arrivals"].items()
        }
        watch = BlockWatch()
        results = run_to_completion(engine, arrivals, on_step=watch if run.get("watch") else None)
        stats = engine.stats()
        extra = {}
        if rows is not None:  # every sampled row, in step order
            del runner.sampler.sample_on_device
            extra["logits"] = [row.tolist() for row in rows]
        print(
            json.dumps(
                {
                    "run": run["name"],
                    "tokens": {rid: r["tokens"] for rid, r in results.items()},
                    "preemptions": stats.num_preemptions,
                    "prefix_cache_hits": stats.prefix_cache_hits,
                    "max_decode_blocks": watch.max_decode_blocks,
                    "num_reused": watch.num_reused,
                    **extra,
                }
            ),
            flush=True,
        )


def capture_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """The logits rows the sampler gets from now on, appended to the returned list (until
    `del runner.sampler.sample_on_device`)."""
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # an instance attribute over the method
    return rows


def logits_rows(
    runner: ModelRunner, prompt: list[int], max_tokens: int
) -> tuple[list[torch.Tensor], list[int]]:
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # an instance attribute over the method
    try:
        result = run_to_completion(
            make_engine(runner),
            {
                0: [
                    EngineRequest(
                        request_id="r", prompt_token_ids=prompt, sampling=greedy(max_tokens)
                    )
                ]
            },
        )
    finally:
        del runner.sampler.sample_on_device
    return rows, result["r"]["tokens"]


def run_dummy_bf16(config_dir: str) -> None:
    """Random bf16 weights (load_format=dummy, the same seed for both runners); the logits of every
    step on the Triton kernels against the PyTorch path's, while the two pick the same tokens."""
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(37)]  # crosses two 16-token blocks
    out = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(
            cuda_like_settings(backend, path=config_dir, load_format="dummy", dtype="bfloat16")
        )
        out[backend] = logits_rows(runner, prompt, 12)
        del runner
    (ref, ref_tokens), (tri, tri_tokens) = out["torch"], out["triton"]
    same = next(
        (i for i, (a, b) in enumerate(zip(ref_tokens, tri_tokens)) if a != b), len(ref_tokens)
    )
    errors = [float((a - b).norm() / a.norm()) for a, b in zip(ref[: same + 1], tri[: same + 1])]
    print(
        json.dumps(
            {
                "steps_compared": len(errors),
                "same_tokens": same,
                "rel_errors": errors,
                "tokens": {"torch": ref_tokens, "triton": tri_tokens},
            }
        ),
        flush=True,
    )


def main() -> None:
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    if sys.argv[1] == "smollm2":
        run_smollm2(json.load(sys.stdin))
    elif sys.argv[1] == "dummy-bf16":
        run_dummy_bf16(sys.argv[2])
    else:
        raise SystemExit(f"unknown case {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
