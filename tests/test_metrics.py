"""Tests for utils/eval/metrics.py: matching, COCO AP, per-class AP, DetectionMetrics and ConfusionMatrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from utils.boxes import box_iou
from utils.eval.metrics import (
    RECALL_LEVELS,
    ConfusionMatrix,
    DetectionMetrics,
    ap_per_class,
    compute_ap,
    iou_thresholds,
    match_predictions,
)


def test_iou_thresholds() -> None:
    thresholds = iou_thresholds()
    assert thresholds.shape == (10,)
    assert torch.allclose(thresholds, torch.tensor([0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]))


def test_match_predictions_duplicates_and_classes() -> None:
    true_classes = torch.tensor([0.0, 1.0])
    pred_classes = torch.tensor([0.0, 0.0, 1.0, 1.0])
    iou = torch.tensor(
        [
            [0.88, 0.70, 0.00, 0.95],  # label 0 (class 0)
            [0.00, 0.00, 0.62, 0.30],  # label 1 (class 1)
        ]
    )
    correct = match_predictions(pred_classes, true_classes, iou, iou_thresholds())
    assert correct.dtype == bool and correct.shape == (4, 10)
    expected = np.array(
        [
            [1, 1, 1, 1, 1, 1, 1, 1, 0, 0],  # IoU 0.88 passes 0.50..0.85
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # duplicate of label 0: label already taken by pred 0
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # IoU 0.62 passes 0.50..0.60
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # IoU 0.95 with label 0 but wrong class; 0.30 with label 1
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(correct, expected)


def test_match_predictions_takes_labels_in_confidence_order_like_cocoeval() -> None:
    # Pred 0 overlaps both labels (0.80, 0.75), pred 1 only label 0 (0.70). In confidence order pred 0
    # takes its best label (0); label 1 is then only reachable by pred 0, which is used: one TP.
    iou = np.array([[0.80, 0.70], [0.75, 0.0]])
    correct = match_predictions(np.zeros(2), np.zeros(2), iou, np.array([0.5]))
    np.testing.assert_array_equal(correct[:, 0], [True, False])
    # Above 0.80 no pair qualifies.
    np.testing.assert_array_equal(match_predictions(np.zeros(2), np.zeros(2), iou, np.array([0.81]))[:, 0], [0, 0])
    assert match_predictions(np.zeros(0), np.zeros(3), np.zeros((3, 0)), np.array([0.5])).shape == (0, 1)
    # A confident detection (IoU 0.6) and a less confident duplicate that fits better (IoU 0.9): COCOeval
    # gives the label to the confident one at 0.5 and 0.6 and to the duplicate only above 0.6.
    iou = np.array([[0.6, 0.9]])
    correct = match_predictions(
        np.zeros(2), np.zeros(1), iou, np.array([0.5, 0.6, 0.7]), pred_conf=np.array([0.9, 0.3])
    )
    np.testing.assert_array_equal(correct, [[True, True, False], [False, False, True]])
    # The same with the columns swapped: the order comes from pred_conf, not from the column order.
    swapped = match_predictions(np.zeros(2), np.zeros(1), iou[:, ::-1], np.array([0.5, 0.6, 0.7]), np.array([0.3, 0.9]))
    np.testing.assert_array_equal(swapped, correct[::-1])


def test_a_detection_tied_between_two_labels_takes_the_last_as_cocoeval_does() -> None:
    # Labels [0, 0, 10, 10] and [2, 0, 12, 10]; detection [1, 0, 11, 10] (conf 0.9) overlaps both by 9/11, a second
    # one [3, 0, 13, 10] (0.8) the second label by 9/11 and the first by 7/13. COCOeval gives the tie to the later
    # label, which leaves the second detection the first label's 7/13 (0.54): correct at IoU 0.5 only.
    iou = np.array([[9 / 11, 7 / 13], [9 / 11, 9 / 11]])
    correct = match_predictions(np.zeros(2), np.zeros(2), iou, np.array([0.5, 0.55, 0.6]), np.array([0.9, 0.8]))
    np.testing.assert_array_equal(correct, [[True, True, True], [True, False, False]])


def test_compute_ap_hand_example() -> None:
    # Detections by confidence: TP, TP, FP, TP with 4 labels.
    recall = np.array([0.25, 0.5, 0.5, 0.75])
    precision = np.array([1.0, 1.0, 2 / 3, 0.75])
    # Envelope: [1, 1, 0.75, 0.75]. Recall levels 0.00..0.25 (26 of them) read 1, 0.26..0.50 (25) read 1,
    # 0.51..0.75 (25) read 0.75, 0.76..1.00 (25) are beyond the curve and read 0:
    # AP = (26 + 25 + 25 * 0.75) / 101 = 69.75 / 101.
    assert compute_ap(recall, precision) == pytest.approx(69.75 / 101)
    # FP, TP, TP with 2 labels: recall [0, 0.5, 1], precision [0, 0.5, 2/3]. The envelope lifts every point
    # to 2/3 (better precision is reached later at higher recall), so all 101 levels read 2/3.
    assert compute_ap(np.array([0.0, 0.5, 1.0]), np.array([0.0, 0.5, 2 / 3])) == pytest.approx(2 / 3)
    assert compute_ap(np.array([1.0]), np.array([1.0])) == pytest.approx(1.0)
    assert compute_ap(np.zeros(0), np.zeros(0)) == 0.0


def _hand_stats() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Class 0: 4 labels, 4 predictions; class 1: 2 labels, no predictions; class 2: predictions only."""
    tp = np.zeros((5, 10), dtype=bool)
    tp[0, :] = True  # conf 0.9: TP at every threshold
    tp[1, :5] = True  # conf 0.8: TP at IoU 0.50..0.70 only
    tp[3, :5] = True  # conf 0.6: TP at IoU 0.50..0.70 only (conf 0.7 is always a FP)
    tp[4, :] = True  # class 2 has no labels: must be ignored however it is marked
    conf = np.array([0.9, 0.8, 0.7, 0.6, 0.95])
    pred_cls = np.array([0, 0, 0, 0, 2])
    target_cls = np.array([0, 0, 0, 0, 1, 1])
    return tp, conf, pred_cls, target_cls


