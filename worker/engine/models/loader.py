"""Weights in: a local HF directory (safetensors, FP8 checkpoints too), a GGUF file (converted once
and cached), or random (`load_format=dummy`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from inferline.config.paths import bundled_model_path, cache_dir
from inferline.kernels.cpu import gemm
from inferline.kernels.fp8 import FP8, dequantize
from inferline.worker.engine.models import gemma, mxfp4
from inferline.worker.engine.models.linear import Linear
from inferline.worker.engine.models.llama import LlamaForCausalLM
from inferline.worker.engine.models.moe import SparseMoeBlock, moe_destinations
from inferline.worker.engine.models.quantization import (
    Fp8Scheme,
    UnsupportedQuantization,
    fp8_scheme,
    scale_name,
    scale_rows,
)

log = structlog.get_logger(__name__)

SUPPORTED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
)
# Checkpoints that store q/k/v as one qkv_proj and gate/up as one gate_up_proj, in our order.
FUSED_CHECKPOINTS = ("phi3",)

# Shapes for speed work without weights (`load_format=dummy`, model path = a preset name).
DUMMY_PRESETS = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def resolve_model_dir(path: str | os.PathLike | None = None) -> Path:
    """An HF directory for `path`: the directory itself, or the cached conversion of a GGUF."""
    path = Path(path) if path else bundled_model_path()
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise FileNotFoundError(f"model path {path} is neither a directory nor a .gguf file")
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    target = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (target / "config.json").exists():
        convert_gguf(path, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    log.info("converting GGUF once", gguf=str(gguf), target=str(target))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    # save_pretrained refuses a model "quantized with gguf"; its tensors are plain fp32 by now.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shares memory with the embedding
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: a concurrent converter wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_config(model_dir: Path):
    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in SUPPORTED:
        raise ValueError(
            f"model type {config.model_type!r} is not supported (supported: {SUPPORTED})"
        )
    fp8_scheme(config)  # refuses an unsupported quantization before any weight is read
    return config


def load_tokenizer(model_dir: Path | None):
    return AutoTokenizer.from_pretrained(str(model_dir or resolve_model_dir(None)))


def load_model(
    path: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    weight_codes: bool = False,
    gguf_levels: bool = False,
):
    """Returns (model, config, tokenizer); `weight_codes`: decoder linear layers keep an FP8
    checkpoint's codes and scales for the W8A16 kernel instead of being dequantized to `dtype`;
    `gguf_levels`: and the exact uint8 levels of a GGUF's blocks."""
    if load_format == "dummy":
        return load_dummy(path, dtype, device, max_positions)
    model_dir = resolve_model_dir(path or None)
    config = load_config(model_dir)
    return (
        load_weights(model_dir, config, dtype, device, max_positions, weight_codes, gguf_levels),
        config,
        load_tokenizer(model_dir),
    )


