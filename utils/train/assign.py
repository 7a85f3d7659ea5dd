"""Task-aligned assignment (TOOD) of labels to anchor points, batched, in memory bounded for dense scenes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from utils.boxes import bbox_iou

# Elements of the (images x labels x points) tensors one pass builds; more labels are taken in chunks.
# About 6 bytes per element live at once (a bool mask, a float alignment): 16M elements stay near 100 MB,
# and one pass covers 16 images of 640 px (8,400 points) with up to 124 labels each, most real batches.
DEFAULT_MAX_ELEMENTS = 16 * 2**20
EPS = 1e-9


@dataclass(frozen=True)
class AlignOptions:
    """The assignment's knobs: TOOD's top-k and exponents, YOLOv10's one-to-one top-k2, the small-box floor.

    Each label takes its `topk` best-aligned candidate points (alignment = score^alpha x CIoU^beta, CIoU
    clamped at 0; a candidate of alignment 0 is not taken: its loss weight would be 0 anyway);
    `topk2` (< topk) then keeps only its best `topk2` after conflicts are settled (1: one-to-one).
    A label with no point inside its box (smaller than the grid spacing) looks for candidates in a box
    of at least `min_size_px` about its centre, so tiny objects still get one.
    """

    topk: int = 10
    topk2: int | None = None
    alpha: float = 0.5
    beta: float = 6.0
    min_size_px: float = 16.0
    max_elements: int = DEFAULT_MAX_ELEMENTS


@dataclass(frozen=True)
class Assignment:
    """Per point: whether it is foreground, which label (padded index) it learns, and its soft class target.

    `foreground` (B, N) bool; `label_index` (B, N) long (0 on background); `target_scores` (B, N, C)
    float, the assigned class's entry = the normalised alignment (the label's best CIoU where the
    alignment is highest), 0 elsewhere.
    """

    foreground: torch.Tensor
    label_index: torch.Tensor
    target_scores: torch.Tensor


@dataclass(frozen=True)
class _Pairs:
    """Candidate (image, label, point) pairs kept by the top-k, with their alignment and overlap."""

    image: torch.Tensor
    label: torch.Tensor
    point: torch.Tensor
    align: torch.Tensor
    overlap: torch.Tensor


def _inside(centre: torch.Tensor, half: torch.Tensor, points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, M, N) bool: point n lies strictly inside the box of centre (B, M, 2) and half size (B, M, 2).

    Four broadcast comparisons straight to booleans: no (B, M, N) float is ever built, which matters
    when thousands of labels meet 8,400 points.
    """
    low = (centre - half + EPS)[..., None, :]  # (B, M, 1, 2)
    high = (centre + half - EPS)[..., None, :]
    inside = valid[..., None].expand(-1, -1, len(points)).clone()
    for axis in range(2):
        coordinate = points[:, axis]
        inside &= coordinate > low[..., axis]
        inside &= coordinate < high[..., axis]
    return inside


def _candidates(
    label_boxes: torch.Tensor, label_valid: torch.Tensor, points: torch.Tensor, min_size: float
) -> torch.Tensor:
    """(B, M, N) bool: the points inside each label's box; for a label with none, those inside a `min_size` box.

    The fallback gives objects smaller than the grid spacing a candidate without adding points outside
    the boxes of labels that have their own (a point outside a box cannot express it as distances >= 0).
    """
    centre = (label_boxes[..., :2] + label_boxes[..., 2:]) / 2
    half = (label_boxes[..., 2:] - label_boxes[..., :2]) / 2
    inside = _inside(centre, half, points, label_valid)
    empty = ~inside.any(dim=-1) & label_valid
    if bool(empty.any()):
        grown = _inside(centre, half.clamp(min=min_size / 2), points, empty)
        inside |= grown
    return inside


def _top_pairs(
    scores: torch.Tensor,
    pred_boxes: torch.Tensor,
    points: torch.Tensor,
    labels: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    options: AlignOptions,
) -> _Pairs:
    """Each label's `topk` best-aligned candidate points, for labels `first`.. of the chunk given."""
    classes, boxes, valid = labels
    inside = _candidates(boxes, valid, points, options.min_size_px)
    image, label, point = inside.nonzero(as_tuple=True)
    overlap = bbox_iou(boxes[image, label], pred_boxes[image, point], xywh=False, kind="ciou").clamp(min=0)
    score = scores[image, point, classes[image, label]]
    align = score.pow(options.alpha) * overlap.pow(options.beta)
    dense = torch.full(inside.shape, -1.0, device=scores.device, dtype=align.dtype)
    dense[image, label, point] = align  # non-candidates at -1: ranked below every candidate
    top_align, top_point = dense.topk(min(options.topk, dense.shape[-1]), dim=-1)  # (B, Mc, k)
    keep = top_align > 0  # a candidate whose box misses the label (CIoU <= 0) has nothing to learn from it
    image, label, rank = keep.nonzero(as_tuple=True)
    point = top_point[image, label, rank]
    overlap = bbox_iou(boxes[image, label], pred_boxes[image, point], xywh=False, kind="ciou").clamp(min=0)
    return _Pairs(image, label + first, point, top_align[image, label, rank], overlap)


