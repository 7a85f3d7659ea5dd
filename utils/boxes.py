"""Box geometry: format conversions, the IoU family, non-maximum suppression and letterbox undo."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)

IOU_KINDS = ("iou", "giou", "diou", "ciou")


def _empty_like(x: ArrayT) -> ArrayT:
    """Return an uninitialised array/tensor of the same shape, dtype and device as `x`."""
    return torch.empty_like(x) if isinstance(x, torch.Tensor) else np.empty_like(x)


def xyxy_to_xywh(x: ArrayT) -> ArrayT:
    """Convert corner boxes `(..., 4)` [x1, y1, x2, y2] to centre boxes [cx, cy, w, h] (same units).

    Works on torch tensors and numpy arrays; returns a new object of the same kind.
    """
    y = _empty_like(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2
    y[..., 2] = x[..., 2] - x[..., 0]
    y[..., 3] = x[..., 3] - x[..., 1]
    return y


def xywh_to_xyxy(x: ArrayT) -> ArrayT:
    """Convert centre boxes `(..., 4)` [cx, cy, w, h] to corner boxes [x1, y1, x2, y2] (same units).

    Works on torch tensors and numpy arrays; returns a new object of the same kind. Four operations on
    (x, y) pairs, not ten on single columns: the training losses call it every step, where each
    operation is a kernel launch on a GPU.
    """
    centre, half = x[..., :2], x[..., 2:4] / 2
    concatenate = torch.cat if isinstance(x, torch.Tensor) else np.concatenate
    return concatenate((centre - half, centre + half), -1)


def xywhn_to_xyxy(x: ArrayT, w: float, h: float, padw: float = 0.0, padh: float = 0.0) -> ArrayT:
    """Convert normalised centre boxes `(..., 4)` to pixel corner boxes in a `w` x `h` image.

    `padw`/`padh` are added afterwards, e.g. the letterbox border or a mosaic tile offset.
    """
    y = _empty_like(x)
    y[..., 0] = w * (x[..., 0] - x[..., 2] / 2) + padw
    y[..., 1] = h * (x[..., 1] - x[..., 3] / 2) + padh
    y[..., 2] = w * (x[..., 0] + x[..., 2] / 2) + padw
    y[..., 3] = h * (x[..., 1] + x[..., 3] / 2) + padh
    return y


def xyxy_to_xywhn(x: ArrayT, w: float, h: float, clip: bool = False) -> ArrayT:
    """Convert pixel corner boxes `(..., 4)` in a `w` x `h` image to normalised centre boxes.

    With `clip`, corners are first clipped to the image (on a copy; the input is left untouched),
    so every output value lies in [0, 1].
    """
    if clip:
        x = clip_boxes(x.clone() if isinstance(x, torch.Tensor) else x.copy(), (h, w))
    y = xyxy_to_xywh(x)
    y[..., 0] /= w
    y[..., 2] /= w
    y[..., 1] /= h
    y[..., 3] /= h
    return y


def clip_boxes(boxes: ArrayT, hw: Sequence[float]) -> ArrayT:
    """Clip corner boxes `(..., 4)` xyxy in place to an image of size `hw` = (height, width); returns `boxes`."""
    height, width = float(hw[0]), float(hw[1])
    if isinstance(boxes, torch.Tensor):
        boxes[..., 0].clamp_(0, width)
        boxes[..., 1].clamp_(0, height)
        boxes[..., 2].clamp_(0, width)
        boxes[..., 3].clamp_(0, height)
    else:
        boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, width)
        boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, height)
    return boxes


def scale_boxes(
    boxes_xyxy: ArrayT,
    from_hw: Sequence[float],
    orig_hw: Sequence[float],
    ratio_pad: tuple[tuple[float, float], tuple[float, float]] | None = None,
) -> ArrayT:
    """Map xyxy boxes from a letterboxed image of size `from_hw` back to the original image `orig_hw`.

    Undoes the letterbox: subtract the left/top pad, divide by the resize gain, clip to the original
    image. `ratio_pad` is the dataset's `((ratio_h, ratio_w), (pad_w, pad_h))` (see `ShapeInfo` in
    docs/CONTRACTS.md); without it a centred letterbox with one gain is assumed and recomputed from
    the two sizes. Returns a new array/tensor; the input is not modified.
    """
    if ratio_pad is None:
        gain = min(from_hw[0] / orig_hw[0], from_hw[1] / orig_hw[1])
        gain_h = gain_w = gain
        pad_w = (from_hw[1] - orig_hw[1] * gain) / 2
        pad_h = (from_hw[0] - orig_hw[0] * gain) / 2
    else:
        (gain_h, gain_w), (pad_w, pad_h) = ratio_pad
    out = boxes_xyxy.clone() if isinstance(boxes_xyxy, torch.Tensor) else boxes_xyxy.copy()
    out[..., [0, 2]] = (out[..., [0, 2]] - pad_w) / gain_w
    out[..., [1, 3]] = (out[..., [1, 3]] - pad_h) / gain_h
    return clip_boxes(out, orig_hw)


def load_nms() -> None:
    """Import torchvision, NMS's kernels, now: code that times NMS calls it first, so no timing holds the import."""
    import torchvision  # noqa: F401  (imported at first use by non_max_suppression and box_iou)


