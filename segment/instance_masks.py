"""Masks of predicted instances at the original image size, for prediction on new inputs (segment/predict.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from segment.evaluate import RLE_CHUNK, masks_to_original
from segment.ops import process_masks
from utils.data.batch import ShapeInfo


def original_size_masks(
    head_extra: Any, detections: torch.Tensor, input_hw: tuple[int, int], shape: ShapeInfo
) -> np.ndarray:
    """Return one image's detection masks at its original size: (n, H0, W0) bool.

    head_extra: the eval forward's second output `(raw, protos (1, nm, H/4, W/4))` of a one-image
    batch; detections: that image's NMS rows (n, 6 + nm) [x1, y1, x2, y2, conf, cls, coeffs] in
    input pixels; input_hw: the letterboxed input (H, W); shape: its ShapeInfo. Masks are
    assembled and cropped at the input size (segment/ops.process_masks), then the letterbox padding
    is cut and they are resized to the original (segment/evaluate.masks_to_original), RLE_CHUNK
    at a time so memory stays bounded on large images.
    """
    protos = head_extra[1][0].float()
    height0, width0 = shape[0]
    out = np.zeros((len(detections), height0, width0), dtype=bool)
    for start in range(0, len(detections), RLE_CHUNK):
        rows = detections[start : start + RLE_CHUNK]
        masks = process_masks(protos, rows[:, 6:].float(), rows[:, :4].float(), input_hw)
        out[start : start + len(rows)] = masks_to_original(masks, shape).transpose(2, 0, 1)
    return out
