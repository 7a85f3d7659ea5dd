"""Task-aligned assignment (TOOD) of labels to anchor points, batched, in memory bounded for dense scenes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from utils.boxes import bbox_iou, xywh_to_xyxy

# Elements of the (labels x points) tensors one pass builds; more labels are taken in chunks. The sparse
# candidate search keeps about 6 bytes per element live (a bool mask, a float alignment): 16M elements stay
# near 100 MB, about 2,000 labels at 640 px (8,400 points), most real batches in one pass. The static search
# computes every pair's CIoU, about 180 bytes per element at its peak (benchmarks/assign.py --static), so it
# takes STATIC_CHUNK_DIVISOR times fewer.
DEFAULT_MAX_ELEMENTS = 16 * 2**20
STATIC_CHUNK_DIVISOR = 16
EPS = 1e-9


@dataclass(frozen=True)
class AlignOptions:
    """The assignment's knobs: TOOD's top-k and exponents, YOLOv10's one-to-one top-k2, the small-box floor.

    Each label takes its `topk` best-aligned candidate points (alignment = score^alpha x CIoU^beta, CIoU
    clamped at 0; a candidate of alignment 0 is not taken: its loss weight would be 0 anyway);
    `topk2` (< topk) then keeps only its best `topk2` after conflicts are settled (1: one-to-one).
    A label with no point inside its box (smaller than the grid spacing) looks for candidates in a box
    of at least `min_size_px` about its centre, so tiny objects still get one.

    `static_shapes` picks how candidates are scored, by the same rules: False computes the CIoU only
    for points inside a label's box, listed with `nonzero`, whose size the host must read from the
    device; True computes it for every (label, point) pair and masks the rest, so every shape is known
    from the inputs' and a GPU step never waits (more arithmetic: off until measured on GPUs). The
    results agree to float rounding: the CIoU's atan and the powers, vectorised over tensors of other
    lengths, may round the last bit differently.
    """

    topk: int = 10
    topk2: int | None = None
    alpha: float = 0.5
    beta: float = 6.0
    min_size_px: float = 16.0
    max_elements: int = DEFAULT_MAX_ELEMENTS
    static_shapes: bool = False


@dataclass(frozen=True)
class Labels:
    """A batch's labels, one row each as in the loader's targets: image (L,) long, classes (L,) long,
    boxes (L, 4) xyxy input pixels."""

    image: torch.Tensor
    classes: torch.Tensor
    boxes: torch.Tensor

    @classmethod
    def from_targets(cls, targets: torch.Tensor, input_hw: tuple[int, int]) -> Labels:
        """targets (L, 6) [image, cls, cx, cy, w, h] normalised -> Labels in pixels of an `input_hw` input.

        The scale is applied per coordinate with Python numbers: a tensor made from a list would be a
        host-to-device copy that waits on a GPU.
        """
        height, width = input_hw
        cx, cy, w, h = targets[:, 2:6].unbind(-1)
        boxes_xywh = torch.stack((cx * width, cy * height, w * width, h * height), -1)
        return cls(targets[:, 0].long(), targets[:, 1].long(), xywh_to_xyxy(boxes_xywh))


@dataclass(frozen=True)
class Matches:
    """Each label's candidate points after the top-k, conflicts and top-k2, (L, k) in the label's rank order.

    `point` (L, k) long; `kept` (L, k) bool, whether the pair survived (False on the rest, which may hold
    any point); `quality` (L, k) float, the pair's soft class target (0 where not kept). Each point is
    in at most one kept pair: a fixed-shape list of the foreground points, usable without `nonzero`.
    """

    point: torch.Tensor
    kept: torch.Tensor
    quality: torch.Tensor


@dataclass(frozen=True)
class Assignment:
    """Per point: whether it is foreground, which label row it learns, and its soft class target.

    `foreground` (B, N) bool; `label_index` (B, N) long, the row of `Labels` (0 on background);
    `target_scores` (B, N, C) float, the assigned class's entry = the normalised alignment (the label's
    best CIoU where the alignment is highest), 0 elsewhere; `matches`, the same assignment per label.
    """

    foreground: torch.Tensor
    label_index: torch.Tensor
    target_scores: torch.Tensor
    matches: Matches


def _inside(centre: torch.Tensor, half: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(L, N) bool: point n lies strictly inside the box of centre (L, 2) and half size (L, 2).

    Four broadcast comparisons straight to booleans: no (L, N) float is ever built, which matters
    when thousands of labels meet 8,400 points.
    """
    low = (centre - half + EPS)[:, None, :]  # (L, 1, 2)
    high = (centre + half - EPS)[:, None, :]
    inside = points[:, 0] > low[..., 0]
    inside &= points[:, 0] < high[..., 0]
    inside &= points[:, 1] > low[..., 1]
    inside &= points[:, 1] < high[..., 1]
    return inside


