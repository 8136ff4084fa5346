"""Start-up warm-up against a served run, under the interpreter, in its own process.

    python tests/warmup_cases.py CONFIG_DIR [LOAD_FORMAT]     one JSON line (LOAD_FORMAT: dummy)

A Llama-shaped dummy model on the Triton kernels (as `auto` sets it up on CUDA): warm_up runs
with every launch recorded (kernels/triton/variants.py names the binary each one runs), then a
served run (a 600-token prompt in chunks next to short ones decoding: direct and split decode,
mixed steps) is recorded the same way. tests/kernels/test_warmup.py checks that each binary the
run launched was launched by the warm-up first, and that the warm-up wrote no K/V.
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

from inferline.kernels.triton import launch  # noqa: E402
from inferline.kernels.triton.variants import variant_of  # noqa: E402
from tests.engine_fixtures import greedy, make_engine, run_to_completion  # noqa: E402
from tests.triton_engine_cases import cuda_like_settings  # noqa: E402
from inferline.worker.engine.model_runner import ModelRunner  # noqa: E402
from inferline.worker.engine.request import EngineRequest  # noqa: E402
from inferline.worker.engine.warmup import warm_up  # noqa: E402


def recorded(fn, *args):
    seen = []
    launch.OBSERVERS.append(
        lambda kernel, plan, launch_args: seen.append(variant_of(kernel, plan, launch_args))
    )
    try:
        result = fn(*args)
    finally:
        launch.OBSERVERS.clear()
    return result, seen


def main() -> None:
    torch.set_num_threads(1)
    settings = cuda_like_settings(
        path=sys.argv[1],
        load_format=sys.argv[2] if len(sys.argv) > 2 else "dummy",
        dtype="float32",
        max_model_len=1024,
    )
    runner = ModelRunner(settings)
    assert runner.warmup is None, "no warm-up off CUDA unless asked"
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    report, warmed = recorded(warm_up, runner, settings.scheduler.max_num_seqs)
    untouched = all(
        torch.equal(k, k0) and torch.equal(v, v0)
        for (k, v), (k0, v0) in zip(runner.kv_cache, before)
    )
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(600)]
    arrivals = {
        0: [
            EngineRequest(request_id="long", prompt_token_ids=prompt, sampling=greedy(3)),
            EngineRequest(request_id="short", prompt_token_ids=prompt[:20], sampling=greedy(6)),
        ],
        2: [EngineRequest(request_id="late", prompt_token_ids=prompt[100:140], sampling=greedy(3))],
    }
    results, served = recorded(run_to_completion, make_engine(runner), arrivals)
    missing = sorted({repr(v) for v in served} - {repr(v) for v in warmed})
    splits = sorted(
        {dict(v.constexprs)["SPLITS_P2"] for v in served if v.kernel == "_decode_stage2_kernel"}
    )
    print(
        json.dumps(
            {
                "decode_shapes": [[s.num_seqs, s.width] for s in report.decode_shapes],
                "warm_seconds": report.seconds,
                "warmed": len(set(warmed)),
                "served": len(set(served)),
                "served_launches": len(served),
                "served_kernels": sorted({v.kernel for v in served}),
                "served_splits": splits,
                "direct_served": any(dict(v.constexprs).get("DIRECT") for v in served),
                "missing": missing,
                "kv_untouched": untouched,
                "tokens": {rid: r["tokens"] for rid, r in results.items()},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