def load_weights(
    model_dir: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    weight_codes: bool = False,
    gguf_levels: bool = False,
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`, each checkpoint tensor read straight into its place:
    memory peaks at the weights plus one chunk. FP8 weights are dequantized into `dtype`, or
    with `weight_codes` kept as codes in the decoder layers' linear layers; with `gguf_levels`
    fp32 weights that are exact uint8 levels per 32 inputs (a GGUF's) keep those."""
    index = safetensors_index(model_dir)
    scheme = fp8_scheme(config)
    coded: dict[str, tuple] = {}
    levels: dict[str, tuple[Linear, int, tuple]] = {}
    handles: dict[Path, object] = {}

    def handle(file: Path):
        if file not in handles:
            handles[file] = open(file, "rb", buffering=0)
        return handles[file]

    def prepare(model: LlamaForCausalLM) -> None:
        if weight_codes and scheme is not None and scheme.codes_fit():
            coded.update(keep_fp8_codes(model, index, scheme))
        if gguf_levels:
            levels.update(keep_levels(model, index, handle))

    try:
        model = empty_model(config, max_positions, dtype, device, prepare)
        fp8 = fill(model, model_dir, index, scheme, coded, levels, handle)
    finally:
        for f in handles.values():
            f.close()
    model.finish_load()
    if fp8 or levels:
        log.info(
            "coded weights",
            scheme=scheme.describe() if fp8 else None,
            fp8_tensors=len(fp8),
            fp8_kept_as_codes=len(coded),
            activation_scales=f"{scheme.activations}, unused" if fp8 else None,
            uint8_levels_kept=len(levels),
        )
    return model.eval()


def fill(model, model_dir, index, scheme, coded, levels, handle) -> list[str]:
    """Read every checkpoint tensor into its place in `model`; the FP8 names."""
    targets = destinations(model)
    packed = {n for n in targets if n not in index and mxfp4.in_checkpoint(n, index)}
    if packed and not mxfp4.is_mxfp4(model.config):
        raise UnsupportedQuantization(
            f"{model_dir}: {next(iter(packed))} is stored as mxfp4 blocks and scales but "
            "config.json's quantization_config does not say quant_method mxfp4"
        )
    missing = [name for name in targets if name not in index and name not in packed]
    if missing:
        raise KeyError(
            f"{model_dir} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}"
        )
    fp8 = [name for name in targets if name not in packed and index[name].dtype in FP8_DTYPES]
    check_fp8(fp8, index, scheme, model_dir)
    scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)

    def stored_at(name: str) -> StoredTensor:
        return index[mxfp4.stored_names(name)[0] if name in packed else name]

    with torch.no_grad():
        for name in sorted(
            targets, key=lambda n: (stored_at(n).file, stored_at(n).offset)
        ):  # sequential reads
            stored, dst = stored_at(name), targets[name]
            if name in packed:
                read_mxfp4(handle, index, name, dst)
            elif name in levels:  # read and coded while preparing
                linear, row, (codes, scale, offset) = levels[name]
                dst.copy_(codes)
                linear.weight_scale[row : row + len(codes)].copy_(scale)
                linear.weight_offset[row : row + len(codes)].copy_(offset)
            elif stored.dtype not in FP8_DTYPES:
                read_into(handle(stored.file), stored, dst, name, scratch)
            elif name in coded:
                rows = read_scale(handle, index, scheme, name)
                module, scale_name_, expert, row = coded[name]
                read_into(handle(stored.file), stored, dst, name, scratch)
                scale = getattr(module, scale_name_)
                scale = scale if expert is None else scale[expert]
                scale[row : row + len(rows)].copy_(rows)
            else:
                rows = read_scale(handle, index, scheme, name)
                read_dequantized(handle(stored.file), stored, dst, name, rows, scheme.group_k)
    return fp8


def empty_model(
    config, max_positions: int, dtype: torch.dtype, device: torch.device, prepare=None
) -> LlamaForCausalLM:
    """The model's parameters in `dtype` on `device`, unset, built on the meta device: no fp32
    copy of the weights ever exists. `prepare(model)` may change parameters while on meta."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to(dtype)
    model.keep_fp32()
    if prepare is not None:
        prepare(model)
    model = model.to_empty(device=device)
    model.fill_tables()
    return model


# ---- FP8 checkpoints -----------------------------------------------------------------------------


def decoder_linears(model, index: dict):
    """(layer, its weight, [(checkpoint name, first row)]) for each decoder linear layer of the
    meta model that holds plain weights and whose checkpoint tensors are all in `index`."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    by_base: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, dst in destinations(model, params).items():
        base = dst if dst._base is None else dst._base
        by_base.setdefault(id(base), []).append((name, dst))
    for module_name, module in model.named_modules():
        if not (isinstance(module, Linear) and module_name.startswith("layers.")):
            continue
        weight = params[module_name + ".weight"]
        sources = by_base.get(id(weight), [])
        if module.coded() or not sources or any(n not in index for n, _ in sources):
            continue
        width = weight.shape[1]
        rows = [
            (n, (dst.storage_offset() - weight.storage_offset()) // width) for n, dst in sources
        ]
        yield module, weight, rows


def keep_fp8_codes(model, index: dict, scheme: Fp8Scheme) -> dict[str, tuple]:
    """Turn each decoder linear layer whose checkpoint tensors are all FP8 into an FP8 one, and
    each MoE block whose experts' tensors all are into one with coded experts (on the meta
    model); checkpoint name -> (that layer or block, its scale buffer's name, the expert or None,
    its first row there)."""
    coded = {}
    for module, _, rows in list(decoder_linears(model, index)):
        if all(index[n].dtype == FP8 for n, _ in rows):
            coded.update({n: (module, "weight_scale", None, row) for n, row in rows})
            module.use_fp8(scheme.group_k)
    params = {name: p.detach() for name, p in model.named_parameters()}
    targets = destinations(model, params)
    for block_name, block in list(model.named_modules()):
        # gpt-oss's experts (biases, stacked checkpoint tensors) have no W8A16 variant
        if not isinstance(block, SparseMoeBlock) or block.coded() or block.spec.stacked:
            continue
        mine = {}
        for attr in ("w13", "w2"):
            weight = params[f"{block_name}.{attr}"]
            per_expert, width = weight[0].numel(), weight.shape[2]
            for name, dst in targets.items():
                if dst._base is not weight:  # a view of that parameter (destinations' slices)
                    continue
                first = dst.storage_offset() - weight.storage_offset()
                expert, within = divmod(first, per_expert)
                mine[name] = (block, attr + "_scale", expert, within // width)
        if mine and all(n in index and index[n].dtype == FP8 for n in mine):
            coded.update(mine)
            block.use_fp8(scheme.group_k)
    return coded


def keep_levels(model, index: dict, handle) -> dict[str, tuple[Linear, int, tuple]]:
    """Turn each decoder linear layer whose fp32 checkpoint tensors are all exact uint8 levels
    with a scale and offset per 32 inputs (a GGUF's Q8_0, Q4_1, ... weights, which the
    conversion dequantized) into a levels layer (on the meta model); checkpoint name -> (that
    layer, its first row, (levels, scales, offsets)), held on the host until the load. Found
    by the C GEMM's exact search: none without the C kernels."""
    if not gemm.available():
        return {}
    block, found = gemm.codes_block(), {}
    for module, weight, rows in list(decoder_linears(model, index)):
        if weight.shape[1] % block or any(index[n].dtype != torch.float32 for n, _ in rows):
            continue
        mine = {}
        for name, row in rows:
            w = torch.empty(index[name].shape, dtype=torch.float32)
            read_into(handle(index[name].file), index[name], w, name)
            codes = gemm.exact_codes(w, block)
            if codes is None:
                break
            mine[name] = (module, row, codes)
        else:
            found.update(mine)
            module.use_levels(block)
    return found


def check_fp8(names: list[str], index: dict, scheme: Fp8Scheme | None, model_dir) -> None:
    """Refuse FP8 tensors the config does not declare, and any but 2-D e4m3 weights."""
    if not names:
        return
    if scheme is None:
        raise UnsupportedQuantization(
            f"{model_dir}: {names[0]} is stored as {index[names[0]].dtype} but config.json has "
            "no quantization_config (compressed-tensors or fp8) to give its scales"
        )
    for name in names:
        stored = index[name]
        if stored.dtype != FP8 or len(stored.shape) != 2:
            raise UnsupportedQuantization(
                f"{name}: {scheme.describe()}: a {stored.dtype} tensor of shape "
                f"{list(stored.shape)} (2-D float8 e4m3 weights are supported)"
            )


def read_scale(handle, index: dict, scheme: Fp8Scheme, name: str) -> torch.Tensor:
    """The fp32 scales [rows, groups] of the FP8 weight `name`, checked against its shape."""
    sname = scale_name(scheme, name)
    stored = index.get(sname)
    if stored is None:
        raise UnsupportedQuantization(
            f"{name} is fp8 but the checkpoint lacks its scale {sname} ({scheme.describe()})"
        )
    scale = torch.empty(stored.shape, dtype=torch.float32)
    read_into(handle(stored.file), stored, scale, sname)
    return scale_rows(scheme, sname, scale, index[name].shape)


def read_dequantized(
    f, stored: StoredTensor, dst: torch.Tensor, name: str, rows: torch.Tensor, group_k: int
) -> None:
    """The FP8 weight `stored` times its scales `rows`, into `dst` (any float dtype and device),
    a chunk of rows at a time in fp32."""
    codes = torch.empty(stored.shape, dtype=stored.dtype)
    read_into(f, stored, codes, name)
    step = max(1, CHUNK_BYTES // (4 * stored.shape[1]))
    with torch.no_grad():
        for start in range(0, stored.shape[0], step):
            part = slice(start, start + step)
            dst[part].copy_(dequantize(codes[part], rows[part], group_k))


def read_mxfp4(handle, index: dict, name: str, dst: torch.Tensor) -> None:
    """The MXFP4 expert weight `name` (blocks [E, out, in / 32, 16], scales [E, out, in / 32])
    dequantized into `dst`, the checkpoint's plain layout [E, in, out], one expert at a time."""
    blocks, scales = (index[n] for n in mxfp4.stored_names(name))
    experts, rows, groups = scales.shape
    if blocks.shape != (experts, rows, groups, 16) or dst.shape != (experts, groups * 32, rows):
        raise UnsupportedQuantization(
            f"{name}: mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
            f"make the model's {list(dst.shape)}"
        )
    for e in range(experts):
        parts = []
        for stored in (blocks, scales):
            one = StoredTensor(
                stored.file,
                stored.offset + e * math.prod(stored.shape[1:]),
                stored.dtype,
                stored.shape[1:],
            )
            part = torch.empty(one.shape, dtype=torch.uint8)
            read_into(handle(one.file), one, part, name)
            parts.append(part)
        dst[e].copy_(mxfp4.dequantize(*parts).t())


def load_dummy(path: str, dtype, device, max_positions):
    """Random weights with the shapes of a preset, a config.json or an HF directory; that
    directory's tokenizer if it has one, else one synthesized in memory (no file needed)."""
    model_dir = None
    if path in DUMMY_PRESETS:
        config = LlamaConfig(**DUMMY_PRESETS[path])
    else:
        model_dir = resolve_model_dir(path or None)
        config = load_config(model_dir)
    model = empty_model(config, max_positions, dtype, device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            else:  # norms' weights 1, biases 0
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    has_tokenizer = model_dir is not None and any(
        (model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
    )
    tokenizer = load_tokenizer(model_dir) if has_tokenizer else synthetic_tokenizer(config)
    return model.eval(), config, tokenizer


def synthetic_tokenizer(config):
    """A tokenizer of the config's vocabulary size, built in memory for random weights: token i
    reads as the word `t<i>`, the config's bos and eos ids as `<s>` and `</s>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"t{i}" for i in range(config.vocab_size)]
    specials = {}
    for role, word in (("bos", "<s>"), ("eos", "</s>")):
        ids = getattr(config, f"{role}_token_id", None)
        first = ids[0] if isinstance(ids, (list, tuple)) and ids else ids
        if isinstance(first, int) and 0 <= first < len(words):
            if words[first].startswith("t"):  # bos == eos: one word for both
                words[first] = word
            specials[f"{role}_token"] = words[first]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0], **specials)