def _candidates(label_boxes: torch.Tensor, points: torch.Tensor, min_size: float, static_shapes: bool) -> torch.Tensor:
    """(L, N) bool: the points inside each label's box; for a label with none, those inside a `min_size` box.

    The fallback gives objects smaller than the grid spacing a candidate without adding points outside
    the boxes of labels that have their own (a point outside a box cannot express it as distances >= 0).
    The sparse search, which reads the device anyway, skips it when every label has a point; the
    static one always takes the second pass, with the grown box only for the labels that need it.
    """
    centre = (label_boxes[:, :2] + label_boxes[:, 2:]) / 2
    half = (label_boxes[:, 2:] - label_boxes[:, :2]) / 2
    inside = _inside(centre, half, points)
    empty = ~inside.any(dim=-1, keepdim=True)
    if not static_shapes and not bool(empty.any()):
        return inside
    del inside  # one (L, N) mask at a time
    return _inside(centre, torch.where(empty, half.clamp(min=min_size / 2), half), points)


def _alignment(
    scores: torch.Tensor, pred_boxes: torch.Tensor, points: torch.Tensor, labels: Labels, options: AlignOptions
) -> torch.Tensor:
    """(L, N) float: each label's alignment with each point, -1 where the point is not a candidate.

    -1 ranks every non-candidate below every candidate in the top-k that follows.
    """
    inside = _candidates(labels.boxes, points, options.min_size_px, options.static_shapes)
    if options.static_shapes:  # every pair, then masked: shapes from the inputs only
        predicted = pred_boxes[labels.image]  # (L, N, 4)
        overlap = bbox_iou(labels.boxes[:, None, :], predicted, xywh=False, kind="ciou").clamp(min=0)
        score = scores[labels.image, :, labels.classes]  # (L, N)
        align = score.pow(options.alpha) * overlap.pow(options.beta)
        return torch.where(inside, align, -1.0)
    label, point = inside.nonzero(as_tuple=True)
    image = labels.image[label]
    overlap = bbox_iou(labels.boxes[label], pred_boxes[image, point], xywh=False, kind="ciou").clamp(min=0)
    score = scores[image, point, labels.classes[label]]
    dense = torch.full(inside.shape, -1.0, device=scores.device, dtype=scores.dtype)
    dense[label, point] = score.pow(options.alpha) * overlap.pow(options.beta)
    return dense


