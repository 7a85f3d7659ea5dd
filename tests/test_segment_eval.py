"""Segmentation evaluation: mask IoU, the box pre-filter, perfect / disjoint mask AP, masks back to original size."""

from __future__ import annotations

import numpy as np
import pycocotools.mask as mask_utils
import torch

from segment.evaluate import (
    SegmentationScorer,
    _meets_a_label,
    encode_rle,
    mask_iou,
    masks_to_original,
    original_rles,
)
from utils.eval.evaluate import _Stats
from utils.eval.metrics import DetectionMetrics

SIZE = 32  # input pixels; the test prototypes have the input size, so upsampling cannot round mask corners
# Two class-0 squares and one class-1 rectangle.
BOXES = torch.tensor([[4.0, 4.0, 12.0, 12.0], [16.0, 16.0, 28.0, 28.0], [20.0, 0.0, 32.0, 8.0]])
CLASSES = torch.tensor([0.0, 0.0, 1.0])


def _batch() -> tuple[torch.Tensor, dict]:
    """Targets (N, 6) with boxes in input pixels, and a batch dict with the squares as polygons."""
    xywh = torch.cat(((BOXES[:, :2] + BOXES[:, 2:]) / 2, BOXES[:, 2:] - BOXES[:, :2]), 1)
    targets = torch.cat((torch.zeros(3, 1), CLASSES[:, None], xywh), 1)
    polygons = [
        np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float32) / SIZE for x1, y1, x2, y2 in BOXES.tolist()
    ]
    shape = ((SIZE, SIZE), ((1.0, 1.0), (0.0, 0.0)))
    batch = {"images": torch.zeros(1, SIZE, SIZE, 3), "segments": [polygons], "shapes": [shape], "paths": ["a.jpg"]}
    return targets, batch


def _outputs(instance_of_each_detection: list[int], boxes: torch.Tensor) -> tuple[list[torch.Tensor], tuple]:
    """NMS-style rows whose mask coefficients select one instance's prototype (logit +10 inside, -10 outside)."""
    protos = torch.full((3, SIZE, SIZE), -10.0)
    for i, (x1, y1, x2, y2) in enumerate(BOXES.long().tolist()):
        protos[i, y1:y2, x1:x2] = 10.0
    coeffs = torch.eye(3)[instance_of_each_detection]
    conf = torch.linspace(0.9, 0.5, len(boxes))[:, None]
    rows = torch.cat((boxes, conf, CLASSES[instance_of_each_detection][:, None], coeffs), 1)
    return [rows], ([], protos[None])


def _mask_metrics(instances: list[int], boxes: torch.Tensor) -> DetectionMetrics:
    targets, batch = _batch()
    outputs, loss_input = _outputs(instances, boxes)
    stats = _Stats()
    for score in SegmentationScorer(num_masks=3).score_batch(outputs, loss_input, targets, batch, collect=False):
        stats.add(score)
    correct, conf, pred_cls, target_cls, mask_correct, _ = stats.concatenated()
    return DetectionMetrics.from_stats(mask_correct, conf, pred_cls, target_cls, num_classes=2)


def test_mask_iou_by_hand() -> None:
    true = torch.zeros(1, 4, 4, dtype=torch.uint8)
    true[0, :2, :2] = 1  # 4 pixels
    pred = torch.zeros(2, 4, 4, dtype=torch.bool)
    pred[0, :2, :] = True  # 8 pixels, 4 shared: IoU 4 / 8
    pred[1, 2:, 2:] = True  # disjoint
    torch.testing.assert_close(mask_iou(true, pred), torch.tensor([[0.5, 0.0]]))


def test_mask_iou_matches_the_dense_count_over_all_pixels() -> None:
    generator = torch.Generator().manual_seed(0)
    true = (torch.rand(3, 20, 24, generator=generator) > 0.8).to(torch.uint8)
    pred = torch.rand(5, 20, 24, generator=generator) > 0.5
    dense_true, dense_pred = true.flatten(1).double(), pred.flatten(1).double()
    inter = dense_true @ dense_pred.T
    union = dense_true.sum(1)[:, None] + dense_pred.sum(1)[None, :] - inter
    torch.testing.assert_close(mask_iou(true, pred), (inter / union).float())
    assert mask_iou(true[:0], pred).shape == (0, 5) and mask_iou(true, pred[:0]).shape == (3, 0)
    assert mask_iou(torch.zeros_like(true), pred).abs().sum() == 0  # nothing covered: IoU 0, not NaN


def test_perfect_masks_give_mask_ap_1_and_disjoint_masks_give_0() -> None:
    perfect = _mask_metrics([0, 1, 2], BOXES.clone())
    assert perfect.map50 == 1.0 and perfect.map50_95 == 1.0
    # Each class-0 box keeps its place but carries the other class-0 square's mask: boxes right, masks disjoint.
    swapped = _mask_metrics([1, 0, 2], BOXES.clone())
    assert swapped.ap50[0] == 0.0 and swapped.ap[0] == 0.0 and swapped.ap[1] == 1.0


def test_detections_far_from_labels_of_their_class_are_skipped_exactly() -> None:
    targets, _ = _batch()
    pred = torch.tensor(
        [
            [5.0, 5.0, 9.0, 9.0, 0.9, 0.0],  # inside a class-0 box
            [5.0, 5.0, 9.0, 9.0, 0.9, 1.0],  # same place, but no class-1 label there
            [12.0, 4.0, 16.0, 12.0, 0.9, 0.0],  # touches the first box only along an edge: no overlap
            [0.0, 0.0, 32.0, 32.0, 0.9, 1.0],  # covers the class-1 rectangle
        ]
    )
    assert _meets_a_label(pred, targets).tolist() == [True, False, False, True]
    assert _meets_a_label(pred, targets[:0]).tolist() == [False] * 4


def test_masks_back_to_original_size_undo_the_letterbox() -> None:
    # A 20 x 40 original letterboxed to 32 x 32: scale 0.8, 8 px of padding top and bottom.
    masks = torch.zeros(1, 32, 32, dtype=torch.bool)
    masks[0, 8:16, 0:16] = True  # the original's top-left 10 x 20 quarter
    shape = ((20, 40), ((0.8, 0.8), (0.0, 8.0)))
    original = masks_to_original(masks, shape)
    assert original.shape == (20, 40, 1) and original.dtype == np.uint8 and original.flags.f_contiguous
    expected = np.zeros((20, 40), np.uint8)
    expected[:10, :20] = 1
    np.testing.assert_array_equal(original[..., 0], expected)
    two = masks_to_original(torch.stack((masks[0], masks[0].flip(1))), shape)  # masks stay apart in the layout
    np.testing.assert_array_equal(two[..., 0], expected)
    np.testing.assert_array_equal(two[..., 1], expected[:, ::-1])
    rle = encode_rle(original)
    assert isinstance(rle[0]["counts"], str) and mask_utils.area(rle[0]) == 200
    many = masks.expand(40, -1, -1)  # more than one RLE chunk
    assert original_rles(many, shape) == rle * 40
    assert encode_rle(np.zeros((5, 5, 0), np.uint8)) == []