def box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor) -> torch.Tensor:
    """Return the pairwise IoU matrix `(N, M)` of xyxy boxes `(N, 4)` and `(M, 4)` (torchvision)."""
    import torchvision  # on first use, as in non_max_suppression

    return torchvision.ops.box_iou(boxes1, boxes2)


def bbox_iou(
    box1: torch.Tensor,
    box2: torch.Tensor,
    xywh: bool = True,
    kind: str = "ciou",
    eps: float = 1e-7,
) -> torch.Tensor:
    """Return the elementwise IoU, GIoU, DIoU or CIoU of two aligned box sets `(..., 4)` -> `(...)`.

    Used by the box regression loss, so it must stay differentiable and finite even for zero-size
    boxes: every division carries `eps` (torchvision's CIoU loss divides w/h unguarded, hence this
    own version). Boxes are xywh when `xywh`, else xyxy. CIoU follows Zheng et al. (2020):
    IoU - rho^2/c^2 - alpha*v with v the aspect-ratio term and alpha treated as a constant
    (computed without gradient).
    """
    if kind not in IOU_KINDS:
        raise ValueError(f"bbox_iou: kind={kind!r} is not one of {IOU_KINDS}")
    if xywh:
        box1, box2 = xywh_to_xyxy(box1), xywh_to_xyxy(box2)
    # Corners as (x, y) pairs: each step below is one operation on both coordinates.
    low1, high1 = box1.unflatten(-1, (2, 2)).unbind(-2)
    low2, high2 = box2.unflatten(-1, (2, 2)).unbind(-2)
    w1, h1 = (high1 - low1).unbind(-1)
    w2, h2 = (high2 - low2).unbind(-1)
    inter_w, inter_h = (torch.minimum(high1, high2) - torch.maximum(low1, low2)).clamp(min=0).unbind(-1)
    inter = inter_w * inter_h
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if kind == "iou":
        return iou

    # Smallest enclosing box.
    enclose_w, enclose_h = (torch.maximum(high1, high2) - torch.minimum(low1, low2)).unbind(-1)
    if kind == "giou":
        enclose_area = enclose_w * enclose_h + eps
        return iou - (enclose_area - union) / enclose_area

    diag2 = enclose_w**2 + enclose_h**2 + eps  # c^2
    dx, dy = (low2 + high2 - low1 - high1).unbind(-1)
    centre_dist2 = (dx**2 + dy**2) / 4  # rho^2
    if kind == "diou":
        return iou - centre_dist2 / diag2

    v = (4 / math.pi**2) * (torch.atan(w2 / (h2 + eps)) - torch.atan(w1 / (h1 + eps))) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (centre_dist2 / diag2 + alpha * v)


