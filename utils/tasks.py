"""The Task record: the few functions that differ between detection and segmentation; DETECT."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from models.yolo import ModelSpec, build_model, spec_from_cfg
from utils.config import TrainConfig
from utils.errors import ConfigError
from utils.eval.evaluate import evaluate_detection
from utils.train.loss import DetectionLoss

BOX_METRICS = ("precision", "recall", "mAP50", "mAP50-95")


@dataclass(frozen=True)
class Task:
    """The seam between the engine and a task; the engine calls only these fields.

    - build_model(spec) -> nn.Module
    - spec_from_cfg(cfg, num_classes) -> ModelSpec
    - build_loss(model, cfg: TrainConfig) -> callable (preds, targets, reduce_counts[, masks=]) -> (loss, items)
    - evaluate(model, batches, EvalOptions, ctx, loss_fn) -> EvalResult
    """

    name: str
    with_masks: bool
    loss_names: tuple[str, ...]
    metric_names: tuple[str, ...]  # keys of EvalResult.as_dict() logged per epoch (besides fitness)
    build_model: Callable[[ModelSpec], nn.Module]
    spec_from_cfg: Callable[[str, int], ModelSpec]
    build_loss: Callable[[nn.Module, TrainConfig], Callable[..., Any]]
    evaluate: Callable[..., Any]


def detect_spec_from_cfg(cfg: str, num_classes: int) -> ModelSpec:
    """Resolve `--cfg` for detection; a segmentation model ('-seg', num_masks) is a one-line ConfigError."""
    spec = spec_from_cfg(cfg, num_classes)
    if spec.num_masks:
        raise ConfigError(f"--cfg {cfg} is a segmentation model; train it with segment/train.py")
    return spec


def build_detection_loss(model: nn.Module, cfg: TrainConfig) -> DetectionLoss:
    """Build the YOLOv5-style detection loss with gains scaled for this model, class count and image size."""
    return DetectionLoss.from_hyp(model, cfg.hyp, cfg.imgsz)


DETECT = Task(
    name="detect",
    with_masks=False,
    loss_names=("box", "obj", "cls"),
    metric_names=BOX_METRICS,
    build_model=build_model,
    spec_from_cfg=detect_spec_from_cfg,
    build_loss=build_detection_loss,
    evaluate=evaluate_detection,
)
