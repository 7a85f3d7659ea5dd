"""INT8 export's shared parts: calibration images letterboxed as val does, layers kept in float, agreement check."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from utils.backends.exported import Runner, rows_from_detections
from utils.backends.metadata import CHANNELS_FIRST, END_TO_END, ExportMetadata
from utils.boxes import box_iou
from utils.data.batch import to_model_input
from utils.data.data_config import load_data_config
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import family_named

LOGGER = logging.getLogger(__name__)

CALIBRATION_SPLIT = "train"  # calibrating on the images val scores would flatter the INT8 mAP
# The agreement check: PyTorch's detections at detect.py's default thresholds that the INT8 file must also find
# (same class, IoU >= 0.5). Below MIN_AGREEMENT the file is refused: rounding costs a few detections near the
# threshold, a broken quantization (a head or decode quantized, a wrong calibration) costs most of them.
AGREEMENT_CONF, AGREEMENT_IOU, AGREEMENT_MATCH_IOU = 0.25, 0.45, 0.5
MIN_AGREEMENT = 0.5


@dataclass(frozen=True)
class CalibrationSet:
    """Where INT8 calibration images come from (export.py --data, --calib-images) and how they are shaped."""

    data: Path  # a dataset YAML; its train split is read
    num_images: int
    imgsz: int  # the square side images are letterboxed to (val's letterbox for a fixed-size file)
    stride: int
    num_classes: int  # the model's, checked against the YAML's names


def load_calibration_images(spec: CalibrationSet, ctx: DistContext) -> torch.Tensor:
    """`spec.num_images` train images spread evenly over the split, letterboxed as val does: (N, 3, S, S) in [0, 1].

    Squares of `spec.imgsz`, grey padding, RGB: the items val's loader gives a fixed-size export (no
    rectangular batches, so every image has the exported shape). Unreadable images are skipped and
    counted; fewer images than asked (a small split) is one warning. A YAML of another class count is
    a one-line ConfigError, as in val.
    """
    data = load_data_config(spec.data, ctx)
    if len(data.names) != spec.num_classes:
        raise ConfigError(f"--data {spec.data} has {len(data.names)} classes but the model {spec.num_classes}")
    options = DatasetOptions.for_evaluation(
        img_size=spec.imgsz, batch_size=1, stride=spec.stride, num_classes=len(data.names),
        names_file=data.yaml_file, workers=1,
    )  # fmt: skip
    options = dataclasses.replace(options, rect=False, pad=0.0)
    dataset = LoadImagesAndLabels(data.split(CALIBRATION_SPLIT), options, ctx, data.coco_source(CALIBRATION_SPLIT))
    if len(dataset) < spec.num_images:
        LOGGER.warning(f"--calib-images {spec.num_images}: {spec.data} has {len(dataset)} train images; using all")
    indices = np.unique(np.linspace(0, len(dataset) - 1, min(spec.num_images, len(dataset))).round().astype(int))
    items = [dataset[int(index)] for index in indices]
    unreadable = [item["path"] for item in items if item["image"] is None]
    if unreadable:
        LOGGER.warning(f"{len(unreadable)} calibration images could not be read and were skipped, e.g. {unreadable[0]}")
    pixels = [item["image"] for item in items if item["image"] is not None]
    if not pixels:
        raise ConfigError(f"--data {spec.data}: no readable {CALIBRATION_SPLIT} images to calibrate INT8 with")
    return to_model_input(torch.stack(pixels), torch.device("cpu")).contiguous()


def calibration_batches(images: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """`images` in whole batches of `batch_size` (the exported input's batch); a short remainder is left out.

    Raises ConfigError when there are fewer images than one batch.
    """
    if len(images) < batch_size:
        raise ConfigError(f"--calib-images gave {len(images)} images, fewer than --batch-size {batch_size}")
    whole = len(images) - len(images) % batch_size
    return list(images[:whole].split(batch_size))


def head_output_convs(model: nn.Module) -> list[str]:
    """Names (relative to `model.head`) of the head's output convolutions, which INT8 export keeps in float.

    They are the plain nn.Conv2d items of the head's branch lists (YOLOv5's `convs.0`, an anchor-free
    head's `box_branches.0.2`, `class_branches.0.2`, `mask_branches.0.2`): their outputs are the box
    distances, class logits and mask coefficients themselves, where an INT8 step is a visible error.
    Convolutions inside Conv blocks (named `...conv`) and the prototype branch stay quantized.
    """
    return [
        name
        for name, module in model.head.named_modules()
        if isinstance(module, nn.Conv2d) and name.rsplit(".", 1)[-1].isdigit() and not name.startswith("proto")
    ]


@dataclass(frozen=True)
class Agreement:
    """How many of PyTorch's detections the INT8 file also finds, over the calibration images."""

    matched: int  # PyTorch detections with an INT8 detection of the same class at IoU >= AGREEMENT_MATCH_IOU
    expected: int  # PyTorch's detections at AGREEMENT_CONF
    found: int  # the INT8 file's detections at AGREEMENT_CONF

    @property
    def measured(self) -> bool:
        """Whether PyTorch found anything to compare with: an undertrained model, or calibration images unlike
        its data, may find nothing at AGREEMENT_CONF, and then the check says nothing about the file."""
        return self.expected > 0

    @property
    def recall(self) -> float:
        """matched / expected; 1.0 when PyTorch finds nothing (nothing to lose: see `measured`)."""
        return self.matched / self.expected if self.expected else 1.0


def detection_agreement(
    wrapper: nn.Module, runner: Runner, batches: list[torch.Tensor], metadata: ExportMetadata
) -> Agreement:
    """Select detections from PyTorch's and the file's outputs on `batches` and count those they share.

    Both go through the family's selector (NMS, or YOLO26's top scores) at conf 0.25, IoU 0.45; a
    PyTorch detection is matched greedily, best score first, to the unmatched file detection of its
    class with the highest IoU, if that is at least 0.5.
    """
    selector = family_named(metadata["family"]).detection_selector(metadata["layout"] == END_TO_END)
    matched = expected = found = 0
    for images in batches:
        with torch.no_grad():
            reference = wrapper(images.to(next(wrapper.parameters()).device))
        reference_out = reference[0] if isinstance(reference, tuple) else reference
        file_out = torch.from_numpy(np.asarray(runner(images)[0], dtype=np.float32))
        selected = [
            selector(_rows(output.float().cpu(), metadata), AGREEMENT_CONF, AGREEMENT_IOU,
                     num_masks=metadata["num_masks"])
            for output in (reference_out, file_out)
        ]  # fmt: skip
        for want, got in zip(*selected, strict=True):
            matched += _matched(want, got)
            expected, found = expected + len(want), found + len(got)
    return Agreement(matched, expected, found)


def _rows(output0: torch.Tensor, metadata: ExportMetadata) -> torch.Tensor:
    """A file's output0 as decoded rows (B, N, no), the selector's input (utils/backends/exported.py)."""
    if metadata["layout"] == CHANNELS_FIRST:
        return output0.transpose(1, 2)
    if metadata["layout"] == END_TO_END:
        return rows_from_detections(output0, len(metadata["names"]), metadata["num_masks"])
    return output0


def _matched(want: torch.Tensor, got: torch.Tensor) -> int:
    """How many rows of `want` (n, 6+: xyxy, score, class) have a same-class row of `got` at IoU >= 0.5."""
    if not len(want) or not len(got):
        return 0
    iou = box_iou(want[:, :4], got[:, :4])
    iou[want[:, 5:6] != got[:, 5].unsqueeze(0)] = 0.0
    taken = torch.zeros(len(got), dtype=torch.bool)
    count = 0
    for row in want[:, 4].argsort(descending=True).tolist():
        candidates = iou[row].masked_fill(taken, 0.0)
        best = int(candidates.argmax())
        if candidates[best] >= AGREEMENT_MATCH_IOU:
            taken[best] = True
            count += 1
    return count
