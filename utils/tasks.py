"""The Task record: what differs between detection and segmentation for inference and evaluation; DETECT.

Training's side of a task (its losses) is the TrainingTask record in utils/train/records.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from utils.backends import as_backend
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.eval.evaluate import DetectionScorer, EvalOptions, EvalResult, LossInputs, evaluate
from utils.families import spec_from_cfg

BOX_METRICS = ("precision", "recall", "mAP50", "mAP50-95")


@dataclass(frozen=True)
class Task:
    """The seam between the shared code and a task; the engine, evaluation and prediction call only these.

    Models are built by their family (utils/families.py: build_model), the same for every task.
    - spec_from_cfg(model, num_classes) -> a family's spec: resolves `--cfg` (a size name or a model YAML)
    - loss_inputs(batch, device) -> the loss's keyword inputs taken from a batch; training and
      validation both get them here
    - make_scorer(num_masks) -> the evaluation loop's task-specific matching (DetectionScorer or a subclass)
    - predict_masks(head_extra, detections, input_hw, shape) -> (n, H0, W0) bool masks at the original
      size, for prediction on new inputs (utils/predict); None for a task without masks
    """

    name: str
    with_masks: bool  # the dataset emits polygons and masks, the collate concatenates them
    metric_names: tuple[str, ...]  # keys of EvalResult.as_dict() logged per epoch (besides fitness)
    spec_from_cfg: Callable[[str, int], Any]
    loss_inputs: LossInputs
    make_scorer: Callable[[int], DetectionScorer]
    predict_masks: Callable[..., np.ndarray] | None = None

    def evaluate(
        self,
        model: nn.Module,
        batches: Iterable[dict[str, Any]],
        options: EvalOptions,
        ctx: DistContext,
        loss_fn: Callable[..., Any] | None = None,
    ) -> EvalResult:
        """Run the evaluation loop (utils/eval/evaluate.py) with this task's scorer and loss inputs; all ranks call.

        `model`: an inference backend (utils/backends) or a plain module, as `evaluate` takes it.
        """
        backend = as_backend(model)
        scorer = self.make_scorer(backend.info.num_masks)
        return evaluate(backend, batches, options, ctx, scorer=scorer, loss_fn=loss_fn, loss_inputs=self.loss_inputs)


def detection_loss_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Return what the detection loss takes from a batch: `targets` (N, 6) [image, cls, cx, cy, w, h] on `device`."""
    return {"targets": batch["targets"].to(device, non_blocking=True)}


def detect_spec_from_cfg(model: str, num_classes: int) -> Any:
    """Resolve `--cfg` for detection; a segmentation model ('-seg', num_masks) is a one-line ConfigError."""
    spec = spec_from_cfg(model, num_classes)
    if spec.num_masks:
        raise ConfigError(f"--cfg {model} is a segmentation model; train it with segment/train.py")
    return spec


DETECT = Task(
    name="detect",
    with_masks=False,
    metric_names=BOX_METRICS,
    spec_from_cfg=detect_spec_from_cfg,
    loss_inputs=detection_loss_inputs,
    make_scorer=lambda num_masks: DetectionScorer(),
)
