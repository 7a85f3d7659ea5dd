"""Tests for utils/train/dense_loss.py: finiteness and gradient reach, rank split, branch weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.anchor_free import LAYOUTS, AnchorFreeSpec, build_model
from models.dense_head import DenseRaw, distribution_to_distances
from utils.boxes import bbox_iou, box_iou, top_detections, xywh_to_xyxy
from utils.train.assign import AlignOptions, Labels, assign
from utils.train.dense_loss import DenseGains, DenseLoss, distribution_loss

GAINS = DenseGains(box=7.5, cls=0.5, dfl=1.5)


def _tiny(layout: str) -> AnchorFreeSpec:
    is_26 = layout == "yolo26"
    return AnchorFreeSpec(layout, 0.33, 0.125, 256, 3, reg_max=1 if is_26 else 16, end_to_end=is_26)


def _targets() -> torch.Tensor:
    """Labels of 4 images, not grouped by image: [image, cls, cx, cy, w, h] normalised."""
    return torch.tensor(
        [
            [1, 0, 0.5, 0.5, 0.4, 0.3],
            [0, 2, 0.3, 0.3, 0.2, 0.2],
            [1, 1, 0.7, 0.2, 0.1, 0.2],
            [0, 1, 0.6, 0.6, 0.5, 0.4],
            [3, 0, 0.4, 0.7, 0.3, 0.3],
        ]
    )


def test_distribution_loss_is_smallest_at_the_target_distance() -> None:
    target = torch.tensor([[2.3, 0.0, 7.5, 14.99]])
    exact = torch.full((1, 4, 16), -20.0)
    for side, value in enumerate(target[0].tolist()):  # the two bins around the target, weighted by closeness
        low = min(int(value), 14)
        high_weight = min(value, 14.99) - low
        exact[0, side, low] = torch.log(torch.tensor(1 - high_weight + 1e-6))
        exact[0, side, low + 1] = torch.log(torch.tensor(high_weight + 1e-6))
    best = distribution_loss(exact.view(1, 64), target, 16)
    shifted = distribution_loss(exact.roll(1, dims=-1).view(1, 64), target, 16)
    assert best.item() < shifted.item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_is_finite_and_reaches_every_trainable_parameter(layout: str) -> None:
    torch.manual_seed(0)
    model = build_model(_tiny(layout)).train()
    loss_fn = DenseLoss(model, GAINS)
    loss, items = loss_fn(model(torch.rand(4, 3, 64, 64)), _targets())
    assert loss.shape == (1,) and torch.isfinite(loss).all() and items.shape == (3,) and (items > 0).all()
    assert loss.item() == pytest.approx(items.sum().item() * 4, rel=1e-5)  # items x batch size
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing
    assert loss_fn.item_names == (("box", "cls", "l1") if layout == "yolo26" else ("box", "cls", "dfl"))


def test_an_image_batch_without_labels_trains_only_the_class_term() -> None:
    model = build_model(_tiny("yolo11")).train()
    loss, items = DenseLoss(model, GAINS)(model(torch.rand(2, 3, 64, 64)), torch.zeros(0, 6))
    assert torch.isfinite(loss).all() and items[0] == 0 and items[2] == 0 and items[1] > 0
    loss.backward()  # every output stays in the graph (DDP needs a gradient for each parameter)
    assert all(p.grad is not None for p in model.head.box_branches.parameters())


class _FixedMean:
    """Stands in for RankMean on 2 ranks: returns the mean the two ranks' sums have."""

    world_size = 2

    def __init__(self, mean: torch.Tensor) -> None:
        self.mean = mean

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.mean


@pytest.mark.parametrize("layout", ["yolo11", "yolo26"])
def test_two_halves_with_averaged_normalisers_add_up_to_the_whole_batch(layout: str) -> None:
    """What DDP relies on: each rank divides by the mean over ranks of the target-score sums."""
    torch.manual_seed(1)
    model = build_model(_tiny(layout)).eval()  # fixed BN: the forward is per image
    model.head.train()  # the head returns the training output
    images, targets = torch.rand(4, 3, 64, 64), _targets()
    loss_fn = DenseLoss(model, GAINS)
    whole, _ = loss_fn(model(images), targets)
    halves = []
    for first in (0, 2):
        mine = (targets[:, 0] >= first) & (targets[:, 0] < first + 2)
        local = targets[mine].clone()
        local[:, 0] -= first
        halves.append((model(images[first : first + 2]), local))
    sums = [torch.stack([t.score_sum for _, t in loss_fn._branches(preds, local, None)[0]]) for preds, local in halves]
    mean = (sums[0] + sums[1]) / 2
    total = sum(loss_fn(preds, local, _FixedMean(mean))[0] for preds, local in halves)
    # Each rank's loss is multiplied by the world size by the engine and DDP averages: the sum is what counts.
    assert total.item() == pytest.approx(whole.item(), rel=1e-4)