# Class 0, IoU 0.50..0.70: TP TP FP TP of 4 labels -> 69.75 / 101 (test_compute_ap_hand_example).
# Class 0, IoU 0.75..0.95: TP FP FP FP -> recall stays 0.25, envelope 1 up to recall 0.25 -> 26 / 101.
AP_CLASS0 = np.array([69.75 / 101] * 5 + [26 / 101] * 5)


def test_ap_per_class_hand_example() -> None:
    tp, conf, pred_cls, target_cls = _hand_stats()
    order = np.random.default_rng(0).permutation(5)  # input order must not matter
    result = ap_per_class(tp[order], conf[order], pred_cls[order], target_cls)
    np.testing.assert_array_equal(result.class_ids, [0, 1])
    np.testing.assert_allclose(result.ap[0], AP_CLASS0)
    np.testing.assert_allclose(result.ap[1], np.zeros(10))  # labels, no predictions
    # Class 0 F1 at IoU 0.5 by confidence cut: all 4 kept p=r=3/4 -> 0.75; top 3 p=2/3 r=1/2 -> 4/7;
    # top 2 p=1 r=1/2 -> 2/3; top 1 -> 0.4. Class 1 is always 0, so keeping everything is best.
    np.testing.assert_allclose(result.p, [0.75, 0.0])
    np.testing.assert_allclose(result.r, [0.75, 0.0])
    np.testing.assert_allclose(result.f1, [0.75, 0.0])
    assert result.conf <= 0.6
    assert result.p_curve.shape == result.r_curve.shape == result.f1_curve.shape == (2, 1000)
    # between conf 0.7 and 0.8 only the two TPs are kept: precision 1, recall 0.5
    grid_index = int(np.searchsorted(result.curve_conf, 0.75))
    assert result.p_curve[0, grid_index] == pytest.approx(1.0)
    assert result.r_curve[0, grid_index] == pytest.approx(0.5)
    # PR curve at IoU 0.5 (class 0: TP TP FP TP of 4 labels): envelope 1 up to recall 0.5, 0.75 up
    # to 0.75, 0 beyond; its mean over the 101 recall levels is the AP50.
    pr = dict(zip(np.round(RECALL_LEVELS, 2).tolist(), result.pr_curve[0].tolist(), strict=True))
    assert (pr[0.3], pr[0.5], pr[0.6], pr[0.75], pr[0.8]) == (1.0, 1.0, 0.75, 0.75, 0.0)
    np.testing.assert_allclose(result.pr_curve.mean(1), result.ap[:, 0])
    assert not result.pr_curve[1].any()


