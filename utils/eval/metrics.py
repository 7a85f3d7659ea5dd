"""Detection metrics: prediction matching, COCO-style AP per class, mAP/fitness and the confusion matrix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from utils.boxes import box_iou

# COCO evaluates precision at these recall levels (pycocotools builds them the same way).
RECALL_LEVELS = np.linspace(0.0, 1.0, 101)
# Confidence grid on which the precision / recall / F1 curves are sampled.
CONF_GRID = np.linspace(0.0, 1.0, 1000)


def iou_thresholds() -> torch.Tensor:
    """Return the ten COCO IoU thresholds 0.50, 0.55, ..., 0.95 as a float tensor `(10,)`."""
    return torch.linspace(0.5, 0.95, 10)


def _to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Return `x` as a numpy array (detached, on CPU)."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _greedy_pairs(iou: np.ndarray, allowed: np.ndarray) -> list[tuple[int, int]]:
    """Pair rows with columns one-to-one, highest IoU first, among the `allowed` entries of `iou`.

    Returns the chosen (row, col) pairs in the order they were taken (IoU descending; ties keep
    row-major order so the result is deterministic).
    """
    rows, cols = np.nonzero(allowed)
    order = np.argsort(-iou[rows, cols], kind="stable")
    used_rows: set[int] = set()
    used_cols: set[int] = set()
    pairs = []
    for r, c in zip(rows[order].tolist(), cols[order].tolist(), strict=True):
        if r not in used_rows and c not in used_cols:
            used_rows.add(r)
            used_cols.add(c)
            pairs.append((r, c))
    return pairs


def match_predictions(
    pred_classes: torch.Tensor | np.ndarray,
    true_classes: torch.Tensor | np.ndarray,
    iou: torch.Tensor | np.ndarray,
    thresholds: torch.Tensor | np.ndarray,
    pred_conf: torch.Tensor | np.ndarray | None = None,
) -> np.ndarray:
    """Mark which predictions are true positives at each IoU threshold, matching as pycocotools does.

    `pred_classes (n_pred,)`, `true_classes (n_true,)`, `iou (n_true, n_pred)`, `thresholds (t,)`,
    `pred_conf (n_pred,)` (None: the predictions are already in descending confidence, as NMS
    returns them). For every threshold, predictions in descending confidence each take the
    unmatched label of their class with the highest IoU >= threshold, so a label is never counted
    twice and a lower-confidence duplicate becomes a false positive even when it overlaps the
    label better (YOLOv5 pairs by highest IoU instead, which can hand the label to the duplicate).
    Returns a bool numpy array `(n_pred, t)`.
    """
    pred_classes, true_classes = _to_numpy(pred_classes), _to_numpy(true_classes)
    iou, thresholds = _to_numpy(iou).astype(np.float64), _to_numpy(thresholds).astype(np.float64)
    correct = np.zeros((len(pred_classes), len(thresholds)), dtype=bool)
    if iou.size == 0:
        return correct
    candidates = np.where(true_classes[:, None] == pred_classes[None, :], iou, -1.0)  # (n_true, n_pred)
    order = np.arange(len(pred_classes)) if pred_conf is None else np.argsort(-_to_numpy(pred_conf), kind="stable")
    # Only predictions that reach the lowest threshold with some label can ever match.
    order = order[candidates[:, order].max(axis=0) >= thresholds.min()]
    available = np.ones((len(true_classes), len(thresholds)), dtype=bool)  # label still free, per threshold
    columns = np.arange(len(thresholds))
    for pred_index in order.tolist():
        ious = np.where(available, candidates[:, pred_index, None], -1.0)  # (n_true, t)
        best = len(ious) - 1 - ious[::-1].argmax(axis=0)  # ties to the last label, as COCOeval breaks them
        matched = ious[best, columns] >= thresholds
        available[best[matched], columns[matched]] = False
        correct[pred_index] = matched
    return correct


def compute_ap(recall: np.ndarray, precision: np.ndarray) -> float:
    """Return the average precision of one precision/recall curve with COCO 101-point interpolation.

    `recall` and `precision` `(n,)` are the cumulative values after each detection in descending
    confidence order. Precision is first replaced by its envelope (the best precision at any
    higher recall), then read at recall 0, 0.01, ..., 1 (0 beyond the highest recall reached) and
    averaged, as pycocotools does.
    """
    return float(interpolated_precision(recall, precision).mean())


def interpolated_precision(recall: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """Return the precision envelope of one curve read at `RECALL_LEVELS` `(101,)` (see `compute_ap`)."""
    recall, precision = np.asarray(recall, dtype=np.float64), np.asarray(precision, dtype=np.float64)
    sampled = np.zeros_like(RECALL_LEVELS)
    if recall.size == 0:
        return sampled
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    index = np.searchsorted(recall, RECALL_LEVELS, side="left")
    reached = index < len(recall)
    sampled[reached] = envelope[index[reached]]
    return sampled


@dataclass(frozen=True, eq=False)
class APResult:
    """Per-class detection quality from `ap_per_class`, one row per class that has labels.

    `class_ids (nc,)` int; `p`, `r`, `f1 (nc,)` at the single confidence `conf` that maximises the
    mean F1 over classes; `ap (nc, 10)` at IoU 0.50:0.95. The curves `(nc, 1000)` are precision,
    recall and F1 against the confidence threshold `curve_conf (1000,)`; `pr_curve (nc, 101)` is
    the interpolated precision at IoU 0.5 read at `RECALL_LEVELS` (its row mean is the AP50).
    """

    class_ids: np.ndarray
    p: np.ndarray
    r: np.ndarray
    f1: np.ndarray
    ap: np.ndarray
    conf: float
    curve_conf: np.ndarray
    p_curve: np.ndarray
    r_curve: np.ndarray
    f1_curve: np.ndarray
    pr_curve: np.ndarray


def _class_curves(
    tp_sorted: np.ndarray, conf_sorted: np.ndarray, num_labels: int, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (ap (10,), precision (1000,), recall (1000,), pr (101,)) for one class's sorted predictions.

    The curves hold, for each threshold t of `CONF_GRID`, the precision and recall of the
    predictions with conf >= t at IoU 0.5 (precision 0 where no prediction passes); `pr` is the
    interpolated precision at IoU 0.5 against `RECALL_LEVELS`.
    """
    tp_cum = np.cumsum(tp_sorted, axis=0, dtype=np.float64)
    fp_cum = np.cumsum(~tp_sorted, axis=0, dtype=np.float64)
    recall = tp_cum / (num_labels + eps)
    precision = tp_cum / (tp_cum + fp_cum)
    ap = np.array([compute_ap(recall[:, k], precision[:, k]) for k in range(tp_sorted.shape[1])])
    passed = np.searchsorted(-conf_sorted, -CONF_GRID, side="right")  # count of conf >= t
    has_any = passed > 0
    p_curve, r_curve = np.zeros_like(CONF_GRID), np.zeros_like(CONF_GRID)
    p_curve[has_any] = precision[passed[has_any] - 1, 0]
    r_curve[has_any] = recall[passed[has_any] - 1, 0]
    return ap, p_curve, r_curve, interpolated_precision(recall[:, 0], precision[:, 0])


