"""services/models/int8_linear.py: per-token int8, exact int32 sums."""

from __future__ import annotations

import torch
from torch import nn

from services.models.int8_linear import QMAX, Int8Linear, quantise_linears, quantise_rows


def _layer(seed: int, in_features: int = 48, out_features: int = 40, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def test_a_row_gets_the_same_bits_alone_as_beside_rows_a_thousand_times_larger():
    layer = Int8Linear.from_linear(_layer(0))
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 48, generator=generator) * torch.tensor([1e-3, 1.0, 1e3, 5.0, 0.2, 70.0])[:, None]
    together = layer(rows)
    for index in range(len(rows)):
        assert torch.equal(layer(rows[index : index + 1]), together[index : index + 1])
    assert torch.equal(layer(rows.view(2, 3, 48)).view(6, 40), together)  # any leading shape


def test_the_output_is_within_int8_rounding_of_the_float_layer():
    linear = _layer(2, 256, 64)
    layer = Int8Linear.from_linear(linear)
    rows = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = linear(rows)
    error = (layer(rows) - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.02


def test_quantised_rows_reach_the_full_range_and_a_zero_row_stays_zero():
    values = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0]])
    quantised, scale = quantise_rows(values)
    assert quantised.dtype == torch.int8 and quantised[0].tolist() == [32, -QMAX, 64]
    assert quantised[1].tolist() == [0, 0, 0] and torch.isfinite(scale).all()
    layer = Int8Linear.from_linear(_layer(4, 3, 5, bias=False))
    assert torch.equal(layer(torch.zeros(2, 3)), torch.zeros(2, 5))
    assert layer(torch.zeros(0, 3)).shape == (0, 5)


def test_every_linear_is_replaced_and_a_layer_registered_twice_stays_one():
    shared = _layer(5, 8, 8)
    model = nn.Sequential(_layer(6, 8, 8), nn.ReLU(), shared)
    model.add_module("again", shared)
    quantise_linears(model)
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model[0], Int8Linear) and model[2] is model.again
