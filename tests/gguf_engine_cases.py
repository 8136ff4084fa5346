"""A GGUF file through the engine on the Triton kernels under the interpreter, in its own process.

    python tests/gguf_engine_cases.py GGUF_FILE < cases.json

Two runners over the same file, set up as `auto` sets them up on CUDA (attention, fused ops and
the W8A16 linear layers on Triton): "codes", where the decoder's linear layers keep the GGUF's
exact uint8 levels with a scale and an offset per 32 inputs (INFERLINE_MODEL__GPU_WEIGHT_CODES
auto, as on CUDA: ModelRunner keeps them on CUDA only, for the interpreter's sake), and "off",
the same file dequantized (gpu_weight_codes=off). For each it prints one JSON line: the dtype of
every linear layer's and the embeddings' weights, and per request the greedy tokens and every
sampled row's logits. cases: {"arrivals": [[id, prompt_ids, max_tokens]], "scheduler": {...},
"variants": ["codes", "off"] (the default: both)}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402

from inferline.config.settings import Settings  # noqa: E402
from inferline.worker.engine.model_runner import ModelRunner  # noqa: E402
from inferline.worker.engine.models.linear import Linear  # noqa: E402
from inferline.worker.engine.request import EngineRequest  # noqa: E402
from tests.engine_fixtures import greedy, make_engine, run_to_completion  # noqa: E402
from tests.triton_engine_cases import capture_logits, cuda_like_settings  # noqa: E402


class CudaLikeRunner(ModelRunner):
    """ModelRunner deciding on a GGUF's levels as it does on CUDA."""

    def _gguf_levels(self, settings: Settings) -> bool:
        return settings.model.gpu_weight_codes == "auto"


def run(path: str, codes: bool, cases: dict) -> dict:
    settings = cuda_like_settings(path=path, gpu_weight_codes="auto" if codes else "off")
    runner = (CudaLikeRunner if codes else ModelRunner)(settings)
    weights = {
        name: str(m.weight.dtype).removeprefix("torch.")
        for name, m in runner.model.named_modules()
        if isinstance(m, (Linear, torch.nn.Embedding))
    }
    rows = capture_logits(runner)
    engine = make_engine(runner, **cases.get("scheduler", {}))
    arrivals = {
        0: [
            EngineRequest(request_id=rid, prompt_token_ids=ids,
                          sampling=greedy(n, ignore_eos=True))
            for rid, ids, n in cases["arrivals"]
        ]
    }  # fmt: skip
    results = run_to_completion(engine, arrivals)
    del runner.sampler.sample_on_device
    return {
        "variant": "codes" if codes else "off",
        "backends": runner.backends.__dict__,
        "weights": weights,
        "tokens": {rid: r["tokens"] for rid, r in results.items()},
        "logits": [row.tolist() for row in rows],  # sampled rows in step order
    }


def main() -> None:
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    path, cases = sys.argv[1], json.load(sys.stdin)
    for variant in cases.get("variants", ["codes", "off"]):
        print(json.dumps(run(path, variant == "codes", cases)), flush=True)


if __name__ == "__main__":
    main()
