"""Tests for utils/train/assign.py: task-aligned assignment against a slow per-label reference, chunking, edges.

Every rule is checked for both candidate searches (sparse, with `nonzero`, and static shapes), which must
give the same assignment.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dense_head import anchor_points
from utils.boxes import bbox_iou
from utils.train.assign import STATIC_CHUNK_DIVISOR, AlignOptions, Assignment, Labels, assign

SEARCHES = [pytest.param(False, id="sparse"), pytest.param(True, id="static")]


def _reference(scores, pred_boxes, points, labels: Labels, options: AlignOptions):
    """The rules written out one label, one point at a time."""
    batch, num_points, num_classes = scores.shape
    pairs = []  # (image, label row, point, align, overlap)
    for row, (b, cls) in enumerate(zip(labels.image.tolist(), labels.classes.tolist(), strict=True)):
        x1, y1, x2, y2 = labels.boxes[row].tolist()
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2

        def inside(n: int, floor: float, cx=cx, cy=cy, w=x2 - x1, h=y2 - y1) -> bool:
            px, py = points[n].tolist()
            return min(max(w / 2, floor / 2) - abs(px - cx), max(h / 2, floor / 2) - abs(py - cy)) > 1e-9

        candidates = [n for n in range(num_points) if inside(n, 0.0)]
        if not candidates:  # smaller than the grid spacing: a box of at least min_size
            candidates = [n for n in range(num_points) if inside(n, options.min_size_px)]
        found = []
        for n in candidates:
            overlap = max(bbox_iou(labels.boxes[row], pred_boxes[b, n], xywh=False).item(), 0.0)
            align = scores[b, n, cls].item() ** options.alpha * overlap**options.beta
            if align > 0:
                found.append((align, n, overlap))
        found.sort(key=lambda item: -item[0])
        pairs += [(b, row, n, align, overlap) for align, n, overlap in found[: options.topk]]
    kept = []
    for b, m, n, align, overlap in pairs:  # each point keeps its label of largest overlap (lowest row on ties)
        rivals = [(-o, mm) for bb, mm, nn, _, o in pairs if bb == b and nn == n]
        if min(rivals) == (-overlap, m):
            kept.append((b, m, n, align, overlap))
    if options.topk2 is not None:
        best = []
        for m in {p[1] for p in kept}:
            mine = sorted((p for p in kept if p[1] == m), key=lambda p: -p[3])
            best += mine[: options.topk2]
        kept = best
    foreground = torch.zeros(batch, num_points, dtype=torch.bool)
    label_index = torch.zeros(batch, num_points, dtype=torch.long)
    target = torch.zeros(batch, num_points, num_classes)
    for b, m, n, align, _ in kept:
        mine = [p for p in kept if p[1] == m]
        quality = align / (max(p[3] for p in mine) + 1e-9) * max(p[4] for p in mine)
        foreground[b, n], label_index[b, n] = True, m
        target[b, n, labels.classes[m]] = quality
    return foreground, label_index, target


def _scene(num_labels: int, seed: int, batch: int = 2, size: int = 64, num_classes: int = 4):
    """Random labels in no image order, predictions near the points, and the points of a 3-level 64 px grid."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [(size // s, size // s) for s in (8, 16, 32)]
    grid, strides = anchor_points(sizes, [8.0, 16.0, 32.0], torch.empty(0), torch.float32)
    points = grid * strides
    num_points = len(points)
    wh = torch.rand(batch, num_points, 2, generator=generator) * 40 + 8
    pred_boxes = torch.cat((points - wh / 2, points + wh / 2), -1)
    scores = torch.rand(batch, num_points, num_classes, generator=generator) * 0.9 + 0.05
    centre = torch.rand(num_labels, 2, generator=generator) * size
    label_wh = torch.rand(num_labels, 2, generator=generator) * 36 + 4
    boxes = torch.cat((centre - label_wh / 2, centre + label_wh / 2), -1)
    classes = torch.randint(0, num_classes, (num_labels,), generator=generator)
    image = torch.randint(0, batch, (num_labels,), generator=generator)
    return scores, pred_boxes, points, Labels(image, classes, boxes)


def _assert_consistent(got: Assignment) -> None:
    """The per-label matches say what the per-point targets say."""
    matches = got.matches
    assert int(matches.kept.sum()) == int(got.foreground.sum())
    assert torch.allclose(matches.quality.sum(), got.target_scores.sum())
    assert (matches.quality[~matches.kept] == 0).all()