def _check_fraction(name: str, value: float) -> None:
    """Raise a one-line ValueError unless `value` lies in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"non_max_suppression: {name}={value} must be in [0, 1]")


def _check_max_det(max_det: int) -> None:
    """Raise a one-line ValueError for a `max_det` below 1 (as a slice bound it would drop detections silently)."""
    if max_det < 1:
        raise ValueError(f"non_max_suppression: max_det={max_det} must be at least 1")


def _batch_candidates(
    pred: torch.Tensor,
    num_classes: int,
    conf_thres: float,
    classes: list[int] | None,
    multi_label: bool,
    objectness: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a batch's rows `(B, N, 4+[1]+nc+nm)` into candidates `(n, 6+nm)` xyxy, conf, cls, coeffs and their images.

    The whole batch in one pass, so a GPU is read once per batch, not per image. Candidates come in
    (image, row, class) order, exactly as a per-image pass lists them. Returns (candidates, image (n,) long).
    """
    first_class = 5 if objectness else 4
    scores = pred[..., first_class : first_class + num_classes]
    if objectness:
        # obj * cls <= obj (cls <= 1), so this keeps exactly the rows an objectness cut > conf_thres would.
        scores = scores * pred[..., 4:5]
    if multi_label:
        image, row, cls = (scores > conf_thres).nonzero(as_tuple=True)
        conf = scores[image, row, cls]
    else:
        best, best_cls = scores.max(-1)
        image, row = (best > conf_thres).nonzero(as_tuple=True)
        conf, cls = best[image, row], best_cls[image, row]
    rows = pred[image, row]
    out = torch.cat(
        (xywh_to_xyxy(rows[:, :4]), conf[:, None], cls[:, None].to(pred.dtype), rows[:, first_class + num_classes :]), 1
    )
    if classes is not None:
        wanted = (out[:, 5:6] == torch.tensor(classes, device=pred.device, dtype=pred.dtype)).any(1)
        out, image = out[wanted], image[wanted]
    return out, image


def non_max_suppression(
    pred: torch.Tensor,
    conf_thres: float = 0.001,
    iou_thres: float = 0.6,
    classes: list[int] | None = None,
    agnostic: bool = False,
    max_det: int = 300,
    num_masks: int = 0,
    multi_label: bool = False,
    max_nms: int = 30000,
    objectness: bool = True,
) -> list[torch.Tensor]:
    """Filter decoded predictions by confidence and suppress overlaps, per image.

    `pred`: `(B, N, 5 + nc + nm)` rows [cx, cy, w, h (pixels), obj, class probs..., mask coeffs...]
    as given by the model in eval mode. Confidence is obj * class prob and must exceed `conf_thres`.
    Without `objectness` (anchor-free heads) rows are `(B, N, 4 + nc + nm)` and the class probability
    is the confidence.
    With `multi_label` a box may appear once per class above threshold, otherwise only with its
    best class. NMS is per class (classes shifted apart by the coordinate span) unless `agnostic`. At most `max_nms`
    highest-confidence candidates enter NMS and `max_det` leave it.

    Returns B tensors `(n, 6 + nm)` [x1, y1, x2, y2, conf, cls, coeffs...] sorted by conf descending.
    Raises ValueError when a threshold is outside [0, 1].
    """
    _check_fraction("conf_thres", conf_thres)
    _check_fraction("iou_thres", iou_thres)
    _check_max_det(max_det)
    num_classes = pred.shape[2] - (5 if objectness else 4) - num_masks
    if num_classes < 1:
        raise ValueError(f"non_max_suppression: pred has {pred.shape[2]} columns, too few for {num_masks} masks")
    candidates, image = _batch_candidates(pred, num_classes, conf_thres, classes, multi_label, objectness)
    # Imported here, not at the top: importing torchvision (its models, ops and C extension) costs a training
    # process about 0.3 s of CPU before its first step, and training needs it only to validate.
    import torchvision

    counts = torch.bincount(image, minlength=len(pred)).tolist()  # the one host read before NMS, for the batch
    output = []
    for det in candidates.split(counts):
        det = det[det[:, 4].argsort(descending=True)[:max_nms]]
        dtype = torch.float32 if det.dtype in (torch.float16, torch.bfloat16) else det.dtype  # offsets overflow fp16
        boxes = det[:, :4].to(dtype)
        if not agnostic and len(det):
            # Per-class NMS in one call: shift each class by the whole coordinate span, so boxes of two classes
            # can never overlap. torchvision's batched_nms shifts by max + 1 only, which lets boxes with
            # negative corners (decoded boxes are not clipped) reach the next class and suppress it.
            boxes = boxes + det[:, 5:6].to(dtype) * (boxes.max() - boxes.min() + 1)
        keep = torchvision.ops.nms(boxes, det[:, 4].to(dtype), iou_thres)
        output.append(det[keep[:max_det]])  # torchvision returns keep sorted by score, descending
    return output


