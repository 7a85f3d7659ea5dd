"""Tests for segment/dense_loss.py: the anchor-free mask term against a per-point reference, gradients, layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.anchor_free import AnchorFreeSpec, build_model, segmentation_spec
from segment.dense_loss import DenseSegmentationLoss, semantic_targets
from segment.ops import crop_mask
from utils.boxes import xywhn_to_xyxy
from utils.train.dense_loss import DenseGains

GAINS = DenseGains(box=7.5, cls=0.5, dfl=1.5)
# Two images; image 0 has two overlapping instances, image 1 one. Rows grouped by image (the collate's order).
TARGETS = torch.tensor([[0, 0, 0.4, 0.4, 0.5, 0.5], [0, 2, 0.6, 0.6, 0.4, 0.3], [1, 1, 0.5, 0.5, 0.6, 0.6]])


def _masks(size: int = 16) -> torch.Tensor:
    """Per-instance (3, 16, 16) 0/1 masks: each instance's box, shrunk by a pixel."""
    masks = torch.zeros(3, size, size)
    for row, (x1, y1, x2, y2) in enumerate(xywhn_to_xyxy(TARGETS[:, 2:6], size, size).round().long().tolist()):
        masks[row, y1 + 1 : y2 - 1, x1 + 1 : x2 - 1] = 1
    return masks


def _model(layout: str):
    is_26 = layout == "yolo26"
    spec = AnchorFreeSpec(layout, 0.33, 0.125, 256, 3, reg_max=1 if is_26 else 16, end_to_end=is_26)
    torch.manual_seed(0)
    return build_model(segmentation_spec(spec)).train()


@pytest.mark.parametrize("layout", ["yolov8", "yolo26"])
def test_loss_is_finite_and_reaches_every_trainable_parameter(layout: str) -> None:
    model = _model(layout)
    loss_fn = DenseSegmentationLoss(model, GAINS)
    loss, items = loss_fn(model(torch.rand(2, 3, 64, 64)), TARGETS, masks=_masks())
    names = ("box", "seg", "cls", "l1", "sem") if layout == "yolo26" else ("box", "seg", "cls", "dfl")
    assert loss_fn.item_names == names and items.shape == (len(names),)
    assert torch.isfinite(loss).all() and (items > 0).all()
    loss.backward()
    # The semantic branch of YOLO26-seg trains too (DDP needs a gradient for every parameter).
    assert not [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_overlap_masks_give_the_same_loss_as_per_instance_masks() -> None:
    model = _model("yolo11")
    outputs = model(torch.rand(2, 3, 64, 64))
    per_instance = _masks()
    overlap = torch.zeros(2, 16, 16)
    for row in (1, 0):  # the smaller instance last: it wins where they overlap, as the dataset draws it
        overlap[0][per_instance[row] > 0] = row + 1
    overlap[1][per_instance[2] > 0] = 1
    # Where instances overlap, the overlap map gives the pixel to one of them: compare on disjoint masks.
    disjoint = torch.stack([overlap[0] == 1, overlap[0] == 2, overlap[1] == 1]).float()
    _, expected = DenseSegmentationLoss(model, GAINS)(outputs, TARGETS, masks=disjoint)
    _, got = DenseSegmentationLoss(model, GAINS, overlap=True)(outputs, TARGETS, masks=overlap)
    assert torch.allclose(got, expected, atol=1e-6)


def test_mask_term_equals_the_per_point_reference() -> None:
    model = _model("yolo11")
    loss_fn = DenseSegmentationLoss(model, GAINS)
    with torch.no_grad():
        raw, protos = model(torch.rand(2, 3, 64, 64))
    masks = _masks()
    _, items = loss_fn((raw, protos), TARGETS, masks=masks)
    branches, _ = loss_fn._branches(raw, TARGETS, None)
    terms = branches[0][1]
    start = 4 * model.spec.reg_max + model.spec.num_classes
    image, point = terms.assignment.foreground.nonzero(as_tuple=True)
    total = 0.0
    for b, n in zip(image.tolist(), point.tolist(), strict=True):
        row = int(terms.assignment.label_index[b, n])
        logits = torch.einsum("c,chw->hw", terms.flat[b, n, start:], protos[b].float())
        bce = F.binary_cross_entropy_with_logits(logits, masks[row], reduction="none")
        box = xywhn_to_xyxy(TARGETS[row : row + 1, 2:6], 16, 16)
        area = float(TARGETS[row, 4] * TARGETS[row, 5])
        total += crop_mask(bce[None], box).mean().item() / area
    assert len(image) > 0
    assert items[1].item() == pytest.approx(total / len(image) * GAINS.box, rel=1e-4)


def _centroid(mask: torch.Tensor) -> tuple[float, float]:
    rows, cols = torch.meshgrid(torch.arange(mask.shape[0]), torch.arange(mask.shape[1]), indexing="ij")
    return float((rows * mask).sum() / mask.sum()), float((cols * mask).sum() / mask.sum())


@pytest.mark.parametrize("size", [(8, 8), (6, 10), (32, 32)])
def test_semantic_targets_stay_centred_on_the_masks(size: tuple[int, int]) -> None:
    truth = torch.zeros(1, 1, 16, 16)
    truth[0, 0, 5:9, 3:10] = 1  # odd offsets: a top-left pick moves these by half a cell at 2:1
    resized = semantic_targets(truth, size)[0, 0]
    assert resized.shape == size and 0 <= resized.min() and resized.max() <= 1
    # Pixel centres map as (i + 0.5) * scale - 0.5: the centre of mass lands where the mask's does.
    (row, col), (got_row, got_col) = _centroid(truth[0, 0]), _centroid(resized)
    expected = ((row + 0.5) * size[0] / 16 - 0.5, (col + 0.5) * size[1] / 16 - 0.5)
    assert abs(got_row - expected[0]) < 0.05 and abs(got_col - expected[1]) < 0.05
    # The area is kept, in cells of the new size.
    assert abs(float(resized.sum()) - 28 * size[0] * size[1] / 256) < 1e-4
