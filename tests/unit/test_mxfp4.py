"""MXFP4 checkpoints (gpt-oss's experts as fp4 e2m1 blocks with an e8m0 scale per 32 inputs):
dequantized at load as transformers' own function does, bit for bit, on random blocks; a tiny
gpt-oss saved with MXFP4 experts loads to the very weights of the same model saved plain."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferline.worker.engine.models import mxfp4
from inferline.worker.engine.models.loader import load_config, load_weights
from inferline.worker.engine.models.moe import SparseMoeBlock
from inferline.worker.engine.models.quantization import UnsupportedQuantization
from tests.unit.test_gpt_oss import hf_model


def random_packed(gen, *shape):
    """Random blocks [*shape, 16] (every code) and scales [*shape] (2^-6 .. 2^5)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 133, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_packed(torch.Generator().manual_seed(0), 3, 10, 4)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = mxfp4.dequantize(blocks, scales)  # [E, out, in]
    assert got.shape == (3, 10, 128)
    assert torch.equal(got.transpose(1, 2), want)
    # the low nibble first: codes 0x21 -> 0.5 (code 1) then 1.0 (code 2), scale 2^0
    one = mxfp4.dequantize(torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([127]).byte())
    assert one[:2].tolist() == [0.5, 1.0]


def save_mxfp4(hf, folder, gen) -> None:
    """`hf` saved with its experts as MXFP4 (random codes, their dequantized values put in `hf`
    first, so both checkpoints hold the same numbers)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        experts, inputs, outputs = state[name].shape
        blocks, scales = random_packed(gen, experts, outputs, inputs // 32)
        value = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        hf.get_parameter(name).data.copy_(value)
        del state[name]
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_loads_to_the_plain_checkpoints_weights(tmp_path):
    hf = hf_model(hidden_size=64, intermediate_size=64)  # in = 64 and 64: whole 32-blocks
    packed, plain = tmp_path / "mxfp4", tmp_path / "plain"
    save_mxfp4(hf, packed, torch.Generator().manual_seed(1))
    hf.save_pretrained(plain)  # the dequantized values, plain
    args = (torch.float32, torch.device("cpu"), 128)
    a = load_weights(packed, load_config(packed), *args)
    b = load_weights(plain, load_config(plain), *args)
    blocks = [m for m in a.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 3 and float(blocks[0].w13.detach().abs().max()) > 1.0
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_mxfp4_blocks_without_the_config_are_refused(tmp_path):
    hf = hf_model(hidden_size=64, intermediate_size=64)
    save_mxfp4(hf, tmp_path, torch.Generator().manual_seed(1))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="mxfp4"):
        load_weights(tmp_path, load_config(tmp_path), torch.float32, torch.device("cpu"), 128)
