"""The detection losses with --static-loss-shapes: no operation that makes a GPU wait for a host read.

On a CUDA device tests/test_cuda.py runs the loss under `torch.cuda.set_sync_debug_mode("error")`.
Here, on any machine, the loss runs under a dispatch mode that lists every operator which, on a GPU,
either returns a size or value the host must read (nonzero, boolean-mask indexing, `.item()` and the
`bool()` / `int()` of a tensor, bincount, unique...) or copies host data to the device (a tensor made
from a Python list, `aten.lift_fresh`). The sparse default is checked too, so the check can fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from segment.task import SEGMENT
from segment.training import SEGMENT_TRAINING
from tests.conftest import compile_without_codegen
from utils.families import build_model
from utils.hyp import load_hyp
from utils.tasks import DETECT
from utils.train.config import TrainConfig, train_config_from_argv
from utils.train.ema import ModelEMA
from utils.train.optim import build_optimizer
from utils.train.records import DETECT_TRAINING, family_training
from utils.train.state import compiled_loss
from utils.train.step import _optimizer_step

aten = torch.ops.aten
# Operators whose result's size or value the host reads from the device, or that copy host data to it.
HOST_READS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.lift_fresh.default,  # torch.tensor(data) / new_tensor(data): a host-to-device copy
}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Records each operator that would wait for the device on a GPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS:
            self.found.append(str(func))
        elif func in BOOL_INDEXED and _has_bool_index(args[1]):
            self.found.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextmanager
def recorded() -> Iterator[HostReads]:
    with HostReads() as mode:
        yield mode


def _loss_and_step(cfg: str, static: bool) -> tuple[torch.nn.Module, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(DETECT.spec_from_cfg(cfg, 3)).train()
    hyp = load_hyp(family_training(model).recipe_files.short)
    loss_fn = DETECT_TRAINING.build_loss(model, TrainConfig(hyp=hyp, imgsz=64, static_loss_shapes=static))
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.3, 0.3], [0, 1, 0.2, 0.3, 0.2, 0.1], [1, 2, 0.6, 0.4, 0.4, 0.5]])
    return model, loss_fn, images, targets


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n", "yolo26n"])
def test_with_static_shapes_the_loss_and_its_backward_never_read_the_device(cfg: str) -> None:
    model, loss_fn, images, targets = _loss_and_step(cfg, static=True)
    preds = model(images)
    with recorded() as reads:
        loss, _ = loss_fn(preds, targets)
        loss.backward()
    assert reads.found == []
    assert torch.isfinite(loss).all()


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n"])
def test_the_default_sparse_search_is_seen_reading_the_device(cfg: str) -> None:
    model, loss_fn, images, targets = _loss_and_step(cfg, static=False)
    preds = model(images)
    with recorded() as reads:
        loss_fn(preds, targets)
    assert "aten.nonzero.default" in reads.found  # what --static-loss-shapes removes


def test_the_flag_reaches_both_families_losses() -> None:
    cfg = train_config_from_argv(["--static-loss-shapes"])
    assert cfg.static_loss_shapes and not train_config_from_argv([]).static_loss_shapes
    _, anchor_based, _, _ = _loss_and_step("yolov5n", static=True)
    _, anchor_free, _, _ = _loss_and_step("yolov8n", static=True)
    assert anchor_based.static_shapes and anchor_free.align.static_shapes


@pytest.mark.parametrize("cfg", ["yolov5n-seg", "yolov8n-seg"])
def test_segmentation_losses_are_the_same_with_static_shapes(cfg: str) -> None:
    """The detection part runs in fixed shapes; the mask term still lists the matches (and reads the host)."""
    _, _, images, targets = _loss_and_step("yolov5n", static=False)
    masks = (torch.rand(len(targets), 64, 64, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    results = []
    for static in (False, True):
        torch.manual_seed(0)
        model = build_model(SEGMENT.spec_from_cfg(cfg, 3)).train()
        hyp = load_hyp(family_training(model).recipe_files.short)
        loss_fn = SEGMENT_TRAINING.build_loss(model, TrainConfig(hyp=hyp, imgsz=64, static_loss_shapes=static))
        loss, items = loss_fn(model(images), targets, masks=masks)
        loss.backward()
        results.append((items, [p.grad for p in model.parameters() if p.requires_grad]))
    (items, grads), (static_items, static_grads) = results
    torch.testing.assert_close(static_items, items)
    # Float sums in another order, amplified through the backbone: compared relative to each gradient's size.
    for grad, static_grad in zip(grads, static_grads, strict=True):
        assert (static_grad - grad).norm() <= 1e-4 * grad.norm()


@pytest.mark.slow  # torch.compile: out of the fast loop
def test_compiled_static_loss_compiles_twice_over_label_counts_and_epochs() -> None:
    """--compile with --static-loss-shapes: the label count becomes dynamic, the end-to-end weight an input."""
    model, loss_fn, images, _ = _loss_and_step("yolo26n", static=True)
    cfg = TrainConfig(compile_mode="default", static_loss_shapes=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: graphs of earlier tests in this process
    with compile_without_codegen() as modes:
        compiled = compiled_loss(loss_fn, cfg)
    generator = torch.Generator().manual_seed(3)
    for epoch in range(3):
        loss_fn.start_epoch(epoch, 3)
        for count in (2, 5, 9):
            targets = torch.cat(
                (
                    torch.randint(0, 2, (count, 2), generator=generator).float(),
                    torch.rand(count, 4, generator=generator) * 0.4 + 0.1,
                ),
                1,
            )
            preds = model(images)
            _, items = compiled(preds, targets)
            torch.testing.assert_close(items, loss_fn(preds, targets)[1], rtol=1e-4, atol=1e-6)
    assert modes == ["default"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_losses_that_are_not_one_graph_stay_eager() -> None:
    cfg = TrainConfig(compile_mode="default", static_loss_shapes=True)
    _, sparse, _, _ = _loss_and_step("yolov8n", static=False)
    assert compiled_loss(sparse, cfg) is sparse
    model = build_model(SEGMENT.spec_from_cfg("yolov8n-seg", 3))
    segmentation = SEGMENT_TRAINING.build_loss(
        model, TrainConfig(hyp=load_hyp(family_training(model).recipe_files.short), imgsz=64, static_loss_shapes=True)
    )
    assert compiled_loss(segmentation, cfg) is segmentation


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n", "yolo26n"])
def test_with_static_shapes_a_whole_training_step_never_reads_the_device(cfg: str) -> None:
    """Forward, loss, backward, clipping, the optimizer step and the EMA: what test_cuda runs under sync debug."""
    model, loss_fn, images, targets = _loss_and_step(cfg, static=True)
    optimizer = build_optimizer(model, "AdamW", 1e-3, 0.9, 5e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # on CPU; the fused step takes CUDA's found-inf on the device
    parts = SimpleNamespace(model=model, optimizer=optimizer, scaler=scaler, ema=ModelEMA(model), keep_grads=False)
    with recorded() as reads:
        loss, _ = loss_fn(model(images), targets)
        scaler.scale(loss).backward()
        _optimizer_step(parts)
    assert reads.found == []