def ap_per_class(
    tp: torch.Tensor | np.ndarray,
    conf: torch.Tensor | np.ndarray,
    pred_cls: torch.Tensor | np.ndarray,
    target_cls: torch.Tensor | np.ndarray,
    eps: float = 1e-16,
) -> APResult:
    """Compute AP, precision, recall and F1 for each class that has at least one label.

    `tp (n, 10)` bool from `match_predictions` over the whole dataset, `conf (n,)`, `pred_cls (n,)`,
    `target_cls (m,)` (one entry per label). Classes with labels but no predictions get AP 0;
    predictions of classes without labels are ignored (they cannot be scored). p/r/f1 are exact
    counts at the grid confidence maximising mean F1 over classes (no smoothing).
    """
    tp, conf = _to_numpy(tp).astype(bool), _to_numpy(conf).astype(np.float64)
    if tp.ndim == 1:  # a single IoU threshold
        tp = tp[:, None]
    pred_cls, target_cls = _to_numpy(pred_cls), _to_numpy(target_cls)
    order = np.argsort(-conf, kind="stable")
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]
    class_ids, num_labels = np.unique(target_cls, return_counts=True)
    ap = np.zeros((len(class_ids), tp.shape[1]))
    p_curve = np.zeros((len(class_ids), len(CONF_GRID)))
    r_curve = np.zeros_like(p_curve)
    pr_curve = np.zeros((len(class_ids), len(RECALL_LEVELS)))
    for i, (c, n_l) in enumerate(zip(class_ids, num_labels, strict=True)):
        mine = pred_cls == c
        if mine.any():
            ap[i], p_curve[i], r_curve[i], pr_curve[i] = _class_curves(tp[mine], conf[mine], int(n_l), eps)
    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    best = int(f1_curve.mean(0).argmax()) if len(class_ids) else 0
    return APResult(
        class_ids=class_ids.astype(np.int64),
        p=p_curve[:, best],
        r=r_curve[:, best],
        f1=f1_curve[:, best],
        ap=ap,
        conf=float(CONF_GRID[best]),
        curve_conf=CONF_GRID,
        p_curve=p_curve,
        r_curve=r_curve,
        f1_curve=f1_curve,
        pr_curve=pr_curve,
    )


