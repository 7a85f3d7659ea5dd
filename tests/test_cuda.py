"""On a CUDA device: which parts of a training step wait for the GPU, and train / val / segment end to end.

Skipped without CUDA; `pytest -m cuda` runs every GPU check (benchmarks/gpu_device.sh runs them first).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import train
import val
from segment import train as segment_train
from segment.task import SEGMENT
from segment.training import SEGMENT_TRAINING
from tests.conftest import make_tiny_dataset
from utils.data.synthetic import SyntheticSpec
from utils.families import build_model
from utils.hyp import load_hyp
from utils.tasks import DETECT
from utils.train.config import TrainConfig
from utils.train.cuda_graph import GraphedForward
from utils.train.ema import ModelEMA
from utils.train.optim import build_optimizer
from utils.train.records import DETECT_TRAINING, family_training
from utils.train.step import _optimizer_step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2)


@contextlib.contextmanager
def host_reads(mode: str) -> Iterator[None]:
    """Within the block a host synchronisation raises ("error") or is allowed ("default"); restored after."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _step_parts(cfg: str, static_loss_shapes: bool = False) -> SimpleNamespace:
    """A CUDA model, its loss (the family's short recipe), a fused AdamW, a GradScaler and an EMA, as training has.

    A "-seg" cfg gives a segmentation model and loss (per-instance masks).
    """
    segment = cfg.endswith("-seg")
    task, training = (SEGMENT, SEGMENT_TRAINING) if segment else (DETECT, DETECT_TRAINING)
    torch.manual_seed(0)
    model = build_model(task.spec_from_cfg(cfg, 3)).cuda().train()
    hyp = load_hyp(family_training(model).recipe_files.short)
    train_cfg = TrainConfig(hyp=hyp, imgsz=128, static_loss_shapes=static_loss_shapes, task=task.name)
    loss_fn = training.build_loss(model, train_cfg)
    optimizer = build_optimizer(model, "AdamW", 1e-3, 0.9, 5e-4)
    scaler = torch.amp.GradScaler("cuda")
    return SimpleNamespace(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scaler=scaler,
        ema=ModelEMA(model),
        keep_grads=False,
        loss_inputs=_segment_inputs if segment else _detect_inputs,
    )


def _detect_inputs(targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"targets": targets}


