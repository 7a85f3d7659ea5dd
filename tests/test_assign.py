"""Tests for utils/train/assign.py: task-aligned assignment against a slow per-label reference, chunking, edges."""

from __future__ import annotations

import pytest
import torch

from models.dense_head import anchor_points
from utils.boxes import bbox_iou
from utils.train.assign import AlignOptions, assign


def _reference(scores, pred_boxes, points, classes, boxes, valid, options: AlignOptions):
    """The rules written out one image, one label, one point at a time."""
    batch, num_points, num_classes = scores.shape
    pairs = []  # (image, label, point, align, overlap)
    for b in range(batch):
        for m in range(classes.shape[1]):
            if not valid[b, m]:
                continue
            x1, y1, x2, y2 = boxes[b, m].tolist()
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2

            def inside(n: int, floor: float, cx=cx, cy=cy, w=x2 - x1, h=y2 - y1) -> bool:
                px, py = points[n].tolist()
                return min(max(w / 2, floor / 2) - abs(px - cx), max(h / 2, floor / 2) - abs(py - cy)) > 1e-9

            candidates = [n for n in range(num_points) if inside(n, 0.0)]
            if not candidates:  # smaller than the grid spacing: a box of at least min_size
                candidates = [n for n in range(num_points) if inside(n, options.min_size_px)]
            found = []
            for n in candidates:
                overlap = max(bbox_iou(boxes[b, m], pred_boxes[b, n], xywh=False).item(), 0.0)
                align = scores[b, n, classes[b, m]].item() ** options.alpha * overlap**options.beta
                if align > 0:
                    found.append((align, n, overlap))
            found.sort(key=lambda item: -item[0])
            pairs += [(b, m, n, align, overlap) for align, n, overlap in found[: options.topk]]
    kept = []
    for b, m, n, align, overlap in pairs:  # each point keeps its label of largest overlap (lowest index on ties)
        rivals = [(-o, mm) for bb, mm, nn, _, o in pairs if bb == b and nn == n]
        if min(rivals) == (-overlap, m):
            kept.append((b, m, n, align, overlap))
    if options.topk2 is not None:
        best = []
        for b, m in {(p[0], p[1]) for p in kept}:
            mine = sorted((p for p in kept if p[:2] == (b, m)), key=lambda p: -p[3])
            best += mine[: options.topk2]
        kept = best
    foreground = torch.zeros(batch, num_points, dtype=torch.bool)
    label_index = torch.zeros(batch, num_points, dtype=torch.long)
    target = torch.zeros(batch, num_points, num_classes)
    for b, m, n, align, _ in kept:
        mine = [p for p in kept if p[:2] == (b, m)]
        quality = align / (max(p[3] for p in mine) + 1e-9) * max(p[4] for p in mine)
        foreground[b, n], label_index[b, n] = True, m
        target[b, n, classes[b, m]] = quality
    return foreground, label_index, target


def _scene(num_labels: int, seed: int, batch: int = 2, size: int = 64, num_classes: int = 4):
    """Random labels (some padding), predictions near the points, and the points of a 3-level 64 px grid."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [(size // s, size // s) for s in (8, 16, 32)]
    grid, strides = anchor_points(sizes, [8.0, 16.0, 32.0], torch.device("cpu"), torch.float32)
    points = grid * strides
    num_points = len(points)
    wh = torch.rand(batch, num_points, 2, generator=generator) * 40 + 8
    pred_boxes = torch.cat((points - wh / 2, points + wh / 2), -1)
    scores = torch.rand(batch, num_points, num_classes, generator=generator) * 0.9 + 0.05
    centre = torch.rand(batch, num_labels, 2, generator=generator) * size
    label_wh = torch.rand(batch, num_labels, 2, generator=generator) * 36 + 4
    boxes = torch.cat((centre - label_wh / 2, centre + label_wh / 2), -1)
    classes = torch.randint(0, num_classes, (batch, num_labels), generator=generator)
    valid = torch.rand(batch, num_labels, generator=generator) > 0.2
    return scores, pred_boxes, points, classes, boxes, valid


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
def test_assignment_equals_the_slow_reference(num_labels: int, seed: int, options: AlignOptions) -> None:
    scene = _scene(num_labels, seed)
    got = assign(*scene, options)
    foreground, label_index, target = _reference(*scene, options)
    assert got.foreground.any()
    assert torch.equal(got.foreground, foreground)
    assert torch.equal(got.label_index[foreground], label_index[foreground])
    assert torch.allclose(got.target_scores, target, atol=1e-5)


def test_one_to_one_keeps_a_single_point_per_label() -> None:
    scene = _scene(8, 7)
    got = assign(*scene, AlignOptions(topk=7, topk2=1))
    _, _, _, _, _, valid = scene
    for b in range(2):
        labels = got.label_index[b][got.foreground[b]]
        assert len(labels) == len(set(labels.tolist())) <= int(valid[b].sum())


def test_chunks_over_labels_give_the_same_assignment() -> None:
    scene = _scene(60, 8, batch=3)
    one_pass = assign(*scene, AlignOptions())
    points = len(scene[2])
    chunked = assign(*scene, AlignOptions(max_elements=3 * points * 7))  # 7 labels per chunk
    assert torch.equal(one_pass.foreground, chunked.foreground)
    assert torch.equal(one_pass.label_index, chunked.label_index)
    # Equal to float rounding: vectorised atan (CIoU) may round the last bit differently on other lengths.
    assert torch.allclose(one_pass.target_scores, chunked.target_scores, rtol=0, atol=1e-6)


def test_images_without_labels_and_batches_without_any_are_background() -> None:
    scores, pred_boxes, points, classes, boxes, valid = _scene(5, 9)
    valid[0] = False  # image 0 has only padding
    got = assign(scores, pred_boxes, points, classes, boxes, valid, AlignOptions())
    assert not got.foreground[0].any() and got.target_scores[0].sum() == 0 and got.foreground[1].any()
    empty = assign(scores, pred_boxes, points, classes[:, :0], boxes[:, :0], valid[:, :0], AlignOptions())
    assert not empty.foreground.any() and empty.target_scores.shape == scores.shape


def test_a_label_smaller_than_the_grid_still_gets_a_point() -> None:
    scores, pred_boxes, points, _, _, _ = _scene(1, 10)
    boxes = torch.tensor([[[30.0, 30.0, 33.0, 33.0]]]).repeat(2, 1, 1)  # 3 px: no cell centre inside it
    classes, valid = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool)
    pred_boxes = boxes.repeat(1, len(points), 1)  # every point predicts the label's box exactly
    assert not assign(scores, pred_boxes, points, classes, boxes, valid, AlignOptions(min_size_px=0.0)).foreground.any()
    assert assign(scores, pred_boxes, points, classes, boxes, valid, AlignOptions()).foreground.any()