def _settle_conflicts(pairs: _Pairs, num_points: int) -> torch.Tensor:
    """(P,) bool: keep each point's pair with the largest overlap (the lowest label index on ties)."""
    key = pairs.image * num_points + pairs.point
    size = (int(key.max()) + 1) if len(key) else 0
    best = torch.full((size,), -1.0, device=key.device, dtype=pairs.overlap.dtype)
    best = best.scatter_reduce(0, key, pairs.overlap, "amax")
    winner = pairs.overlap == best[key]
    big = torch.iinfo(torch.int64).max
    lowest = torch.full((size,), big, device=key.device, dtype=torch.int64)
    lowest = lowest.scatter_reduce(0, key, torch.where(winner, pairs.label, big), "amin")
    return winner & (pairs.label == lowest[key])


def _best_per_label(pairs: _Pairs, num_labels: int, topk2: int) -> torch.Tensor:
    """(P,) bool: keep each label's `topk2` pairs of highest alignment (ties: earlier pairs)."""
    key = pairs.image * num_labels + pairs.label
    by_align = torch.sort(pairs.align, descending=True, stable=True).indices
    order = by_align[torch.sort(key[by_align], stable=True).indices]  # grouped by label, best first
    sorted_key = key[order]
    starts = torch.ones_like(sorted_key, dtype=torch.bool)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    position = torch.arange(len(order), device=key.device)
    group_start = torch.cummax(torch.where(starts, position, 0), dim=0).values
    keep = torch.zeros_like(key, dtype=torch.bool)
    keep[order] = (position - group_start) < topk2
    return keep


@torch.no_grad()
def assign(
    scores: torch.Tensor,
    pred_boxes: torch.Tensor,
    points: torch.Tensor,
    label_classes: torch.Tensor,
    label_boxes: torch.Tensor,
    label_valid: torch.Tensor,
    options: AlignOptions,
) -> Assignment:
    """Assign padded labels to points by task alignment (TOOD), one label per point.

    scores: (B, N, C) class probabilities; pred_boxes: (B, N, 4) xyxy and points (N, 2), both in
    input pixels; label_classes (B, M) long, label_boxes (B, M, 4) xyxy pixels, label_valid (B, M)
    bool (False on padding). Detached inputs; no gradient. Labels are taken `max_elements // (B x N)`
    at a time: each label's top-k is independent of the others, so chunks give exactly the result of
    one pass, and memory stays bounded with thousands of labels per image.
    """
    batch, num_points, num_classes = scores.shape
    num_labels = label_classes.shape[1]
    chunk = max(options.max_elements // max(batch * num_points, 1), 1)
    parts = [
        _top_pairs(
            scores,
            pred_boxes,
            points,
            (label_classes[:, i : i + chunk], label_boxes[:, i : i + chunk], label_valid[:, i : i + chunk]),
            i,
            options,
        )
        for i in range(0, num_labels, chunk)
    ]
    if parts:
        pairs = _Pairs(*(torch.cat(field) for field in zip(*(vars(p).values() for p in parts), strict=True)))
    else:  # a batch without labels
        empty = torch.zeros(0, dtype=torch.long, device=scores.device)
        pairs = _Pairs(empty, empty, empty, scores.new_zeros(0), scores.new_zeros(0))
    pairs = _select(pairs, _settle_conflicts(pairs, num_points))
    if options.topk2 is not None and options.topk2 < options.topk:
        pairs = _select(pairs, _best_per_label(pairs, num_labels, options.topk2))
    return _targets(pairs, label_classes, (batch, num_points, num_classes))


def _select(pairs: _Pairs, keep: torch.Tensor) -> _Pairs:
    return _Pairs(*(value[keep] for value in vars(pairs).values()))


def _targets(pairs: _Pairs, label_classes: torch.Tensor, shape: tuple[int, int, int]) -> Assignment:
    """Build the per-point targets from the final pairs (each point in at most one pair)."""
    batch, num_points, num_classes = shape
    num_labels = label_classes.shape[1]
    device = label_classes.device
    key = pairs.image * num_labels + pairs.label
    size = batch * num_labels
    max_align = pairs.align.new_zeros(size).scatter_reduce(0, key, pairs.align, "amax")
    max_overlap = pairs.overlap.new_zeros(size).scatter_reduce(0, key, pairs.overlap, "amax")
    quality = pairs.align / (max_align[key] + EPS) * max_overlap[key]
    foreground = torch.zeros(batch, num_points, dtype=torch.bool, device=device)
    label_index = torch.zeros(batch, num_points, dtype=torch.long, device=device)
    target_scores = torch.zeros(shape, dtype=pairs.align.dtype, device=device)
    foreground[pairs.image, pairs.point] = True
    label_index[pairs.image, pairs.point] = pairs.label
    target_scores[pairs.image, pairs.point, label_classes[pairs.image, pairs.label]] = quality
    return Assignment(foreground, label_index, target_scores)