# ---- safetensors, read in place ------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CHUNK_BYTES = 8 << 20  # held beside the model when a read must cast or copy to a device


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    offset: int  # of its first byte in the file
    dtype: torch.dtype
    shape: tuple[int, ...]


def safetensors_index(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the directory's .safetensors files, from their headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    index: dict[str, StoredTensor] = {}
    for file in files:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            stored = StoredTensor(
                file, 8 + length + begin, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
            )
            assert end - begin == math.prod(stored.shape) * stored.dtype.itemsize, (
                file,
                name,
                info,
            )
            index[name] = stored
    return index


def read_into(
    f, stored: StoredTensor, dst: torch.Tensor, name: str = "", scratch: torch.Tensor | None = None
) -> None:
    """Copy `stored` into the contiguous `dst` (same shape, any dtype and device), directly or a
    chunk at a time through `scratch`."""
    if tuple(dst.shape) != stored.shape:
        raise ValueError(
            f"{name}: the checkpoint holds {stored.shape}, the model wants {tuple(dst.shape)}"
        )
    assert dst.is_contiguous(), name
    flat = dst.detach().view(-1)
    direct = dst.device.type == "cpu" and dst.dtype == stored.dtype
    if not direct and scratch is None:
        scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    step = flat.numel() if direct else max(1, CHUNK_BYTES // stored.dtype.itemsize)
    f.seek(stored.offset)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        buffer = (
            part if direct else scratch[: part.numel() * stored.dtype.itemsize].view(stored.dtype)
        )
        raw = buffer.view(torch.uint8).numpy()
        if f.readinto(raw) != raw.nbytes:
            raise EOFError(f"{stored.file}: {name} is cut short")
        if not direct:
            part.copy_(buffer)


def destinations(model: LlamaForCausalLM, params: dict | None = None) -> dict[str, torch.Tensor]:
    """HF checkpoint name -> the part of this model's parameters it fills (each parameter once);
    `params`: the detached parameters to slice (by name), made here if not given."""
    params = params or {name: p.detach() for name, p in model.named_parameters()}
    out = {
        "model.embed_tokens.weight": params["embed_tokens.weight"],
        "model.norm.weight": params["norm"],
    }
    if not model.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head.weight"]
    fused = model.config.model_type in FUSED_CHECKPOINTS
    for i, layer in enumerate(model.layers):
        out.update(layer_destinations(params, layer, f"model.layers.{i}.", f"layers.{i}.", fused))
    covered = sum(t.numel() for t in out.values())
    assert covered == sum(p.numel() for p in params.values()), (
        "a parameter no checkpoint tensor fills"
    )
    return out


def layer_destinations(
    params: dict, layer, src: str, dst: str, fused: bool = False
) -> dict[str, torch.Tensor]:
    attn, q, kv = layer.self_attn, layer.self_attn.q_size, layer.self_attn.kv_size
    out = {}
    parts = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    for part, (a, b) in ({"qkv": (0, q + 2 * kv)} if fused else parts).items():
        out[f"{src}self_attn.{part}_proj.weight"] = params[dst + "self_attn.qkv_proj.weight"][a:b]
        if attn.qkv_proj.bias is not None:
            out[f"{src}self_attn.{part}_proj.bias"] = params[dst + "self_attn.qkv_proj.bias"][a:b]
    if isinstance(layer.mlp, SparseMoeBlock):
        out.update(moe_destinations(params, layer.mlp, src, dst))
    elif fused:
        out[src + "mlp.gate_up_proj.weight"] = params[dst + "mlp.gate_up_proj.weight"]
        out[src + "mlp.down_proj.weight"] = params[dst + "mlp.down_proj.weight"]
    else:
        inter, gate_up = layer.mlp.intermediate_size, params[dst + "mlp.gate_up_proj.weight"]
        out[src + "mlp.gate_proj.weight"] = gate_up[:inter]
        out[src + "mlp.up_proj.weight"] = gate_up[inter:]
        out[src + "mlp.down_proj.weight"] = params[dst + "mlp.down_proj.weight"]
    out[src + "self_attn.o_proj.weight"] = params[dst + "self_attn.o_proj.weight"]
    if attn.o_proj.bias is not None:
        out[src + "self_attn.o_proj.bias"] = params[dst + "self_attn.o_proj.bias"]
    if attn.sinks is not None:
        out[src + "self_attn.sinks"] = params[dst + "self_attn.sinks"]
    norms = (
        gemma.LAYER_NORMS if isinstance(layer, gemma.GemmaDecoderLayer) else gemma.LAYER_NORMS[:2]
    )
    for norm in norms:
        out[f"{src}{norm}.weight"] = params[dst + norm]
    if attn.qk_norm:
        out[src + "self_attn.q_norm.weight"] = params[dst + "self_attn.q_norm"]
        out[src + "self_attn.k_norm.weight"] = params[dst + "self_attn.k_norm"]
    return out