def _segment_inputs(targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The targets and a per-instance mask of each (32 x 32, its box filled), as the segmentation loss takes them."""
    centre = (torch.arange(32, device=targets.device) + 0.5) / 32
    x1, y1 = (targets[:, 2] - targets[:, 4] / 2)[:, None], (targets[:, 3] - targets[:, 5] / 2)[:, None]
    x2, y2 = (targets[:, 2] + targets[:, 4] / 2)[:, None], (targets[:, 3] + targets[:, 5] / 2)[:, None]
    inside_x, inside_y = (centre > x1) & (centre < x2), (centre > y1) & (centre < y2)  # (N, 32) each
    return {"targets": targets, "masks": (inside_y[:, :, None] & inside_x[:, None, :]).float()}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four 128 px images and six labels [image, cls, cx, cy, w, h] (normalised), on the GPU."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 128, 128, generator=generator).cuda()
    targets = torch.tensor(
        [[0, 0, 0.5, 0.5, 0.3, 0.3], [0, 1, 0.2, 0.3, 0.2, 0.1], [1, 2, 0.6, 0.4, 0.4, 0.5],
         [2, 0, 0.3, 0.7, 0.1, 0.2], [3, 1, 0.5, 0.5, 0.8, 0.8], [3, 2, 0.8, 0.2, 0.15, 0.15]]
    ).cuda()  # fmt: skip
    return images, targets


def _step(parts: SimpleNamespace, images: torch.Tensor, targets: torch.Tensor, loss_mode: str, rest_mode: str) -> None:
    """One fp16 training step: forward, loss, backward, then _optimizer_step (unscale, clip, step, update, EMA)."""
    with torch.autocast("cuda", dtype=torch.float16):
        with host_reads(rest_mode):
            preds = parts.model(images)
        with host_reads(loss_mode):
            loss, _ = parts.loss_fn(preds, **parts.loss_inputs(targets))
    with host_reads(rest_mode):
        parts.scaler.scale(loss).backward()
        _optimizer_step(parts)


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n"])
def test_forward_backward_optimizer_step_and_ema_never_wait_for_the_gpu(cfg: str) -> None:
    parts = _step_parts(cfg)
    images, targets = _batch()
    _step(parts, images, targets, "default", "default")  # the first step creates optimizer state and tunes kernels
    _step(parts, images, targets, "default", "error")  # raises RuntimeError at any host synchronisation
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in parts.ema.ema.parameters())


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="the default candidate search lists candidates with nonzero; --static-loss-shapes does not (below)",
)
@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n"])
def test_the_default_loss_waits_for_the_gpu_in_its_candidate_search(cfg: str) -> None:
    parts = _step_parts(cfg)
    images, targets = _batch()
    _step(parts, images, targets, "default", "default")
    _step(parts, images, targets, "error", "default")


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n", "yolo26n"])
def test_with_static_loss_shapes_the_whole_step_never_waits_for_the_gpu(cfg: str) -> None:
    parts = _step_parts(cfg, static_loss_shapes=True)
    images, targets = _batch()
    _step(parts, images, targets, "default", "default")
    _step(parts, images, targets, "error", "error")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in parts.ema.ema.parameters())


@contextlib.contextmanager
def exact_cudnn() -> Iterator[None]:
    """cuDNN's deterministic kernels and no TF32 inside the block, so two ways of running a step can agree closely."""
    cudnn = torch.backends.cudnn
    previous = (cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32)
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = True, False, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = previous


def _train_micro_batches(parts: SimpleNamespace, forward: Any, batches: list, accumulate: int = 2) -> None:
    """fp32 micro-batches through `forward`, an optimizer step (clip, step, EMA) every `accumulate` of them."""
    for index, (images, targets) in enumerate(batches):
        loss, _ = parts.loss_fn(forward(images), **parts.loss_inputs(targets))
        parts.scaler.scale(loss).backward()
        if index % accumulate == accumulate - 1:
            _optimizer_step(parts)


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov8n", "yolov5n-seg", "yolov8n-seg"])
def test_cuda_graph_steps_train_the_weights_the_eager_steps_train(cfg: str) -> None:
    """Replayed graphs, accumulation over two micro-batches and a batch of another shape (run eagerly) in between.

    Fails if the graph's gradient buffer became a parameter's .grad (accumulation then doubles the second
    micro-batch) or if the capture's warm-up passes were left in BatchNorm's running statistics.
    """
    images, targets = _batch()
    half = (images[:2], targets[targets[:, 0] < 2])  # another shape: the graphed model runs it eagerly
    batches = [(images, targets), (images.flip(-1), targets), half, (images, targets), (images.flip(-2), targets)]
    batches.append((images, targets))
    with exact_cudnn():
        eager = _step_parts(cfg)
        _train_micro_batches(eager, eager.model, batches)
        graphed = _step_parts(cfg)
        graphed.keep_grads = True
        forward = GraphedForward(graphed.model, amp_dtype=None)
        _train_micro_batches(graphed, forward, batches)
    torch.cuda.synchronize()
    assert forward.replays and forward.key[0] == images.shape
    assert "forward" not in vars(graphed.model)  # the model stays a plain module
    for (name, want), got in zip(eager.model.state_dict().items(), graphed.model.state_dict().values(), strict=True):
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:  # num_batches_tracked: every micro-batch once, none of the capture's warm-up passes
            assert torch.equal(got, want), name
    for want, got in zip(eager.ema.ema.parameters(), graphed.ema.ema.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny-cuda"), TINY)


def _train_argv(data: Path, project: Path, name: str, cfg: str) -> list[str]:
    return ["--data", str(data), "--cfg", cfg, "--imgsz", "64", "--batch-size", "4", "--workers", "0",
            "--epochs", "1", "--noplots", "--project", str(project), "--name", name]  # fmt: skip


@pytest.mark.slow
def test_train_then_val_in_fp16_on_cuda(tiny_data: Path, tmp_path: Path) -> None:
    result = train.main(_train_argv(tiny_data, tmp_path, "detect", "yolov8n"))
    assert result.epochs_run == 1 and result.best.is_file()
    weights = str(result.run_dir / "weights" / "best.pt")
    argv = ["--weights", weights, "--data", str(tiny_data), "--imgsz", "64", "--batch-size", "4", "--workers", "0",
            "--project", str(tmp_path)]  # fmt: skip
    for extra in ([], ["--half"]):
        scored = val.main([*argv, "--name", f"val{len(extra)}", *extra])
        assert scored.num_images == TINY.num_val and 0.0 <= scored.as_dict()["mAP50-95"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("cfg", ["yolov8n", "yolov5n", "yolov8n-seg"])
def test_train_with_cuda_graph_replays_the_captured_step(tiny_data: Path, tmp_path: Path, caplog, cfg: str) -> None:
    caplog.set_level(logging.INFO)
    main = segment_train.main if cfg.endswith("-seg") else train.main
    result = main([*_train_argv(tiny_data, tmp_path, "graph", cfg), "--cuda-graph"])
    assert result.epochs_run == 1 and result.best.is_file()
    assert "--cuda-graph: forward and backward captured at 4x3x64x64" in caplog.text
    assert "capturing the training step failed" not in caplog.text


@pytest.mark.slow
def test_segment_train_on_cuda(tiny_data: Path, tmp_path: Path) -> None:
    result = segment_train.main(_train_argv(tiny_data, tmp_path, "segment", "yolov5n-seg"))
    assert result.epochs_run == 1 and "mask_mAP50-95" in result.metrics


@pytest.mark.slow
def test_autobatch_measures_this_gpu_and_trains_at_that_batch(tiny_data: Path, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    argv = _train_argv(tiny_data, tmp_path, "autobatch", "yolov8n")
    argv[argv.index("--batch-size") + 1] = "-1"
    result = train.main(argv)
    assert result.epochs_run == 1 and "AutoBatch: --batch-size " in caplog.text
    chosen = int(caplog.text.split("AutoBatch: --batch-size ")[1].split()[0])
    assert 16 <= chosen <= 1024  # yolov8n at 64 px: far more than 16 images fit any GPU this runs on
