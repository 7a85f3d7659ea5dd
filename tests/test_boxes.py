"""Tests for utils/boxes.py: conversions, IoU family, NMS against a brute-force reference, letterbox undo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from utils.boxes import (
    bbox_iou,
    box_iou,
    clip_boxes,
    non_max_suppression,
    scale_boxes,
    top_detections,
    xywh_to_xyxy,
    xywhn_to_xyxy,
    xyxy_to_xywh,
    xyxy_to_xywhn,
)

# ---------------------------------------------------------------- conversions


@pytest.mark.parametrize("as_array", [torch.tensor, np.array])
def test_conversions_hand_values(as_array) -> None:
    boxes_xyxy = as_array([[10.0, 20.0, 30.0, 60.0]])
    assert np.allclose(np.asarray(xyxy_to_xywh(boxes_xyxy)), [[20, 40, 20, 40]])
    assert np.allclose(np.asarray(xywh_to_xyxy(as_array([[20.0, 40.0, 20.0, 40.0]]))), [[10, 20, 30, 60]])
    # x1 = 100 * (0.5 - 0.1) + 3 = 43, y1 = 50 * (0.5 - 0.2) + 4 = 19, x2 = 100 * 0.6 + 3, y2 = 50 * 0.7 + 4
    out = xywhn_to_xyxy(as_array([[0.5, 0.5, 0.2, 0.4]]), w=100, h=50, padw=3, padh=4)
    assert np.allclose(np.asarray(out), [[43, 19, 63, 39]])
    assert type(out) is type(boxes_xyxy)


@pytest.mark.parametrize("as_array", [torch.tensor, np.array])
def test_xyxy_to_xywhn_clip_leaves_input_untouched(as_array) -> None:
    boxes = as_array([[-10.0, 5.0, 50.0, 60.0]])
    # clipped to [0, 5, 50, 50] in a 100x50 image -> cx 25/100, cy 27.5/50, w 50/100, h 45/50
    out = xyxy_to_xywhn(boxes, w=100, h=50, clip=True)
    assert np.allclose(np.asarray(out), [[0.25, 0.55, 0.5, 0.9]])
    assert np.allclose(np.asarray(boxes), [[-10, 5, 50, 60]])
    unclipped = xyxy_to_xywhn(boxes, w=100, h=50)
    assert np.allclose(np.asarray(unclipped), [[0.2, 0.65, 0.6, 1.1]])


def test_conversions_round_trip_batched() -> None:
    gen = torch.Generator().manual_seed(0)
    xywh = torch.rand(2, 7, 4, generator=gen, dtype=torch.float64) * 100 + 1
    assert torch.allclose(xyxy_to_xywh(xywh_to_xyxy(xywh)), xywh)
    xyxy = xywh_to_xyxy(xywh)
    back = xywhn_to_xyxy(xyxy_to_xywhn(xyxy, w=640, h=480), w=640, h=480)
    assert torch.allclose(back, xyxy)
    arr = xywh.numpy()
    assert np.allclose(xyxy_to_xywh(xywh_to_xyxy(arr)), arr)


# ---------------------------------------------------------------- IoU family


def test_box_iou_hand_values() -> None:
    a = torch.tensor([[0.0, 0, 2, 2], [0, 0, 4, 4], [1, 1, 3, 5]])
    b = torch.tensor([[1.0, 1, 3, 3], [10, 10, 12, 12]])
    iou = box_iou(a, b)
    assert iou.shape == (3, 2)
    # overlap 1 / union 7; nested: 4 / 16; third box vs itself-like [1,1,3,3] inside it: 4 / 8
    expected = torch.tensor([[1 / 7, 0], [0.25, 0], [0.5, 0]])
    assert torch.allclose(iou, expected)
    assert torch.allclose(box_iou(a, a).diagonal(), torch.ones(3))


def _ciou_nested_pair() -> float:
    # box1 [0,0,4,2] (w4 h2), box2 [1,0,3,2] (w2 h2): inter 4, union 8 -> IoU 0.5; same centre -> rho = 0.
    v = 4 / math.pi**2 * (math.atan(2 / 2) - math.atan(4 / 2)) ** 2
    alpha = v / (v - 0.5 + 1)
    return 0.5 - alpha * v


# Each row: box1 xyxy, box2 xyxy, expected iou, giou, diou, ciou (derived in the comments).
IOU_CASES = [
    # partial overlap: IoU 1/7; enclosing 3x3 = 9 -> GIoU 1/7 - 2/9 = -5/63;
    # centres (1,1),(2,2): rho^2 = 2, c^2 = 18 -> DIoU 1/7 - 1/9 = 2/63; equal aspect -> CIoU = DIoU
    ([0, 0, 2, 2], [1, 1, 3, 3], 1 / 7, -5 / 63, 2 / 63, 2 / 63),
    # identical
    ([1, 1, 3, 5], [1, 1, 3, 5], 1.0, 1.0, 1.0, 1.0),
    # disjoint: enclosing 3x1, union 2 -> GIoU -1/3; rho^2 = 4, c^2 = 10 -> DIoU -0.4
    ([0, 0, 1, 1], [2, 0, 3, 1], 0.0, -1 / 3, -0.4, -0.4),
    # nested, different aspect: enclosing = box1 -> GIoU = IoU; DIoU = IoU; CIoU adds alpha * v
    ([0, 0, 4, 2], [1, 0, 3, 2], 0.5, 0.5, 0.5, _ciou_nested_pair()),
    # zero-area point inside a 2x2 box: IoU 0, GIoU 0 - (4 - 4)/4 = 0, DIoU 0 (same centre);
    # v = 4/pi^2 * (atan(1) - atan(0))^2 = 1/4, alpha = 0.25 / 1.25 = 0.2 -> CIoU = -0.05
    ([1, 1, 1, 1], [0, 0, 2, 2], 0.0, 0.0, 0.0, -0.05),
]


@pytest.mark.parametrize("box1, box2, iou, giou, diou, ciou", IOU_CASES)
def test_bbox_iou_hand_values(box1, box2, iou, giou, diou, ciou) -> None:
    b1 = torch.tensor([box1], dtype=torch.float64)
    b2 = torch.tensor([box2], dtype=torch.float64)
    for kind, expected in (("iou", iou), ("giou", giou), ("diou", diou), ("ciou", ciou)):
        got = bbox_iou(b1, b2, xywh=False, kind=kind)
        assert got.shape == (1,)
        assert got.item() == pytest.approx(expected, abs=1e-6), kind
        # same boxes given as xywh
        got_xywh = bbox_iou(xyxy_to_xywh(b1), xyxy_to_xywh(b2), xywh=True, kind=kind)
        assert got_xywh.item() == pytest.approx(expected, abs=1e-6), kind


def test_bbox_iou_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        bbox_iou(torch.zeros(1, 4), torch.zeros(1, 4), kind="eiou")


def test_ciou_gradient_finite_for_degenerate_boxes() -> None:
    gen = torch.Generator().manual_seed(1)
    pred = torch.rand(16, 4, generator=gen) * 10
    pred[0, 2:] = 0  # zero width and height
    pred[1, 2] = 0  # zero width
    pred[2, 3] = 0  # zero height
    pred[3] = 0  # everything zero
    target = torch.rand(16, 4, generator=gen) * 10
    target[4, 2:] = 0
    target[3] = 0
    pred.requires_grad_(True)
    for kind in ("iou", "giou", "diou", "ciou"):
        pred.grad = None
        value = bbox_iou(pred, target, xywh=True, kind=kind)
        assert torch.isfinite(value).all(), kind
        (1 - value).sum().backward()
        assert torch.isfinite(pred.grad).all(), kind
        assert pred.grad.abs().sum() > 0, kind


def test_ciou_alpha_carries_no_gradient() -> None:
    # On the nested pair only v depends on the width of box1 through atan; alpha must act as a constant.
    box1 = torch.tensor([[2.0, 1.0, 4.0, 2.0]], dtype=torch.float64, requires_grad=True)  # xywh of [0,0,4,2]
    box2 = torch.tensor([[2.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    bbox_iou(box1, box2, kind="ciou").sum().backward()
    reference = box1.detach().clone().requires_grad_(True)
    w1, h1 = reference[0, 2], reference[0, 3]
    v = 4 / math.pi**2 * (math.atan(1.0) - torch.atan(w1 / (h1 + 1e-7))) ** 2
    alpha = (v / (v - 0.5 + 1)).detach()
    iou = bbox_iou(reference, box2, kind="iou")  # no centre/enclosure term: same centre, box1 encloses
    (iou - alpha * v).sum().backward()
    assert torch.allclose(box1.grad, reference.grad, atol=1e-9)


# ---------------------------------------------------------------- NMS


def _iou_py(a: list[float], b: list[float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _reference_nms(image_pred, num_classes, conf_thres, iou_thres, classes, agnostic, max_det, multi_label):
    """Brute-force greedy NMS in plain Python lists; returns rows [x1,y1,x2,y2,conf,cls,coeffs...]."""
    candidates = []
    for row in image_pred.tolist():
        cx, cy, w, h, obj = row[:5]
        box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
        scores = [obj * p for p in row[5 : 5 + num_classes]]
        picks = range(num_classes) if multi_label else [max(range(num_classes), key=lambda c: scores[c])]
        for c in picks:
            if scores[c] > conf_thres and (classes is None or c in classes):
                candidates.append([*box, scores[c], float(c), *row[5 + num_classes :]])
    candidates.sort(key=lambda r: -r[4])
    kept: list[list[float]] = []
    for cand in candidates:
        rivals = [k for k in kept if agnostic or k[5] == cand[5]]
        if all(_iou_py(cand[:4], k[:4]) <= iou_thres for k in rivals):
            kept.append(cand)
    return kept[:max_det]


def _random_pred(seed: int, batch: int, num_boxes: int, num_classes: int, num_masks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.rand(batch, num_boxes, 2, generator=gen, dtype=torch.float64) * 100
    sizes = torch.rand(batch, num_boxes, 2, generator=gen, dtype=torch.float64) * 35 + 5
    probs = torch.rand(batch, num_boxes, 1 + num_classes, generator=gen, dtype=torch.float64)
    coeffs = torch.randn(batch, num_boxes, num_masks, generator=gen, dtype=torch.float64)
    return torch.cat((centres, sizes, probs, coeffs), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "agnostic, multi_label, classes, max_det",
    [(False, False, None, 300), (True, False, None, 300), (False, False, None, 7), (False, True, None, 300),
     (False, False, [0, 2], 300), (True, True, [1], 5)],
)  # fmt: skip
def test_nms_matches_brute_force(seed, agnostic, multi_label, classes, max_det) -> None:
    num_classes, num_masks, conf_thres, iou_thres = 3, 2, 0.2, 0.45
    pred = _random_pred(seed, batch=2, num_boxes=150, num_classes=num_classes, num_masks=num_masks)
    out = non_max_suppression(
        pred, conf_thres, iou_thres, classes, agnostic, max_det, num_masks=num_masks, multi_label=multi_label
    )
    assert len(out) == 2
    for image_pred, det in zip(pred, out, strict=True):
        expected = _reference_nms(
            image_pred, num_classes, conf_thres, iou_thres, classes, agnostic, max_det, multi_label
        )
        assert det.shape == (len(expected), 6 + num_masks)
        assert len(expected) > 0
        assert torch.allclose(det, torch.tensor(expected, dtype=det.dtype))
        assert (det[:, 4] > conf_thres).all()
        assert len(det) <= max_det
        assert (det[:-1, 4] >= det[1:, 4]).all()  # sorted by confidence


@pytest.mark.parametrize("objectness", [True, False])
@pytest.mark.parametrize("multi_label", [False, True])
def test_nms_of_a_batch_equals_nms_of_each_image_alone(objectness: bool, multi_label: bool) -> None:
    """Candidates are picked for the whole batch at once: no image may gain, lose or reorder a row by it."""
    pred = _random_pred(4, batch=4, num_boxes=120, num_classes=3, num_masks=2).float()
    if not objectness:
        pred = torch.cat((pred[..., :4], pred[..., 5:]), -1)
    pred[2, :, 4:7] = 0  # an image with nothing above the threshold, between two that have candidates
    options = dict(num_masks=2, multi_label=multi_label, objectness=objectness)
    batched = non_max_suppression(pred, 0.2, 0.45, **options)
    alone = [non_max_suppression(image[None], 0.2, 0.45, **options)[0] for image in pred]
    assert len(batched[2]) == 0 and all(len(det) for i, det in enumerate(batched) if i != 2)
    for together, single in zip(batched, alone, strict=True):
        assert torch.equal(together, single)


def test_nms_max_det_caps_a_crowded_image() -> None:
    # 50 well-separated boxes (nothing to suppress): only the 10 most confident may come back.
    pred = torch.zeros(1, 50, 6)
    pred[0, :, 0] = torch.arange(50) * 100.0
    pred[0, :, 1] = 50
    pred[0, :, 2:4] = 20
    pred[0, :, 4] = torch.linspace(0.3, 0.99, 50)
    pred[0, :, 5] = 1
    det = non_max_suppression(pred, conf_thres=0.1, max_det=10)[0]
    assert det.shape == (10, 6)
    assert torch.allclose(det[:, 4], torch.linspace(0.3, 0.99, 50).flip(0)[:10])


def test_nms_max_nms_keeps_only_top_candidates() -> None:
    pred = _random_pred(3, batch=1, num_boxes=100, num_classes=2, num_masks=0)
    det = non_max_suppression(pred, conf_thres=0.0, iou_thres=1.0, max_nms=5)[0]
    all_conf = (pred[0, :, 5:] * pred[0, :, 4:5]).max(1).values
    assert torch.allclose(det[:, 4], all_conf.sort(descending=True).values[:5])


def test_nms_empty_and_invalid_thresholds() -> None:
    pred = torch.zeros(2, 10, 5 + 2 + 3)
    out = non_max_suppression(pred, conf_thres=0.5, num_masks=3)
    assert [o.shape for o in out] == [(0, 9), (0, 9)]
    with pytest.raises(ValueError, match="conf_thres"):
        non_max_suppression(pred, conf_thres=1.5)
    with pytest.raises(ValueError, match="iou_thres"):
        non_max_suppression(pred, iou_thres=-0.1)
    with pytest.raises(ValueError, match="max_det=-5 must be at least 1"):  # as a slice bound it would drop rows
        non_max_suppression(pred, max_det=-5)
    with pytest.raises(ValueError, match="max_det=0 must be at least 1"):
        top_detections(torch.zeros(2, 10, 4 + 2), max_det=0)


# ---------------------------------------------------------------- letterbox undo


@pytest.mark.parametrize("as_array", [torch.tensor, np.array])
def test_scale_boxes_undoes_letterbox(as_array) -> None:
    # 200x400 (h, w) letterboxed to 320x320: gain min(1.6, 0.8) = 0.8, content 160x320, pad_h (320-160)/2 = 80.
    boxes_orig = [[40.0, 20.0, 120.0, 100.0], [0.0, 0.0, 400.0, 200.0]]
    letterboxed = as_array([[32.0, 96.0, 96.0, 160.0], [0.0, 80.0, 320.0, 240.0]])
    out = scale_boxes(letterboxed, (320, 320), (200, 400))
    assert np.allclose(np.asarray(out), boxes_orig)
    assert np.allclose(np.asarray(letterboxed)[0], [32, 96, 96, 160])  # input untouched
    out_rp = scale_boxes(letterboxed, (320, 320), (200, 400), ratio_pad=((0.8, 0.8), (0.0, 80.0)))
    assert np.allclose(np.asarray(out_rp), boxes_orig)
    # a box reaching into the padding is clipped to the original image
    spill = scale_boxes(as_array([[-16.0, 40.0, 336.0, 300.0]]), (320, 320), (200, 400))
    assert np.allclose(np.asarray(spill), [[0, 0, 400, 200]])


@pytest.mark.parametrize("as_array", [torch.tensor, np.array])
def test_clip_boxes_in_place(as_array) -> None:
    boxes = as_array([[-5.0, 3.0, 70.0, 90.0], [10.0, -1.0, 20.0, 5.0]])
    result = clip_boxes(boxes, (50, 60))
    assert result is boxes
    assert np.allclose(np.asarray(boxes), [[0, 3, 60, 50], [10, 0, 20, 5]])


def test_nms_never_suppresses_across_classes_even_with_negative_corners() -> None:
    # Class 1's box lies at negative coordinates exactly where a shift by (max coordinate + 1) would
    # move it onto class 0's box; a per-class NMS must keep both.
    pred = torch.zeros(1, 2, 5 + 2)
    pred[0, 0, :5] = torch.tensor([50.0, 50.0, 100.0, 100.0, 1.0])  # class 0, x1y1x2y2 (0, 0, 100, 100)
    pred[0, 0, 5:] = torch.tensor([0.9, 0.0])
    pred[0, 1, :5] = torch.tensor([-51.0, -51.0, 100.0, 100.0, 1.0])  # class 1, (-101, -101, -1, -1)
    pred[0, 1, 5:] = torch.tensor([0.0, 0.8])
    [kept] = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45)
    assert sorted(kept[:, 5].tolist()) == [0.0, 1.0]
    [agnostic] = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45, agnostic=True)
    assert len(agnostic) == 2  # they do not overlap at all