@dataclass(frozen=True, eq=False)
class DetectionMetrics:
    """Dataset-level detection scores plus per-class AP, as reported after validation.

    `precision`/`recall` are means over classes with labels at the best-F1 confidence; `map50`
    is mean AP at IoU 0.5, `map50_95` mean AP over IoU 0.50:0.95, and `fitness` =
    0.1 * map50 + 0.9 * map50_95 (the model-selection score). `ap50`/`ap (nc_present,)` are
    aligned with `class_ids`; `curves` keeps the per-class curves for plotting.
    """

    precision: float
    recall: float
    map50: float
    map50_95: float
    fitness: float
    class_ids: np.ndarray
    ap50: np.ndarray
    ap: np.ndarray
    class_precision: np.ndarray
    class_recall: np.ndarray
    curves: APResult | None = None

    @classmethod
    def from_stats(
        cls,
        tp: torch.Tensor | np.ndarray,
        conf: torch.Tensor | np.ndarray,
        pred_cls: torch.Tensor | np.ndarray,
        target_cls: torch.Tensor | np.ndarray,
        num_classes: int,
    ) -> DetectionMetrics:
        """Build the metrics from concatenated per-prediction stats (see `ap_per_class`).

        Raises ValueError when a class id lies outside [0, num_classes).
        """
        pred_cls, target_cls = _to_numpy(pred_cls), _to_numpy(target_cls)
        for name, ids in (("pred_cls", pred_cls), ("target_cls", target_cls)):
            if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
                raise ValueError(f"DetectionMetrics: {name} has class ids outside [0, {num_classes})")
        result = ap_per_class(tp, conf, pred_cls, target_cls)
        if len(result.class_ids) == 0:
            empty = np.zeros(0)
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, result.class_ids, empty, empty, empty, empty)
        ap50, ap = result.ap[:, 0], result.ap.mean(1)
        map50, map50_95 = float(ap50.mean()), float(ap.mean())
        return cls(
            precision=float(result.p.mean()),
            recall=float(result.r.mean()),
            map50=map50,
            map50_95=map50_95,
            fitness=0.1 * map50 + 0.9 * map50_95,
            class_ids=result.class_ids,
            ap50=ap50,
            ap=ap,
            class_precision=result.p,
            class_recall=result.r,
            curves=result,
        )

    def as_dict(self) -> dict[str, float]:
        """Return the scalar scores under the names used in logs and results CSVs."""
        return {
            "precision": self.precision,
            "recall": self.recall,
            "mAP50": self.map50,
            "mAP50-95": self.map50_95,
            "fitness": self.fitness,
        }


class ConfusionMatrix:
    """Accumulates a detection confusion matrix `(nc + 1, nc + 1)` over validation images.

    `matrix[predicted, true]`; index `nc` is background: row `nc` counts missed labels, column
    `nc` counts detections that matched no label. Detections with conf <= `conf` are ignored;
    a detection and a label match (class-agnostically, one-to-one, highest IoU first) when their
    IoU exceeds `iou_thres`.
    """

    def __init__(self, num_classes: int, conf: float = 0.25, iou_thres: float = 0.45) -> None:
        self.num_classes = num_classes
        self.conf = conf
        self.iou_thres = iou_thres
        self.matrix = np.zeros((num_classes + 1, num_classes + 1), dtype=np.int64)

    def update(self, detections: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> None:
        """Add one image: `detections (n, 6)` [x1, y1, x2, y2, conf, cls], `labels (m, 5)` [cls, x1, y1, x2, y2]."""
        detections = torch.as_tensor(_to_numpy(detections), dtype=torch.float64).reshape(-1, 6)
        labels = torch.as_tensor(_to_numpy(labels), dtype=torch.float64).reshape(-1, 5)
        detections = detections[detections[:, 4] > self.conf]
        det_cls = detections[:, 5].long().tolist()
        true_cls = labels[:, 0].long().tolist()
        background = self.num_classes
        iou = box_iou(labels[:, 1:], detections[:, :4]).numpy()
        pairs = _greedy_pairs(iou, iou > self.iou_thres)
        for label_index, det_index in pairs:
            self.matrix[det_cls[det_index], true_cls[label_index]] += 1
        matched_labels = {label_index for label_index, _ in pairs}
        matched_dets = {det_index for _, det_index in pairs}
        for label_index, c in enumerate(true_cls):
            if label_index not in matched_labels:
                self.matrix[background, c] += 1
        for det_index, c in enumerate(det_cls):
            if det_index not in matched_dets:
                self.matrix[c, background] += 1

    def tp_fp(self) -> tuple[np.ndarray, np.ndarray]:
        """Return per-class true positives and false positives `(nc,)` each (background excluded)."""
        tp = self.matrix.diagonal()[: self.num_classes]
        fp = self.matrix.sum(1)[: self.num_classes] - tp
        return tp, fp

    def summary(self, names: list[str] | None = None) -> str:
        """Return the matrix as an aligned text table: rows predicted class, columns true class."""
        labels = list(names) if names is not None else [str(i) for i in range(self.num_classes)]
        if len(labels) != self.num_classes:
            raise ValueError(f"ConfusionMatrix.summary: got {len(labels)} names for {self.num_classes} classes")
        labels.append("background")
        width = max(max(len(s) for s in labels), len(str(self.matrix.max())), len("pred\\true"))
        lines = [" ".join(s.rjust(width) for s in ["pred\\true", *labels])]
        for name, row in zip(labels, self.matrix.tolist(), strict=True):
            lines.append(" ".join(s.rjust(width) for s in [name, *map(str, row)]))
        return "\n".join(lines)