def _top_candidates(
    scores: torch.Tensor, pred_boxes: torch.Tensor, points: torch.Tensor, labels: Labels, options: AlignOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's `topk` best-aligned points, best first: (alignment (L, k), point (L, k)), in label chunks.

    Each label's top-k is independent of the others, so chunks give exactly the result of one pass,
    and memory stays bounded with thousands of labels per batch.
    """
    num_labels, num_points = len(labels.image), len(points)
    budget = options.max_elements // (STATIC_CHUNK_DIVISOR if options.static_shapes else 1)
    chunk = max(budget // max(num_points, 1), 1)
    k = min(options.topk, num_points)
    if num_labels <= chunk:  # one pass; under torch.compile a guard on the count, not a graph per count
        return _alignment(scores, pred_boxes, points, labels, options).topk(k, dim=-1)
    aligns, top_points = [], []
    for first in range(0, num_labels, chunk):
        part = Labels(*(field[first : first + chunk] for field in vars(labels).values()))
        align, point = _alignment(scores, pred_boxes, points, part, options).topk(k, dim=-1)
        aligns.append(align)
        top_points.append(point)
    return torch.cat(aligns), torch.cat(top_points)


def _settle_conflicts(key: torch.Tensor, overlap: torch.Tensor, kept: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(L, k) bool: of the kept pairs, each point's one of largest overlap (the lowest label row on ties).

    key (L, k): the pair's point over the batch, image x N + point. Pairs not kept write to one spare
    slot past the `num_keys` real ones, so every size is known without reading the device.
    """
    num_labels = key.shape[0]
    key = torch.where(kept, key, num_keys)
    best = overlap.new_full((num_keys + 1,), -1.0).scatter_reduce(0, key.view(-1), overlap.view(-1), "amax")
    winner = kept & (overlap == best[key])
    row = torch.arange(num_labels, device=key.device)[:, None].expand_as(key)
    big = torch.iinfo(torch.int64).max
    lowest = torch.full((num_keys + 1,), big, device=key.device, dtype=torch.int64)
    lowest = lowest.scatter_reduce(0, key.reshape(-1), torch.where(winner, row, big).reshape(-1), "amin")
    return winner & (row == lowest[key])


@dataclass(frozen=True)
class Candidates:
    """Each label's `topk` best-aligned points, best first: `align` (L, k) float, `point` (L, k) long, and the
    label's `image` (L, k) long beside each."""

    align: torch.Tensor
    point: torch.Tensor
    image: torch.Tensor


@torch.no_grad()
def top_candidates(
    scores: torch.Tensor, pred_boxes: torch.Tensor, points: torch.Tensor, labels: Labels, options: AlignOptions
) -> Candidates:
    """The first half of `assign`: each label ranks its candidate points by alignment and keeps its `topk`.

    The caller then computes the CIoU of each (label, candidate) pair, `bbox_iou(labels.boxes[:, None, :],
    pred_boxes[image, point], xywh=False, kind="ciou")`, and passes it to `settle`: a loss computes that
    CIoU for its box term anyway, so it is computed once.
    """
    align, point = _top_candidates(scores, pred_boxes, points, labels, options)
    return Candidates(align, point, labels.image[:, None].expand_as(point))


@torch.no_grad()
def settle(
    candidates: Candidates, ciou: torch.Tensor, labels: Labels, options: AlignOptions, shape: torch.Size
) -> Assignment:
    """The second half of `assign`: conflicts, top-k2 and the soft targets, from the candidates' CIoU (L, k).

    `shape`: the scores' (B, N, C).
    """
    batch, num_points, _ = shape
    align, point, image = candidates.align, candidates.point, candidates.image
    overlap = ciou.detach().clamp(min=0)
    kept = align > 0  # a candidate whose box misses the label (CIoU <= 0) has nothing to learn from it
    kept = _settle_conflicts(image * num_points + point, overlap, kept, batch * num_points)
    if options.topk2 is not None and options.topk2 < options.topk:  # ranks are best first: keep the first ones
        kept &= kept.cumsum(dim=1) <= options.topk2
    align, overlap = align.where(kept, 0.0), overlap.where(kept, 0.0)
    # The soft target: alignment normalised to the label's best kept pair, times its best kept overlap.
    quality = align / (align.amax(dim=1, keepdim=True) + EPS) * overlap.amax(dim=1, keepdim=True)
    return _targets(Matches(point, kept, quality), labels, image, shape)


@torch.no_grad()
def assign(
    scores: torch.Tensor, pred_boxes: torch.Tensor, points: torch.Tensor, labels: Labels, options: AlignOptions
) -> Assignment:
    """Assign labels to points by task alignment (TOOD), one label per point: `top_candidates`, then `settle`.

    scores: (B, N, C) class probabilities; pred_boxes: (B, N, 4) xyxy and points (N, 2), both in
    input pixels; `labels` (L rows). Detached inputs; no gradient. Each label ranks its candidates,
    keeps its `topk` of positive alignment, loses a point to a label of larger overlap on it, then
    (one-to-one) keeps its `topk2` best. Only the candidate search of `options.static_shapes=False`
    reads the device from the host.
    """
    candidates = top_candidates(scores, pred_boxes, points, labels, options)
    predicted = pred_boxes[candidates.image, candidates.point]
    ciou = bbox_iou(labels.boxes[:, None, :], predicted, xywh=False, kind="ciou")
    return settle(candidates, ciou, labels, options, scores.shape)


def _targets(matches: Matches, labels: Labels, image: torch.Tensor, shape: torch.Size) -> Assignment:
    """Write the kept pairs into per-point targets; pairs not kept write to a spare slot past the batch's points."""
    batch, num_points, num_classes = shape
    device = matches.point.device
    key = torch.where(matches.kept, image * num_points + matches.point, batch * num_points).view(-1)
    row = torch.arange(len(labels.image), device=device)[:, None].expand_as(matches.point).reshape(-1)
    foreground = torch.zeros(batch * num_points + 1, dtype=torch.bool, device=device)
    label_index = torch.zeros(batch * num_points + 1, dtype=torch.long, device=device)
    target_scores = torch.zeros(batch * num_points + 1, num_classes, dtype=matches.quality.dtype, device=device)
    foreground[key] = matches.kept.view(-1)
    label_index[key] = row
    target_scores[key, labels.classes[row]] = matches.quality.reshape(-1)
    return Assignment(
        foreground[:-1].view(batch, num_points),
        label_index[:-1].view(batch, num_points),
        target_scores[:-1].view(shape),
        matches,
    )
