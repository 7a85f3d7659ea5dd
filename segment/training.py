"""SEGMENT_TRAINING: the segmentation task as the engine trains it, with each model family's segmentation loss."""

from __future__ import annotations

from typing import Any

from segment.dense_loss import DenseSegmentationLoss
from segment.loss import SegmentationLoss
from segment.task import SEGMENT
from utils.families import ANCHOR_FREE, YOLOV5
from utils.train.config import TrainConfig
from utils.train.records import TrainingTask


def segmentation_loss_options(cfg: TrainConfig) -> dict[str, Any]:
    """The mask term reads the ground truth as one index mask per image with --overlap-mask."""
    return {"overlap": cfg.overlap_mask}


# Each family's segmentation loss: its detection loss plus the mask term on its own matches.
SEGMENT_TRAINING = TrainingTask(
    task=SEGMENT,
    losses={YOLOV5.name: SegmentationLoss, ANCHOR_FREE.name: DenseSegmentationLoss},
    loss_options=segmentation_loss_options,
)