def test_detection_metrics_from_stats_hand_example() -> None:
    tp, conf, pred_cls, target_cls = _hand_stats()
    metrics = DetectionMetrics.from_stats(torch.from_numpy(tp), conf, pred_cls, target_cls, num_classes=3)
    map50 = (69.75 / 101 + 0) / 2
    map50_95 = (AP_CLASS0.mean() + 0) / 2  # = (69.75 + 26) / 2 / 101 / 2
    assert metrics.map50 == pytest.approx(map50)
    assert metrics.map50_95 == pytest.approx(map50_95)
    assert metrics.fitness == pytest.approx(0.1 * map50 + 0.9 * map50_95)
    assert metrics.precision == pytest.approx(0.375)
    assert metrics.recall == pytest.approx(0.375)
    np.testing.assert_allclose(metrics.ap50, [69.75 / 101, 0])
    assert set(metrics.as_dict()) == {"precision", "recall", "mAP50", "mAP50-95", "fitness"}
    assert metrics.as_dict()["mAP50-95"] == pytest.approx(map50_95)
    with pytest.raises(ValueError, match="target_cls"):
        DetectionMetrics.from_stats(tp, conf, pred_cls, np.array([0, 5]), num_classes=3)


def test_perfect_predictions_give_ap_one() -> None:
    rng = np.random.default_rng(0)
    true_classes = rng.integers(0, 4, size=20).astype(np.float32)
    xy = rng.uniform(0, 500, size=(20, 2))
    boxes = torch.tensor(np.concatenate([xy, xy + rng.uniform(10, 50, size=(20, 2))], 1))
    iou = box_iou(boxes, boxes)  # predictions are exact copies of the labels
    tp = match_predictions(true_classes, true_classes, iou, iou_thresholds())
    assert tp.all()
    metrics = DetectionMetrics.from_stats(tp, rng.uniform(0.3, 1, size=20), true_classes, true_classes, 4)
    assert metrics.map50 == pytest.approx(1.0)
    assert metrics.map50_95 == pytest.approx(1.0)
    assert metrics.precision == pytest.approx(1.0)
    assert metrics.recall == pytest.approx(1.0)
    np.testing.assert_allclose(metrics.ap, np.ones(len(np.unique(true_classes))))


def test_metrics_without_labels_or_predictions() -> None:
    empty = DetectionMetrics.from_stats(np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.zeros(0), 3)
    assert empty.as_dict() == {"precision": 0.0, "recall": 0.0, "mAP50": 0.0, "mAP50-95": 0.0, "fitness": 0.0}
    missed = ap_per_class(np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.array([1, 1]))
    np.testing.assert_array_equal(missed.ap, np.zeros((1, 10)))


def test_confusion_matrix_hand_case() -> None:
    cm = ConfusionMatrix(num_classes=2, conf=0.25, iou_thres=0.45)
    labels = torch.tensor(
        [
            [0, 0, 0, 10, 10],  # L0 class 0
            [1, 20, 20, 30, 30],  # L1 class 1
            [1, 50, 50, 60, 60],  # L2 class 1, never detected
        ],
        dtype=torch.float32,
    )
    detections = torch.tensor(
        [
            [0, 0, 10, 10, 0.9, 0],  # IoU 1.0 with L0, right class
            [20, 20, 30, 31, 0.8, 0],  # IoU 100/110 with L1, wrong class -> confusion 0 vs 1
            [0, 0, 10, 9, 0.7, 0],  # IoU 0.9 with L0 but L0 already taken -> background FP
            [80, 80, 90, 90, 0.1, 1],  # below conf 0.25 -> ignored
        ]
    )
    cm.update(detections, labels)
    expected = np.array(
        [
            [1, 1, 1],  # predicted class 0: true 0, true 1, background
            [0, 0, 0],  # predicted class 1
            [0, 1, 0],  # missed: L2 (class 1)
        ]
    )
    np.testing.assert_array_equal(cm.matrix, expected)
    tp, fp = cm.tp_fp()
    np.testing.assert_array_equal(tp, [1, 0])
    np.testing.assert_array_equal(fp, [2, 0])

    cm.update(np.zeros((0, 6)), np.array([[0, 1, 1, 5, 5]]))  # no detections: a missed class-0 label
    cm.update(np.array([[1, 1, 5, 5, 0.5, 1]]), np.zeros((0, 5)))  # no labels: a class-1 false positive
    expected[2, 0] += 1
    expected[1, 2] += 1
    np.testing.assert_array_equal(cm.matrix, expected)

    text = cm.summary(["cat", "dog"])
    lines = text.splitlines()
    assert len(lines) == 4 and "background" in lines[0] and lines[1].split() == ["cat", "1", "1", "1"]
    with pytest.raises(ValueError, match="names"):
        cm.summary(["cat"])
