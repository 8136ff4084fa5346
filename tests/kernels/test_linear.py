"""models/linear.py: oneDNN on packed weights equals F.linear for every batch size, row by row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inferline.worker.engine.models.linear import Linear, linear, onednn_available, pack_weight

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 31, 45, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    out, ref = linear(x, w, b, packed=pack_weight(w)), F.linear(x, w, b)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_rows_do_not_depend_on_the_batch():
    """Batch invariance: a prompt's logits are the same alone or inside any batch."""
    x, w = torch.randn(64, 576), torch.randn(1536, 576)
    packed = pack_weight(w)
    full = linear(x, w, packed=packed)
    for rows in (1, 2, 5, 8, 13, 29, 63):
        assert torch.equal(linear(x[:rows].contiguous(), w, packed=packed), full[:rows])


@needs_onednn
@pytest.mark.parametrize("in_features", [576, 1152, 1536, 4096])
def test_a_lone_long_row_gets_the_bits_it_gets_in_any_batch(in_features):
    """On an Intel Xeon, oneDNN computes one row of more than 1024 inputs with another kernel than
    any batch (different last bits: a sequence decoding alone then drifts from itself in a batch,
    and speculative drafts, computed as a chunk, would change greedy output)."""
    gen = torch.Generator().manual_seed(in_features)
    x, w = torch.randn(40, in_features, generator=gen), torch.randn(576, in_features, generator=gen)
    packed = pack_weight(w)
    full = linear(x, w, packed=packed)
    for rows in range(1, 40):
        assert torch.equal(linear(x[:rows].contiguous(), w, packed=packed), full[:rows]), rows
    assert torch.equal(
        linear(x[5:6], w, packed=packed), full[5:6]
    )  # a one-row view, as hidden[-1:]


@needs_onednn
def test_packed_linear_on_a_strided_view():
    x = torch.randn(10, 2, 48)[:, 0]  # a strided view of rows, as q/k/v splits are
    w = torch.randn(7, 48)
    torch.testing.assert_close(
        linear(x, w, packed=pack_weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-5
    )


def test_pack_weight_applies_only_to_cpu_fp32():
    assert pack_weight(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(4, 8, dtype=torch.float64)) is None
    assert (pack_weight(torch.randn(4, 8)) is not None) == onednn_available()


def test_linear_module_keeps_nn_linear_state_dict_and_results():
    ours, theirs = Linear(8, 4, bias=True), nn.Linear(8, 4, bias=True)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)  # unpacked: F.linear
    assert ours.pack() == onednn_available()
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # the packed copy is no parameter
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_a_failing_pack_falls_back_to_f_linear(monkeypatch):
    """A PyTorch whose oneDNN cannot pack (another CPU, another build) keeps F.linear, never
    crashes."""

    def refuse(weight, batch_size):
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    monkeypatch.setattr("inferline.worker.engine.models.linear.onednn_available", lambda: True)
    layer = Linear(8, 4)
    assert pack_weight(layer.weight) is None and not layer.pack() and layer.packed is None
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
