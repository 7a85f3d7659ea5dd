"""Tests for utils/train/optim.py: parameter groups, optimizers, LR schedule, warmup and batch scaling."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

from utils.train.optim import (
    GROUP_NAMES,
    Warmup,
    accumulate_steps,
    build_optimizer,
    build_scheduler,
    lr_lambda,
    param_groups,
    scaled_weight_decay,
    warmup_iterations,
)


def _model() -> nn.Sequential:
    """Conv without bias, BN, conv with bias, GroupNorm, linear, LayerNorm, and a frozen conv."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 1),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 1),  # frozen below
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
        nn.LayerNorm(3),
    )
    model[4].requires_grad_(False)
    return model


def test_param_groups_cover_each_trainable_parameter_once() -> None:
    model = _model()
    groups = param_groups(model)
    grouped = [id(p) for group in groups for p in group]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(set(grouped))  # nothing twice
    assert sorted(grouped) == sorted(trainable)  # everything trainable, nothing frozen
    assert {id(p) for p in groups.norm_weights} == {id(model[i].weight) for i in (1, 3, 8)}
    assert {id(p) for p in groups.decayed_weights} == {id(model[i].weight) for i in (0, 2, 7)}
    assert {id(p) for p in groups.biases} == {id(model[i].bias) for i in (1, 2, 3, 7, 8)}


