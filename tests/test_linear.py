"""models/linear.py: the weight-first CPU product equals F.linear for every batch size."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.models.linear import WEIGHT_FIRST_MAX_ROWS, Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 31, 45, WEIGHT_FIRST_MAX_ROWS, WEIGHT_FIRST_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    out, ref = linear(x, w, b), F.linear(x, w, b)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_linear_on_a_view_and_outside_its_range():
    x = torch.randn(10, 2, 48)[:, 0]  # a strided view of rows
    w = torch.randn(7, 48)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(4, 5, 48)  # not 2-D: plain F.linear
    assert torch.equal(linear(x3, w), F.linear(x3, w))


def test_linear_module_keeps_nn_linear_state_dict():
    ours, theirs = Linear(8, 4, bias=True), nn.Linear(8, 4, bias=True)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