@pytest.mark.parametrize("static", SEARCHES)
@pytest.mark.parametrize(
    ("num_labels", "seed", "options"),
    [
        (1, 0, AlignOptions()),
        (3, 1, AlignOptions()),
        (12, 2, AlignOptions()),  # overlapping labels: points claimed twice
        (40, 3, AlignOptions(topk=4)),  # many labels on 84 points
        (12, 4, AlignOptions(topk=7, topk2=1)),  # one-to-one
        (6, 5, AlignOptions(min_size_px=24.0)),  # small labels grown for candidates
    ],
)
def test_assignment_equals_the_slow_reference(num_labels: int, seed: int, options: AlignOptions, static: bool) -> None:
    scene = _scene(num_labels, seed)
    got = assign(*scene, replace(options, static_shapes=static))
    foreground, label_index, target = _reference(*scene, options)
    assert got.foreground.any()
    assert torch.equal(got.foreground, foreground)
    assert torch.equal(got.label_index[foreground], label_index[foreground])
    assert torch.allclose(got.target_scores, target, atol=1e-5)
    _assert_consistent(got)


@pytest.mark.parametrize("options", [AlignOptions(), AlignOptions(topk=7, topk2=1)])
def test_both_candidate_searches_give_the_same_assignment_on_a_crowded_batch(options: AlignOptions) -> None:
    scene = _scene(90, 11, batch=4, size=128)
    sparse = assign(*scene, options)
    static = assign(*scene, replace(options, static_shapes=True))
    assert torch.equal(sparse.foreground, static.foreground) and sparse.foreground.sum() > 50
    assert torch.equal(sparse.label_index, static.label_index)
    assert torch.equal(sparse.matches.kept, static.matches.kept)
    assert torch.allclose(sparse.target_scores, static.target_scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("static", SEARCHES)
def test_one_to_one_keeps_a_single_point_per_label(static: bool) -> None:
    scene = _scene(8, 7)
    got = assign(*scene, AlignOptions(topk=7, topk2=1, static_shapes=static))
    rows = got.label_index[got.foreground]
    assert len(rows) == len(set(rows.tolist())) <= 8
    assert (got.matches.kept.sum(dim=1) <= 1).all()


@pytest.mark.parametrize("static", SEARCHES)
def test_chunks_over_labels_give_the_same_assignment(static: bool) -> None:
    scene = _scene(60, 8, batch=3)
    one_pass = assign(*scene, AlignOptions(static_shapes=static))
    points = len(scene[2])
    divisor = STATIC_CHUNK_DIVISOR if static else 1  # the static search's budget is a fraction of max_elements
    chunked = assign(*scene, AlignOptions(max_elements=divisor * points * 7, static_shapes=static))  # 7 per chunk
    assert torch.equal(one_pass.foreground, chunked.foreground)
    assert torch.equal(one_pass.label_index, chunked.label_index)
    # Equal to float rounding: vectorised atan (CIoU) may round the last bit differently on other lengths.
    assert torch.allclose(one_pass.target_scores, chunked.target_scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("static", SEARCHES)
def test_images_without_labels_and_batches_without_any_are_background(static: bool) -> None:
    scores, pred_boxes, points, labels = _scene(5, 9)
    options = AlignOptions(static_shapes=static)
    labels = Labels(torch.ones_like(labels.image), labels.classes, labels.boxes)  # image 0 has none
    got = assign(scores, pred_boxes, points, labels, options)
    assert not got.foreground[0].any() and got.target_scores[0].sum() == 0 and got.foreground[1].any()
    none = Labels(labels.image[:0], labels.classes[:0], labels.boxes[:0])
    empty = assign(scores, pred_boxes, points, none, options)
    assert not empty.foreground.any() and empty.target_scores.shape == scores.shape
    assert empty.matches.point.shape == (0, 10)


@pytest.mark.parametrize("static", SEARCHES)
def test_a_label_smaller_than_the_grid_still_gets_a_point(static: bool) -> None:
    scores, pred_boxes, points, _ = _scene(1, 10)
    boxes = torch.tensor([[30.0, 30.0, 33.0, 33.0]] * 2)  # 3 px: no cell centre inside it
    labels = Labels(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), boxes)
    pred_boxes = boxes[:1].repeat(2, len(points), 1)  # every point predicts the label's box exactly
    floorless = AlignOptions(min_size_px=0.0, static_shapes=static)
    assert not assign(scores, pred_boxes, points, labels, floorless).foreground.any()
    assert assign(scores, pred_boxes, points, labels, AlignOptions(static_shapes=static)).foreground.any()


def test_labels_from_targets_are_pixel_corners_in_row_order() -> None:
    targets = torch.tensor([[1, 0, 0.5, 0.5, 0.4, 0.3], [0, 2, 0.3, 0.3, 0.2, 0.2]])
    labels = Labels.from_targets(targets, (64, 128))  # a 128 x 64 input
    assert labels.image.tolist() == [1, 0] and labels.classes.tolist() == [0, 2]
    # Row 0: cx 0.5 cy 0.5 w 0.4 h 0.3 -> x 38.4..89.6, y 22.4..41.6.
    assert labels.boxes[0].tolist() == pytest.approx([38.4, 22.4, 89.6, 41.6])
    assert Labels.from_targets(torch.zeros(0, 6), (64, 64)).boxes.shape == (0, 4)