def top_detections(
    pred: torch.Tensor,
    conf_thres: float = 0.001,
    iou_thres: float = 0.6,
    classes: list[int] | None = None,
    agnostic: bool = False,
    max_det: int = 300,
    num_masks: int = 0,
    multi_label: bool = False,
    max_nms: int = 30000,
) -> list[torch.Tensor]:
    """Select detections from an end-to-end (one-to-one) head: the best `max_det` scores, no suppression.

    `pred`: (B, N, 4 + nc + nm) rows [cx, cy, w, h (pixels), class probabilities, mask coefficients].
    A head trained one-to-one predicts each object once, so the highest (point, class) scores are the
    detections; `iou_thres`, `agnostic` and `max_nms` are accepted for the NMS signature and unused.
    With `multi_label` a point may give one row per class, otherwise only its best class.
    Returns B tensors (n, 6 + nm) [x1, y1, x2, y2, conf, cls, coeffs...], conf descending.
    """
    _check_fraction("conf_thres", conf_thres)
    _check_max_det(max_det)
    num_classes = pred.shape[2] - 4 - num_masks
    if num_classes < 1:
        raise ValueError(f"top_detections: pred has {pred.shape[2]} columns, too few for {num_masks} masks")
    output = []
    for x in pred:
        scores = x[:, 4 : 4 + num_classes]
        if classes is not None:
            allowed = torch.zeros(num_classes, dtype=torch.bool, device=x.device)
            allowed[torch.tensor(classes, device=x.device)] = True
            scores = scores.masked_fill(~allowed, 0)
        if multi_label:
            conf, flat = scores.flatten().topk(min(max_det, scores.numel()))
            rows, cls = flat // num_classes, flat % num_classes
        else:
            best, best_cls = scores.max(1)
            conf, rows = best.topk(min(max_det, len(best)))
            cls = best_cls[rows]
        keep = conf > conf_thres
        rows, conf, cls = rows[keep], conf[keep], cls[keep]
        boxes = xywh_to_xyxy(x[rows, :4])
        output.append(torch.cat((boxes, conf[:, None], cls[:, None].to(x.dtype), x[rows, 4 + num_classes :]), 1))
    return output


def best_detections(decoded: torch.Tensor, num_classes: int, max_det: int = 300) -> torch.Tensor:
    """An end-to-end head's final detections as one traceable tensor (what its exported file outputs).

    decoded: (B, N, 4 + nc + nm) rows [cx, cy, w, h, class probabilities, mask coefficients]. Returns
    (B, max_det, 6 + nm) [x1, y1, x2, y2, score, class, coeffs...]: the max_det best (point, class)
    scores, best first; no threshold (consumers apply theirs), no NMS. When the image has fewer than
    max_det (point, class) pairs, the last rows are padding (zero box, score and coefficients): the
    shape never depends on the input's size, so a traced file runs at any size (a traced
    k = min(max_det, N x nc) would be frozen at the traced size and fail on smaller inputs).
    """
    padding_points = -(-max_det // num_classes)  # enough zero rows for max_det pairs on their own
    decoded = torch.cat((decoded, decoded.new_zeros((decoded.shape[0], padding_points, decoded.shape[2]))), 1)
    scores = decoded[..., 4 : 4 + num_classes]
    best, flat_index = scores.flatten(1).topk(max_det, dim=1)
    point = torch.div(flat_index, num_classes, rounding_mode="floor")
    rows = decoded.gather(1, point.unsqueeze(-1).expand(-1, -1, decoded.shape[-1]))
    classes = (flat_index - point * num_classes).to(decoded.dtype)
    boxes = xywh_to_xyxy(rows[..., :4])
    return torch.cat((boxes, best.unsqueeze(-1), classes.unsqueeze(-1), rows[..., 4 + num_classes :]), dim=-1)
