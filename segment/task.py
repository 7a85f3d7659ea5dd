"""SEGMENT: the Task record that makes the shared data, validator and predictor handle instance segmentation.

Its training side (the losses) is SEGMENT_TRAINING in segment/training.py.
"""

from __future__ import annotations

from typing import Any

import torch

from segment.evaluate import SegmentationScorer
from segment.instance_masks import original_size_masks
from utils.families import segmentation_spec, spec_from_cfg
from utils.tasks import BOX_METRICS, Task, detection_loss_inputs

MASK_METRICS = tuple(f"mask_{name}" for name in BOX_METRICS)


def segment_spec_from_cfg(model: str, num_classes: int) -> Any:
    """Resolve `--cfg` for segmentation: 'yolov5s' and 'yolov5s-seg' both give the -seg model (32 masks)."""
    spec = spec_from_cfg(model, num_classes)
    return spec if spec.num_masks else segmentation_spec(spec)


def segmentation_loss_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Return the detection loss inputs plus the batch's ground-truth `masks` (per instance or overlap) on `device`."""
    return {**detection_loss_inputs(batch, device), "masks": batch["masks"].to(device, non_blocking=True)}


SEGMENT = Task(
    name="segment",
    with_masks=True,
    metric_names=(*BOX_METRICS, *MASK_METRICS),
    spec_from_cfg=segment_spec_from_cfg,
    loss_inputs=segmentation_loss_inputs,
    make_scorer=SegmentationScorer,  # takes the model's number of mask coefficients
    predict_masks=original_size_masks,
)
