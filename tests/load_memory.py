"""Peak host memory of loading a Llama-shaped checkpoint, for tests/unit/test_loader.py.

A random checkpoint (HF names, safetensors) is written to a folder; each load runs in a fresh
process (`python -m tests.load_memory FOLDER DTYPE`), which reads its resident set before (VmRSS)
and its peak after (VmHWM, reset through /proc/self/clear_refs where the kernel lets it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench  # noqa: F401 - takes the checkout off sys.path (bench/__init__.py says why)

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=16384,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
MAX_POSITIONS = 256  # the rotary tables (not weights) stay a rounding error


def write_checkpoint(folder: Path, shape: dict, dtype: str) -> None:
    """A random Llama checkpoint in HF's names."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(**shape).save_pretrained(folder)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    sizes = {
        "model.embed_tokens.weight": (shape["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (shape["vocab_size"], h),
    }
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sizes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            name: (torch.randn(size, generator=gen) * 0.02).to(getattr(torch, dtype))
            for name, size in sizes.items()
        },
        str(folder / "model.safetensors"),
    )


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(folder: Path, dtype: str) -> dict:
    """In a fresh process: load, and report the resident set's growth at its peak."""
    import gc

    import torch
    from transformers import LlamaConfig

    from inferline.worker.engine.models import loader

    torch.set_num_threads(1)
    config = loader.load_config(folder)
    # A tiny model first: the first model built on the meta device imports torch's meta kernels
    # (~120 MB, once per process), which are not the load's memory.
    tiny = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
    )
    loader.empty_model(tiny, 16, torch.bfloat16, torch.device("cpu"))
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass
    before = status_kb("VmRSS")
    model = loader.load_weights(
        folder, config, getattr(torch, dtype), torch.device("cpu"), MAX_POSITIONS
    )
    peak = status_kb("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "dtype": str(model.layers[0].mlp.down_proj.weight.dtype),
        "ratio": (peak - before) * 1024 / weights,
    }


def measure(folder: Path, dtype: str = "bfloat16") -> dict:
    """child() in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.load_memory", str(folder), dtype],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(child(Path(sys.argv[1]), sys.argv[2])))