def test_param_groups_count_shared_parameter_once() -> None:
    linear = nn.Linear(2, 2)
    model = nn.Sequential(linear, nn.ReLU(), linear)
    groups = param_groups(model)
    assert [len(group) for group in groups] == [0, 1, 1]


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_build_optimizer_groups_and_momentum(name: str) -> None:
    model = _model()
    optimizer = build_optimizer(model, name, lr=0.01, momentum=0.937, weight_decay=5e-4)
    assert [g["name"] for g in optimizer.param_groups] == list(GROUP_NAMES)
    # AdamW's own default decay is 0.01: norm weights and biases must still get exactly 0.
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 5e-4, 0.0]
    assert all(g["lr"] == 0.01 and g["initial_lr"] == 0.01 for g in optimizer.param_groups)
    assert [len(g["params"]) for g in optimizer.param_groups] == [3, 3, 5]
    for group in optimizer.param_groups:
        if name == "SGD":
            assert isinstance(optimizer, torch.optim.SGD)
            assert group["momentum"] == 0.937 and group["nesterov"]
        else:
            assert group["betas"] == (0.937, 0.999)
    assert type(optimizer).__name__ == name


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_fused_optimizer_steps_like_the_per_tensor_loop(name: str) -> None:
    fused_model, loop_model = _model(), _model()
    fused = build_optimizer(fused_model, name, lr=0.01, momentum=0.9, weight_decay=5e-4)
    assert all(group["fused"] for group in fused.param_groups)  # CPU float parameters: fused kernels
    loop = build_optimizer(loop_model, name, lr=0.01, momentum=0.9, weight_decay=5e-4)
    for group in loop.param_groups:
        group["fused"] = None  # PyTorch's default on CPU: one update per tensor
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=generator) for p in fused_model.parameters() if p.requires_grad]
        for model, optimizer in ((fused_model, fused), (loop_model, loop)):
            for param, grad in zip((p for p in model.parameters() if p.requires_grad), grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    for fused_param, loop_param in zip(fused_model.parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(fused_param, loop_param, rtol=1e-6, atol=1e-7)
    assert not torch.equal(fused_model[0].weight, _model()[0].weight)  # the steps did move the weights


def test_weight_decay_reaches_only_decayed_weights() -> None:
    model = _model()
    optimizer = build_optimizer(model, "SGD", lr=0.1, momentum=0.9, weight_decay=0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        decayed = name.endswith("weight") and name.split(".")[0] in ("0", "2", "7")
        assert changed == decayed, name


def test_build_optimizer_logs_group_sizes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="utils.train.optim"):
        build_optimizer(_model(), "SGD", lr=0.01, momentum=0.9, weight_decay=1e-3)
    lines = [r.getMessage() for r in caplog.records if r.name == "utils.train.optim"]
    assert len(lines) == 1
    assert "3 norm weights" in lines[0] and "3 weights (decay 0.001)" in lines[0] and "5 biases" in lines[0]


def test_unknown_optimizer_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--optimizer RMSprop"):
        build_optimizer(_model(), "RMSprop", lr=0.01, momentum=0.9, weight_decay=0.0)


@pytest.mark.parametrize(
    ("cosine", "expected"),
    [
        (False, {0: 1.0, 25: 0.7525, 50: 0.505, 100: 0.01}),
        (True, {0: 1.0, 25: 1 - 0.99 * (1 - math.cos(math.pi / 4)) / 2, 50: 0.505, 100: 0.01}),
    ],
)
def test_lr_lambda_values(cosine: bool, expected: dict[int, float]) -> None:
    fn = lr_lambda(epochs=100, lrf=0.01, cosine=cosine)
    for epoch, value in expected.items():
        assert fn(epoch) == pytest.approx(value, abs=1e-12), epoch


def test_scheduler_resumes_where_it_stopped() -> None:
    fn = lr_lambda(epochs=10, lrf=0.1, cosine=True)
    uninterrupted = build_optimizer(_model(), "SGD", lr=0.02, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(uninterrupted, fn)
    assert uninterrupted.param_groups[0]["lr"] == pytest.approx(0.02)
    for _ in range(4):
        uninterrupted.step()  # no gradients: changes nothing, but keeps LambdaLR's call-order check quiet
        scheduler.step()
    resumed = build_optimizer(_model(), "SGD", lr=0.02, momentum=0.9, weight_decay=0.0)
    resumed_scheduler = build_scheduler(resumed, fn, start_epoch=4)
    assert resumed_scheduler.last_epoch == scheduler.last_epoch == 4
    for _ in range(2):
        lrs = [g["lr"] for g in uninterrupted.param_groups]
        assert [g["lr"] for g in resumed.param_groups] == pytest.approx(lrs)
        assert lrs[0] == pytest.approx(0.02 * fn(scheduler.last_epoch))
        uninterrupted.step()
        resumed.step()
        scheduler.step()
        resumed_scheduler.step()


def test_warmup_iterations() -> None:
    assert warmup_iterations(3.0, 50) == 150
    assert warmup_iterations(3.0, 10) == 100  # the minimum of 100
    assert warmup_iterations(3.0, 10, min_iters=5) == 30
    assert warmup_iterations(0.5, 3, min_iters=1) == 2  # round(1.5)
    assert warmup_iterations(0.0, 50) == 0  # disabled


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_warmup_interpolates_lr_and_momentum(name: str) -> None:
    optimizer = build_optimizer(_model(), name, lr=0.01, momentum=0.937, weight_decay=5e-4)
    fn = lr_lambda(epochs=10, lrf=0.1, cosine=False)

    def momentum_of(group: dict[str, Any]) -> float:
        return group["betas"][0] if name == "Adam" else group["momentum"]

    warmup = Warmup(iterations=100, bias_lr=0.1, start_momentum=0.8, momentum=0.937)
    target = 0.01 * fn(1)  # the schedule's factor of epoch 1, so the ramp ends on it, not on initial_lr
    for iteration, fraction in ((0, 0.0), (50, 0.5), (100, 1.0)):
        assert warmup.apply(optimizer, iteration, lr_factor=fn(1))
        norm, decay, bias = optimizer.param_groups
        assert norm["lr"] == pytest.approx(target * fraction)
        assert decay["lr"] == pytest.approx(target * fraction)
        assert bias["lr"] == pytest.approx(0.1 + (target - 0.1) * fraction)
        assert all(momentum_of(g) == pytest.approx(0.8 + (0.937 - 0.8) * fraction) for g in optimizer.param_groups)
        if name == "Adam":
            assert all(g["betas"][1] == 0.999 for g in optimizer.param_groups)
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    assert not warmup.apply(optimizer, 101, lr_factor=fn(1))  # after warmup nothing is touched
    assert all(g["lr"] == 0.5 for g in optimizer.param_groups)


def test_warmup_disabled_touches_nothing() -> None:
    optimizer = build_optimizer(_model(), "SGD", lr=0.01, momentum=0.9, weight_decay=0.0)
    assert not Warmup(0, bias_lr=0.1, start_momentum=0.8, momentum=0.9).apply(optimizer, 0, 1.0)
    assert [g["lr"] for g in optimizer.param_groups] == [0.01] * 3
    assert [g["momentum"] for g in optimizer.param_groups] == [0.9] * 3


def test_accumulate_steps_and_scaled_weight_decay() -> None:
    assert [accumulate_steps(b) for b in (1, 16, 24, 32, 64, 128)] == [64, 4, 3, 2, 1, 1]
    assert accumulate_steps(16, nominal_batch=32) == 2
    assert scaled_weight_decay(5e-4, 16, 4) == pytest.approx(5e-4)
    assert scaled_weight_decay(5e-4, 128, 1) == pytest.approx(1e-3)
    assert scaled_weight_decay(5e-4, 24, 3) == pytest.approx(5.625e-4)
