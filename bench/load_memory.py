"""Peak host memory of loading a Llama-shaped checkpoint, against the bytes of its weights.

    python -m bench.load_memory                          # bf16 and fp32 checkpoints, loaded in bf16
    python -m bench.load_memory --hidden 2048 --layers 8 # a larger shape

A random checkpoint (HF names, safetensors) is written to a temporary folder; each load runs in a
fresh process (`python -m bench.load_memory --child ...`), which reads its resident set before
(VmRSS) and its peak after (VmHWM, reset through /proc/self/clear_refs where the kernel lets it):
the growth over the weights' bytes in the serving dtype is the ratio. A tiny model is built
first (warm_up): the one-time imports of the code path are not the load's memory. Two loaders:

    now   worker/engine/models/loader.load_weights: built on the meta device, each tensor read
          from the file into its place (a chunk at a time where it casts)
    v0    the loader before issue 39: the model built in fp32 on the device, cast with .to(dtype),
          then every tensor read into memory and q/k/v, gate/up concatenated for load_state_dict

On a GPU the same ratio is torch.cuda.max_memory_allocated over the weights (bench/gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=16384, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=False)
MAX_POSITIONS = 256  # the rotary tables (not weights) stay a rounding error


def write_checkpoint(folder: Path, shape: dict, dtype: str) -> int:
    """A random Llama checkpoint in HF's names; returns its number of parameters."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**shape)
    config.save_pretrained(folder)
    h, inter, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], \
        shape["num_key_value_heads"]
    d = h // heads
    sizes = {"model.embed_tokens.weight": (shape["vocab_size"], h), "model.norm.weight": (h,),
             "lm_head.weight": (shape["vocab_size"], h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sizes.update({p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                      p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                      p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                      p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                      p + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(size, generator=gen) * 0.02).to(getattr(torch, dtype)) for name, size in sizes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return sum(t.numel() for t in tensors.values())


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(folder: Path, dtype: str, loader: str) -> dict:
    """In a fresh process: load, and report the resident set's growth at its peak."""
    import gc

    import torch

    from inferline.worker.engine.models import loader as loaders

    torch.set_num_threads(1)
    config = loaders.load_config(folder)
    warm_up(loader)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        reset = True
    except OSError:
        reset = False
    before = status_kb("VmRSS")
    load = load_now if loader == "now" else load_v0
    model = load(folder, config, getattr(torch, dtype))
    peak = status_kb("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"loader": loader, "weights_bytes": weights, "peak_growth_bytes": (peak - before) * 1024,
            "hwm_reset": reset, "dtype": str(model.layers[0].mlp.down_proj.weight.dtype)}


def warm_up(loader: str) -> None:
    """Build a tiny model first: the first model built on the meta device imports torch's meta
    kernels (about 120 MB of resident code and tables, once per process, whatever the model)."""
    import torch
    from transformers import LlamaConfig

    from inferline.worker.engine.models.llama import LlamaForCausalLM
    from inferline.worker.engine.models.loader import empty_model

    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=128)
    if loader == "now":
        empty_model(tiny, 16, torch.bfloat16, torch.device("cpu"))
    else:
        LlamaForCausalLM(tiny, 16).to(torch.bfloat16)


def load_now(folder, config, dtype):
    import torch

    from inferline.worker.engine.models.loader import load_weights

    return load_weights(folder, config, dtype, torch.device("cpu"), MAX_POSITIONS)


def load_v0(folder, config, dtype):
    """The loader before issue 39, kept here as the baseline."""
    import torch
    from safetensors.torch import load_file

    from inferline.worker.engine.models.llama import LlamaForCausalLM

    with torch.device("cpu"):
        model = LlamaForCausalLM(config, MAX_POSITIONS).to(dtype)
    hf = load_file(str(folder / "model.safetensors"))
    state = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"],
             "lm_head.weight": hf["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        s, d = f"model.layers.{i}.", f"layers.{i}."
        state[d + "self_attn.qkv_proj.weight"] = torch.cat([hf[f"{s}self_attn.{x}_proj.weight"] for x in "qkv"])
        state[d + "self_attn.o_proj.weight"] = hf[s + "self_attn.o_proj.weight"]
        state[d + "mlp.gate_up_proj.weight"] = torch.cat([hf[s + "mlp.gate_proj.weight"], hf[s + "mlp.up_proj.weight"]])
        state[d + "mlp.down_proj.weight"] = hf[s + "mlp.down_proj.weight"]
        state[d + "input_layernorm"] = hf[s + "input_layernorm.weight"]
        state[d + "post_attention_layernorm"] = hf[s + "post_attention_layernorm.weight"]
    model.load_state_dict(state, strict=True)
    return model


def run_child(folder: Path, dtype: str, loader: str) -> dict:
    cmd = [sys.executable, "-m", "bench.load_memory", "--child", str(folder), "--dtype", dtype, "--loader", loader]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(shape: dict = SHAPE, checkpoints=("bfloat16", "float32"), dtype: str = "bfloat16",
            loaders=("now", "v0")) -> list[dict]:
    rows = []
    for ckpt in checkpoints:
        with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
            write_checkpoint(Path(tmp), shape, ckpt)
            for loader in loaders:
                row = run_child(Path(tmp), dtype, loader)
                row.update(checkpoint=ckpt, ratio=row["peak_growth_bytes"] / row["weights_bytes"])
                rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.load_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child", type=Path)
    p.add_argument("--loader", default="now")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dtype, args.loader)))
        return []
    shape = dict(SHAPE, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                 num_hidden_layers=args.layers)
    rows = measure(shape, dtype=args.dtype)
    for r in rows:
        print(f"{r['checkpoint']:>8} checkpoint -> {r['dtype']:<14} {r['loader']:>3}: weights "
              f"{r['weights_bytes'] / 2**20:7.1f} MiB, peak growth {r['peak_growth_bytes'] / 2**20:7.1f} MiB, "
              f"{r['ratio']:.2f}x{'' if r['hwm_reset'] else ' (VmHWM not reset)'}")
    return rows


if __name__ == "__main__":
    main()
