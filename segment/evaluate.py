"""Segmentation evaluation: the detection loop plus mask IoU matching and COCO RLE masks per detection."""

from __future__ import annotations

from typing import Any

import numpy as np
import pycocotools.mask as mask_utils
import torch
import torch.nn.functional as F

from segment.ops import process_masks
from utils.boxes import xywh_to_xyxy
from utils.data.batch import image_hw
from utils.data.masks import polygons_to_masks
from utils.eval.evaluate import DetectionScorer, ImageScore, match_classes

RLE_CHUNK = 32  # detections resized to original size at a time (bounds memory on large images)


def mask_iou(true_masks: torch.Tensor, pred_masks: torch.Tensor) -> torch.Tensor:
    """Return the (m, n) IoU between m true and n predicted binary masks of the same (H, W)."""
    true_flat = true_masks.flatten(1).float()  # flatten, not reshape(m, -1): m may be 0
    pred_flat = pred_masks.flatten(1).float()
    inter = true_flat @ pred_flat.T
    union = true_flat.sum(1)[:, None] + pred_flat.sum(1)[None, :] - inter
    return inter / union.clamp(min=1e-9)


def masks_to_original(masks: torch.Tensor, shape: Any) -> np.ndarray:
    """Map (n, H, W) bool masks on the letterboxed input back to the original image: (h0, w0, n) uint8, Fortran order.

    The padding is cut off (letterbox geometry in `shape`, see docs/CONTRACTS.md), then the
    content is resized bilinearly to the original size and thresholded at 0.5. Callers pass a few
    masks at a time (`original_rles`): the result is n full-size images.
    """
    (height0, width0), ((ratio_h, ratio_w), (pad_w, pad_h)) = shape
    top, left = int(round(pad_h - 0.1)), int(round(pad_w - 0.1))
    bottom = min(top + max(int(round(height0 * ratio_h)), 1), masks.shape[1])
    right = min(left + max(int(round(width0 * ratio_w)), 1), masks.shape[2])
    content = masks[:, top:bottom, left:right].float()[None]
    resized = F.interpolate(content, (height0, width0), mode="bilinear", align_corners=False)[0]
    # (n, w0, h0) in C order is (h0, w0, n) in Fortran order, the layout pycocotools encodes: one copy, not two.
    by_column = (resized > 0.5).transpose(1, 2).contiguous().view(torch.uint8).cpu().numpy()
    return by_column.transpose(2, 1, 0)


def original_rles(masks: torch.Tensor, shape: Any) -> list[dict]:
    """COCO RLE of each (n, H, W) input-size mask at the original image size, RLE_CHUNK masks at a time."""
    rles: list[dict] = []
    for start in range(0, len(masks), RLE_CHUNK):
        rles.extend(encode_rle(masks_to_original(masks[start : start + RLE_CHUNK], shape)))
    return rles


def encode_rle(masks_hwn: np.ndarray) -> list[dict]:
    """Encode (h, w, n) uint8 masks as COCO RLE dicts with `counts` as str (JSON-ready)."""
    if masks_hwn.shape[2] == 0:
        return []
    rles = mask_utils.encode(np.asfortranarray(masks_hwn))
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")
    return rles


class SegmentationScorer(DetectionScorer):
    """Adds mask matching to the detection scorer: predicted masks vs polygons rasterised at input size."""

    with_masks = True

    def __init__(self, num_masks: int) -> None:
        self.num_masks = num_masks

    def score_batch(
        self, outputs: list[torch.Tensor], loss_input: Any, targets: torch.Tensor, batch: dict[str, Any], collect: bool
    ) -> list[ImageScore]:
        """Box matching as for detection, then mask IoU matching with masks upsampled to the input size."""
        scores = super().score_batch(outputs, loss_input, targets, batch, collect)
        protos = loss_input[1]
        height, width = image_hw(batch["images"])
        for index, (pred, score) in enumerate(zip(outputs, scores, strict=True)):
            labels = targets[targets[:, 0] == index]
            # Masks are zero outside their boxes, so a detection whose box meets no box of its class
            # has mask IoU 0 with every label of its class: only the others' masks take part in IoU.
            meets = _meets_a_label(pred, labels)
            build = torch.ones_like(meets) if collect else meets  # RLE output needs every detection's mask
            pred_masks = process_masks(protos[index].float(), pred[build, 6:], pred[build, :4], (height, width))
            iou = None
            if meets.any() and len(labels):
                true_masks = self._true_masks(batch["segments"][index], height, width, pred.device)
                iou = pred.new_zeros((len(labels), len(pred)))
                iou[:, meets] = mask_iou(true_masks, pred_masks[meets] if collect else pred_masks)
            score.mask_correct = match_classes(pred, labels[:, 1], iou)
            if collect:
                score.masks_rle = original_rles(pred_masks, batch["shapes"][index])
        return scores

    def predicted_batch(
        self, batch: dict[str, Any], outputs: list[torch.Tensor], loss_input: Any, conf_thres: float
    ) -> dict[str, Any]:
        """The detection scorer's drawable batch plus `masks`: (N, H, W) uint8 per drawn detection, input size."""
        drawn = super().predicted_batch(batch, outputs, loss_input, conf_thres)
        protos, input_hw = loss_input[1], image_hw(batch["images"])
        masks = [torch.zeros((0, *input_hw), dtype=torch.bool)]
        for index, pred in enumerate(outputs):
            kept = pred[pred[:, 4] > conf_thres]  # the rows, in the order, of the detection scorer's targets
            masks.append(process_masks(protos[index].float(), kept[:, 6:], kept[:, :4], input_hw).cpu())
        drawn["masks"] = torch.cat(masks).to(torch.uint8)
        return drawn

    @staticmethod
    def _true_masks(segments: list[np.ndarray], height: int, width: int, device: torch.device) -> torch.Tensor:
        """Rasterise an image's normalised polygons at the input size: (m, H, W) uint8."""
        scale = np.array([width, height], np.float32)
        masks = polygons_to_masks([segment * scale for segment in segments], height, width)
        return torch.from_numpy(masks).to(device)


def _meets_a_label(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(n,) bool: detection j's box (input pixels) overlaps the box of some label of its class.

    pred: (n, 6+) x1 y1 x2 y2 conf cls ...; labels: (m, 6) [image, cls, cx, cy, w, h] in input pixels.
    """
    if not len(pred) or not len(labels):
        return torch.zeros(len(pred), dtype=torch.bool, device=pred.device)
    true_boxes = xywh_to_xyxy(labels[:, 2:6])
    low = torch.maximum(true_boxes[:, None, :2], pred[None, :, :2])
    high = torch.minimum(true_boxes[:, None, 2:4], pred[None, :, 2:4])
    overlaps = ((high - low) > 0).all(dim=2) & (labels[:, None, 1] == pred[None, :, 5])
    return overlaps.any(dim=0)
