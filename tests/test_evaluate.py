"""Tests for utils/eval/evaluate.py: multi- vs single-label NMS in the mAP, the confusion matrix, the results table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from utils.distributed import DistContext
from utils.eval.evaluate import EvalInterrupted, EvalOptions, format_results
from utils.tasks import DETECT

SIZE = 64


class _FixedPredictions(nn.Module):
    """A 'model' whose eval output is one fixed decoded row per image: (decoded (B, 1, 5 + nc), raw list)."""

    def __init__(self, row: list[float]) -> None:
        super().__init__()
        self.row = nn.Parameter(torch.tensor(row), requires_grad=False)
        # What every model has and evaluation reads (utils/backends: module_info): strides, the head's mask count.
        self.stride = torch.tensor([8.0, 16.0, 32.0])
        self.head = SimpleNamespace(num_masks=0)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.row.expand(len(images), 1, -1), []


def _batch(label_cls: int) -> dict:
    """One 64x64 image with one label in the middle (cx cy w h = 0.5 0.5 0.5 0.5, normalised)."""
    return {
        "images": torch.zeros(1, SIZE, SIZE, 3, dtype=torch.uint8),
        "targets": torch.tensor([[0.0, label_cls, 0.5, 0.5, 0.5, 0.5]]),
        "paths": ["a.jpg"],
        "shapes": [((SIZE, SIZE), ((1.0, 1.0), (0.0, 0.0)))],
    }


def _evaluate(label_cls: int, multi_label: bool, confusion: bool = False):
    # The box exactly covers the label; class 0 scores 0.6, class 1 scores 0.35 (objectness 1).
    model = _FixedPredictions([32.0, 32.0, 32.0, 32.0, 1.0, 0.6, 0.35])
    options = EvalOptions(num_classes=2, multi_label=multi_label, confusion=confusion)
    return DETECT.evaluate(model, [_batch(label_cls)], options, DistContext())


def test_second_class_of_a_box_counts_under_multi_label_only() -> None:
    multi = _evaluate(label_cls=1, multi_label=True)
    single = _evaluate(label_cls=1, multi_label=False)
    assert multi.metrics.map50 == pytest.approx(1.0) and multi.metrics.map50_95 == pytest.approx(1.0)
    assert single.metrics.map50 == 0.0 and single.metrics.map50_95 == 0.0
    # The best class is found either way.
    assert _evaluate(label_cls=0, multi_label=False).metrics.map50 == pytest.approx(1.0)


def test_multi_label_is_the_default_and_the_confusion_matrix_keeps_one_class_per_box() -> None:
    assert EvalOptions(num_classes=2).multi_label
    for multi_label in (True, False):
        matrix = _evaluate(label_cls=1, multi_label=multi_label, confusion=True).confusion.matrix
        # matrix[predicted, true]: the box is counted once, as its best class 0 against the label of class 1;
        # with multi-label NMS feeding it, the class-1 copy (0.35 > 0.25) would add a second detection.
        np.testing.assert_array_equal(matrix, [[0, 1, 0], [0, 0, 0], [0, 0, 0]])


def test_class_agnostic_scoring_counts_each_box_once_as_class_0() -> None:
    # A box scored for both classes over a label of class 1, scored as one class (val --single-cls): the labels
    # are class 0 there (the dataset's single_cls), and the box must be one detection of class 0, not two.
    model = _FixedPredictions([32.0, 32.0, 32.0, 32.0, 1.0, 0.6, 0.35])
    options = EvalOptions(num_classes=1, class_agnostic=True, collect_predictions=True, confusion=True)
    result = DETECT.evaluate(model, [_batch(label_cls=0)], options, DistContext())
    [image] = result.predictions
    np.testing.assert_allclose(image.detections[:, 4:], [[0.6, 0.0]])  # its best class's score, class 0
    assert result.metrics.map50 == pytest.approx(1.0) and result.metrics.precision == pytest.approx(1.0)
    np.testing.assert_array_equal(result.confusion.matrix, [[1, 0], [0, 0]])
    # Scored per class, multi-label NMS keeps the box once per class.
    options = EvalOptions(num_classes=2, collect_predictions=True)
    [image] = DETECT.evaluate(model, [_batch(label_cls=1)], options, DistContext()).predictions
    np.testing.assert_allclose(image.detections[:, 4:], [[0.6, 0.0], [0.35, 1.0]])


def test_val_flag_chooses_the_nms() -> None:
    from utils.eval.config import build_val_parser, val_config_from_args

    parse = build_val_parser().parse_args
    assert val_config_from_args(parse(["--weights", "w.pt"])).multi_label
    assert not val_config_from_args(parse(["--weights", "w.pt", "--no-multi-label"])).multi_label


def _images_with_labels(classes_per_image: list[list[int]]) -> dict:
    """One batch of 64x64 images, image i holding one centred label per class in classes_per_image[i]."""
    rows = [[float(i), float(c), 0.5, 0.5, 0.5, 0.5] for i, classes in enumerate(classes_per_image) for c in classes]
    count = len(classes_per_image)
    return {
        "images": torch.zeros(count, SIZE, SIZE, 3, dtype=torch.uint8),
        "targets": torch.tensor(rows).reshape(-1, 6),
        "paths": [f"{i}.jpg" for i in range(count)],
        "shapes": [((SIZE, SIZE), ((1.0, 1.0), (0.0, 0.0)))] * count,
    }


def test_verbose_table_counts_per_class_the_images_holding_that_class() -> None:
    model = _FixedPredictions([32.0, 32.0, 32.0, 32.0, 1.0, 0.6, 0.35])
    batches = [_images_with_labels([[0, 0], [1], []]), _images_with_labels([[0]])]
    result = DETECT.evaluate(model, batches, EvalOptions(num_classes=2), DistContext())
    assert result.num_images == 4 and result.class_counts.tolist() == [3, 1] and result.class_images.tolist() == [2, 1]
    rows = [line.split() for line in format_results(result, ("circle", "square"), verbose=True).splitlines()[1:]]
    assert [row[:3] for row in rows] == [["all", "4", "4"], ["circle", "2", "3"], ["square", "1", "1"]]


def test_the_segmentation_table_keeps_its_column_titles_apart() -> None:
    metrics = SimpleNamespace(precision=0.5, recall=0.4, map50=0.3, map50_95=0.2, class_ids=np.array([]))
    result = SimpleNamespace(metrics=metrics, mask_metrics=metrics, num_images=3, num_instances=4)
    header, row = format_results(result, (), verbose=False).splitlines()
    titles = [f"{title}({kind})" for kind in "BM" for title in ("P", "R", "mAP50", "mAP50-95")]
    assert header.split() == ["Class", "Images", "Instances", *titles]
    assert row.split() == ["all", "3", "4", *["0.500", "0.400", "0.300", "0.200"] * 2]


def _speed_over_uneven_ranks(ctx: DistContext) -> dict[str, float]:
    """Rank 0 evaluated no image, rank 1 three images in 0.3 / 0.6 / 0.9 s of pre-process / inference / NMS."""
    from utils.eval.evaluate import _Stats, _summarise

    images = 3 * ctx.rank
    seen = torch.tensor([float(images), 0.0])
    timings = np.array([0.1, 0.2, 0.3]) * images
    result = _summarise(_Stats(), torch.zeros(3), seen, timings, None, EvalOptions(num_classes=1), ctx, False)
    return result.speed_ms


@pytest.mark.distributed
def test_speed_per_image_counts_every_rank_by_its_images(tmp_path) -> None:
    from tests.dist_helpers import run_distributed

    speeds = run_distributed(_speed_over_uneven_ranks, 2, tmp_path)
    # 100 / 200 / 300 ms per image, on every rank; a mean of the ranks' means would halve them.
    for speed in speeds:
        assert speed == pytest.approx({"preprocess": 100.0, "inference": 200.0, "nms": 300.0})


def _evaluate_with_interrupt(batch_count: int, flag_after: int | None, ctx: DistContext) -> tuple[str, int, int]:
    """Evaluate `batch_count` one-image batches, the interrupt flag turning true once `flag_after` were drawn.

    Returns how it ended (the metrics' image count, or the exception's batches evaluated) and the batches drawn.
    """
    model = _FixedPredictions([32.0, 32.0, 32.0, 32.0, 1.0, 0.6, 0.35])
    drawn = []

    def batches():  # a generator, as a loader is to the loop: no length known
        for index in range(batch_count):
            drawn.append(index)
            yield _batch(0)

    options = EvalOptions(num_classes=2, interrupt=lambda: flag_after is not None and len(drawn) > flag_after)
    try:
        result = DETECT.evaluate(model, batches(), options, ctx)
    except EvalInterrupted as stopped:
        return "interrupted", stopped.evaluated, len(drawn)
    return "scored", result.num_images, len(drawn)


def test_an_interrupt_ends_the_loop_at_the_next_batch_without_metrics_of_a_part_of_the_set() -> None:
    assert _evaluate_with_interrupt(5, 2, DistContext()) == ("interrupted", 2, 3)  # the third drawn, not evaluated
    assert _evaluate_with_interrupt(5, 0, DistContext()) == ("interrupted", 0, 1)
    # A flag that turns true after the last batch stops nothing: the whole set was evaluated.
    assert _evaluate_with_interrupt(3, 3, DistContext()) == ("scored", 3, 3)
    assert _evaluate_with_interrupt(3, None, DistContext()) == ("scored", 3, 3)
    with pytest.raises(EvalInterrupted, match="after 1 of 2 batches"):  # a sized input names its total
        model = _FixedPredictions([32.0, 32.0, 32.0, 32.0, 1.0, 0.6, 0.35])
        calls = iter([False, True])
        options = EvalOptions(num_classes=2, interrupt=lambda: next(calls))
        DETECT.evaluate(model, [_batch(0), _batch(0)], options, DistContext())


def _interrupt_on_rank_1(ctx: DistContext, flag_after: int) -> tuple[str, int, int]:
    """Rank 0's flag never turns true; rank 1's after `flag_after` of its 3 batches were drawn."""
    return _evaluate_with_interrupt(3, flag_after if ctx.rank == 1 else None, ctx)


@pytest.mark.distributed
def test_a_rank_interrupted_alone_interrupts_every_rank_after_its_loop(tmp_path) -> None:
    from tests.dist_helpers import run_distributed

    # Rank 0 evaluated its whole share, rank 1 one batch: neither returns metrics of a part of the set.
    ended = run_distributed(_interrupt_on_rank_1, 2, tmp_path / "mid", 1)
    assert ended == [("interrupted", 3, 3), ("interrupted", 1, 2)]
    # Rank 1's flag turning true after its last batch: both evaluated everything, both score all 6 images.
    ended = run_distributed(_interrupt_on_rank_1, 2, tmp_path / "after", 3)
    assert ended == [("scored", 6, 3), ("scored", 6, 3)]
