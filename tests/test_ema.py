"""Tests for utils/train/ema.py: decay ramp, averaging, integer buffers, DDP unwrapping and state round trip."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from utils.train.ema import ModelEMA


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


class _Wrapper(nn.Module):
    """Stand-in for DistributedDataParallel: holds the model as `.module`, so its state keys gain 'module.'."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_ema_is_a_frozen_eval_copy() -> None:
    model = _model()
    ema = ModelEMA(model)
    assert not ema.ema.training
    assert not any(p.requires_grad for p in ema.ema.parameters())
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(ema.ema[0].weight, model[0].weight)  # a copy, not a view


def test_decay_ramp() -> None:
    ema = ModelEMA(_model(), decay=0.9999, tau=2000)
    assert ema.decay_at(1) == pytest.approx(0.9999 * (1 - math.exp(-1 / 2000)))
    assert ema.decay_at(2000) == pytest.approx(0.9999 * (1 - math.exp(-1)))
    assert ema.decay_at(100_000) == pytest.approx(0.9999, abs=1e-9)
    assert ema.decay_at(1) < ema.decay_at(10) < ema.decay_at(1000)


def test_update_moves_towards_model_and_copies_integer_buffers() -> None:
    model = _model()
    ema = ModelEMA(model, decay=0.9, tau=1.0)
    start = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    model.train()
    for _ in range(3):
        model(torch.randn(2, 3, 8, 8))  # moves BN running stats and counts num_batches_tracked
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    assert ema.updates == 1
    decay = 0.9 * (1 - math.exp(-1.0))
    model_state = model.state_dict()
    for key, value in ema.ema.state_dict().items():
        if value.dtype.is_floating_point:
            expected = decay * start[key] + (1 - decay) * model_state[key]
            torch.testing.assert_close(value, expected)
            gap_before = (start[key] - model_state[key]).abs().sum()
            assert (value - model_state[key]).abs().sum() < gap_before or gap_before == 0, key
        else:
            assert torch.equal(value, model_state[key]), key
    assert int(ema.ema[1].num_batches_tracked) == 3


def test_update_unwraps_ddp_style_wrapper() -> None:
    model = _model()
    ema = ModelEMA(_Wrapper(model), decay=0.5, tau=1e-9)  # decay is 0.5 from the first update
    with torch.no_grad():
        model[4].bias.fill_(2.0)
    before = ema.ema[4].bias.clone()
    ema.update(_Wrapper(model))
    torch.testing.assert_close(ema.ema[4].bias, 0.5 * before + 0.5 * 2.0)
    assert not hasattr(ema.ema, "module")


def test_state_round_trip_continues_identically() -> None:
    model = _model()
    ema = ModelEMA(model, decay=0.99, tau=5.0)
    for step in range(3):
        with torch.no_grad():
            model[0].weight.add_(0.1 * (step + 1))
        ema.update(model)
    state = ema.state_dict()
    assert set(state) == set(model.state_dict())  # a model state dict: loads into a plain model
    assert ema.updates == 3
    restored = ModelEMA(_model(), decay=0.99, tau=5.0)
    restored.load_state_dict(state, ema.updates)
    assert restored.updates == 3
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    restored.update(model)
    for key, value in ema.ema.state_dict().items():
        assert torch.equal(restored.ema.state_dict()[key], value), key