def test_end_to_end_branch_weights_move_from_one_to_many_to_one_to_one() -> None:
    loss_fn = DenseLoss(build_model(_tiny("yolo26")), GAINS)
    loss_fn.start_epoch(0, 11)
    assert float(loss_fn.one_to_one_weight) == pytest.approx(0.2)
    loss_fn.start_epoch(5, 11)
    assert float(loss_fn.one_to_one_weight) == pytest.approx(0.55)
    loss_fn.start_epoch(10, 11)
    assert float(loss_fn.one_to_one_weight) == pytest.approx(0.9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_minimising_the_loss_over_free_outputs_finds_every_label(layout: str) -> None:
    """Loss, assignment and decode agree: outputs optimised for the loss alone predict each label."""
    torch.manual_seed(0)
    head = build_model(_tiny(layout)).head
    loss_fn = DenseLoss(_HeadOnly(head), GAINS)
    branches = [[torch.randn(4, head.num_outputs, side, side) * 0.1 for side in (8, 4, 2)] for _ in range(2)]
    for level in branches[0] + branches[1]:  # start as the head's bias initialisation does
        level[:, : 4 * head.reg_max] += 1.0  # box outputs at 1: boxes of a few cells, overlapping the labels
        level[:, 4 * head.reg_max :] -= 4.0  # class logits low
        level.requires_grad_()
    levels, one_to_one = branches[0], (branches[1] if head.end_to_end else None)
    optimizer = torch.optim.Adam(branches[0] + branches[1], lr=0.05)
    targets = torch.tensor([[0, 2, 0.3, 0.3, 0.3, 0.3], [0, 1, 0.65, 0.6, 0.5, 0.4], [1, 0, 0.5, 0.5, 0.4, 0.3]])
    for _ in range(150):
        loss, _ = loss_fn(DenseRaw(levels, one_to_one), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    labels = Labels.from_targets(targets, (64, 64))
    for outputs in [levels] + ([one_to_one] if one_to_one is not None else []):
        with torch.no_grad():
            decoded = head.decode(outputs)
        for row, image in enumerate(labels.image.tolist()):
            best = decoded[image, :, 4 + labels.classes[row]].argmax()  # the label's class's top point
            predicted = xywh_to_xyxy(decoded[image, best, :4])
            assert box_iou(predicted[None], labels.boxes[row][None]).item() > 0.9
    if one_to_one is not None:  # the NMS-free branch: one confident detection per object, and no other
        with torch.no_grad():
            detections = top_detections(head.decode(one_to_one), conf_thres=0.25)
        for image, found in enumerate(detections):
            wanted = labels.boxes[labels.image == image]
            assert len(found) == len(wanted)
            if len(wanted):
                assert (box_iou(found[:, :4], wanted).amax(dim=1) > 0.9).all()


class _HeadOnly(nn.Module):
    """A model with only a head: what the loss reads from a model."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head


@pytest.mark.parametrize("static", [False, True])
def test_the_loss_assigns_as_assign_does_and_its_box_term_is_over_those_matches(static: bool) -> None:
    """The loss computes the candidates' CIoU once, for its box term and the assignment: the same as assign()."""
    torch.manual_seed(2)
    model = build_model(_tiny("yolo11")).train()
    loss_fn = DenseLoss(model, GAINS, align=AlignOptions(static_shapes=static))
    preds, targets = model(torch.rand(4, 3, 64, 64)), _targets()
    [(_, terms)], _ = loss_fn._branches(preds, targets, None)
    head = loss_fn.head
    logits = terms.flat[..., 4 * head.reg_max : 4 * head.reg_max + head.num_classes].detach()
    points = loss_fn._points(((8, 8), (4, 4), (2, 2)), logits.device, logits.dtype)[1]
    labels = Labels.from_targets(targets, (64, 64))
    expected = assign(logits.sigmoid(), terms.point_boxes.detach(), points, labels, loss_fn.align)
    got = terms.assignment
    assert got.foreground.any()
    for name in ("foreground", "label_index", "target_scores"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    point, quality = expected.matches.point, expected.matches.quality
    image = labels.image[:, None].expand_as(point)
    ciou = bbox_iou(terms.point_boxes[image, point], labels.boxes[:, None, :].expand(*point.shape, 4), xywh=False)
    assert terms.box_sum.item() == pytest.approx(((1 - ciou) * quality).sum().item(), rel=1e-6)


def test_box_distributions_are_decoded_in_fp32_under_autocast() -> None:
    # The loss runs inside autocast; the expectation over each side's bins must not drop to bf16 (up to 0.06 grid
    # units off, 2 pixels at stride 32), as a matmul under autocast would.
    logits = torch.randn(2, 50, 64, generator=torch.Generator().manual_seed(0)) * 3
    bins = torch.arange(16, dtype=torch.float32)
    exact = distribution_to_distances(logits, 16, bins)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = distribution_to_distances(logits, 16, bins)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, exact)
