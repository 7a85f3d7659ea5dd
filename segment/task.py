"""SEGMENT: the Task record that makes the shared engine, data and validator train instance segmentation."""

from __future__ import annotations

from models.yolo import ModelSpec, build_model, segmentation_spec, spec_from_cfg
from segment.evaluate import evaluate_segmentation
from segment.loss import build_segmentation_loss
from utils.tasks import BOX_METRICS, Task

MASK_METRICS = tuple(f"mask_{name}" for name in BOX_METRICS)


def segment_spec_from_cfg(cfg: str, num_classes: int) -> ModelSpec:
    """Resolve `--cfg` for segmentation: 'yolov5s' and 'yolov5s-seg' both give the -seg model (32 masks)."""
    spec = spec_from_cfg(cfg, num_classes)
    return spec if spec.num_masks else segmentation_spec(spec)


SEGMENT = Task(
    name="segment",
    with_masks=True,
    loss_names=("box", "seg", "obj", "cls"),
    metric_names=(*BOX_METRICS, *MASK_METRICS),
    build_model=build_model,
    spec_from_cfg=segment_spec_from_cfg,
    build_loss=build_segmentation_loss,
    evaluate=evaluate_segmentation,
)
