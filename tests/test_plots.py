"""Run-folder figures: labels drawn where they belong on batch images, labels.jpg, val batches, results.png, curves."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from torch import nn

import utils.distributed
from segment.task import SEGMENT
from tests.conftest import make_tiny_dataset
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.loader import build_val_loader
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext
from utils.eval.evaluate import EvalOptions
from utils.eval.metrics import DetectionMetrics
from utils.families import build_model as build_family_model
from utils.plots import (
    class_colour,
    column_fractions,
    plot_batch,
    plot_confusion_matrix,
    plot_curves,
    plot_labels,
    plot_results,
    plot_start,
    val_batch_drawer,
)
from utils.tasks import DETECT

SIDE = 64


def _black_batch(num_images: int, targets: list[list[float]]) -> dict:
    return {
        "images": torch.zeros((num_images, SIDE, SIDE, 3), dtype=torch.uint8),
        "targets": torch.tensor(targets, dtype=torch.float32).reshape(-1, 6),
    }


def _read(path: Path) -> np.ndarray:
    image = cv2.imread(str(path))
    assert image is not None, path
    return image


def test_plot_batch_draws_each_box_in_its_tile_and_class_colour(tmp_path: Path) -> None:
    # Image 1 (second tile of a 2 x 2 grid) has one class-2 box spanning x 16..48, y 24..56.
    batch = _black_batch(3, [[1, 2, 0.5, 0.625, 0.5, 0.5]])
    image = _read(plot_batch(batch, ["a", "b", "c"], tmp_path / "batch.png"))
    assert image.shape == (2 * SIDE, 2 * SIDE, 3)
    tile = image[:SIDE, SIDE:]
    colour = np.array(class_colour(2))
    assert np.abs(tile[40, 16].astype(int) - colour).max() <= 2, "left edge of the box in the class colour"
    assert np.abs(tile[56, 32].astype(int) - colour).max() <= 2, "bottom edge"
    assert not tile[40, 32].any(), "inside the box stays black"
    assert not image[SIDE + 10 : 2 * SIDE - 10, 10 : SIDE - 10].any(), "image 2 has no labels"
    assert (image[SIDE:, SIDE:] == 255).all(), "the grid's empty fourth cell"


def test_plot_batch_tints_masks_only_inside_them_per_instance_or_overlap(tmp_path: Path) -> None:
    # Two images, two instances both in image 0: as many instances as images, so only the dtype
    # tells per-instance (uint8, one row per label) from overlap-index (int16, one per image) masks.
    targets = [[0, 0, 0.25, 0.25, 0.5, 0.5], [0, 1, 0.75, 0.75, 0.5, 0.5]]
    per_instance = torch.zeros((2, SIDE // 4, SIDE // 4), dtype=torch.uint8)
    per_instance[0, :8, :8] = 1  # top-left quarter, class 0
    per_instance[1, 8:, 8:] = 1  # bottom-right quarter, class 1
    overlap = torch.zeros((2, SIDE // 4, SIDE // 4), dtype=torch.int16)
    overlap[0] = per_instance[0] + 2 * per_instance[1]  # image 0: 1, 2 = instance, 0 = background
    drawn = []
    for name, masks in (("instance", per_instance), ("overlap", overlap)):
        batch = {**_black_batch(2, targets), "masks": masks}
        drawn.append(_read(plot_batch(batch, ["a", "b"], tmp_path / f"{name}.png")))
    np.testing.assert_array_equal(drawn[0], drawn[1])
    tile = drawn[0][:SIDE, :SIDE]
    for (y, x), class_id in (((16, 16), 0), ((48, 48), 1)):
        tint = (np.array(class_colour(class_id)) * 0.5).astype(int)
        assert np.abs(tile[y, x].astype(int) - tint).max() <= 2, f"class {class_id} mask tinted half-way"
    assert not tile[16, 48].any() and not tile[48, 16].any(), "outside both masks stays black"
    assert not drawn[0][SIDE + 8 : 2 * SIDE - 8, 8 : SIDE - 8].any(), "image 1 has no instances"


def test_plot_results_writes_one_panel_per_column(tmp_path: Path) -> None:
    rows = [
        {"epoch": str(epoch), "train/box_loss": str(loss), "metrics/mAP50": str(score), "val/box_loss": "nan"}
        for epoch, loss, score in ((1, 0.2, 0.1), (2, 0.15, 0.3), (3, 0.1, 0.5))
    ]
    image = _read(plot_results(rows, tmp_path / "results.png"))
    assert image.shape[1] > image.shape[0] > 0  # one row of panels
    assert plot_results([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_plot_curves_writes_four_figures_and_nothing_without_labels(tmp_path: Path) -> None:
    tp = np.array([[True], [True], [False], [True]]).repeat(10, 1)
    metrics = DetectionMetrics.from_stats(tp, np.array([0.9, 0.8, 0.7, 0.6]), np.zeros(4), np.zeros(4), 2)
    written = plot_curves(metrics, ["a", "b"], tmp_path, prefix="mask_")
    assert {p.name for p in written} == {f"mask_{n}_curve.png" for n in ("F1", "P", "PR", "R")}
    assert all(_read(p).std() > 0 for p in written)
    none = DetectionMetrics.from_stats(np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.zeros(0), 2)
    assert plot_curves(none, ["a", "b"], tmp_path / "none") == []


def test_plot_confusion_matrix_normalises_true_columns(tmp_path: Path) -> None:
    matrix = np.array([[3, 0, 1], [1, 0, 0], [0, 0, 0]])  # [predicted, true]; class b never appears
    np.testing.assert_allclose(column_fractions(matrix), [[0.75, 0, 1], [0.25, 0, 0], [0, 0, 0]])
    image = _read(plot_confusion_matrix(matrix, ["a", "b"], tmp_path / "cm.png"))
    assert image.shape[0] > 100 and image.std() > 0


def _pixels_near(image: np.ndarray, bgr: tuple[int, int, int], tolerance: int = 12) -> int:
    """How many pixels of `image` are within `tolerance` of colour `bgr` in every channel (JPEG shifts colours)."""
    return int((np.abs(image.astype(int) - np.array(bgr)).max(axis=2) <= tolerance).sum())


def _write_labelled_images(root: Path, labels_per_image: list[list[str]]) -> Path:
    """Write one grey 64 x 48 image per entry under root/images with its YOLO label lines; return the folder."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for i, lines in enumerate(labels_per_image):
        cv2.imwrite(str(root / "images" / f"{i}.jpg"), np.full((48, 64, 3), 114, np.uint8))
        (root / "labels" / f"{i}.txt").write_text("\n".join(lines) + "\n")
    return root / "images"


def test_plot_labels_draws_a_bar_for_each_class_with_instances(tmp_path: Path) -> None:
    # Classes a and c have instances, b has none: only their bars (in the class colour) are drawn.
    labels = np.array([[0, 0.2, 0.3, 0.1, 0.2], [0, 0.6, 0.5, 0.3, 0.3], [2, 0.5, 0.5, 0.5, 0.4]], np.float32)
    image = _read(plot_labels(labels, ["a", "b", "c"], tmp_path / "labels.jpg"))
    assert image.shape[1] > image.shape[0] > 200
    bars = image[:, : image.shape[1] // 3]  # the first of three panels
    assert _pixels_near(bars, class_colour(0)) > 500 and _pixels_near(bars, class_colour(2)) > 500
    assert _pixels_near(bars, class_colour(1)) < 50
    assert _read(plot_labels(np.zeros((0, 5), np.float32), ["a"], tmp_path / "empty.jpg")).std() > 0


def test_plot_start_draws_every_label_of_the_split_on_a_rank_with_half_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 of 2 samples and caches only its shard, but its dataset holds every image's labels,
    # so labels.jpg describes the whole split. (The label scan's barrier needs a process group: skipped.)
    monkeypatch.setattr(utils.distributed, "barrier", lambda ctx: None)
    lines = [["0 0.5 0.5 0.2 0.2"], ["1 0.25 0.25 0.1 0.4", "1 0.75 0.75 0.2 0.2"], ["0 0.4 0.6 0.3 0.3"], []]
    images = _write_labelled_images(tmp_path / "data", lines)
    ctx = DistContext(rank=0, world_size=2)
    dataset = LoadImagesAndLabels(images, DatasetOptions(num_classes=2, augment=True, img_size=64, workers=1), ctx)
    assert len(dataset.shard) == 2 and len(dataset) == 4
    assert sorted(dataset.labels[:, 0].tolist()) == [0, 0, 1, 1]
    written = plot_start(dataset.labels, ["circle", "square"], tmp_path / "run")
    assert written == [tmp_path / "run" / "labels.jpg"] and _read(written[0]).std() > 0


def test_plot_start_warns_instead_of_failing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert plot_start(np.zeros((3, 2), np.float32), ["a"], tmp_path) == []  # malformed labels
    assert "labels.jpg not drawn" in caplog.text and not (tmp_path / "labels.jpg").exists()


class _FixedDetections(nn.Module):
    """A 'model' whose eval output is fixed decoded rows [cx, cy, w, h, obj, class scores..., mask coeffs...] per image.

    For segmentation it also returns one prototype, logit +10 everywhere, so each mask is its box.
    """

    def __init__(self, rows: list[list[float]], num_masks: int = 0) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.tensor(rows), requires_grad=False)
        self.head = SimpleNamespace(num_masks=num_masks)  # what the scorer is made from (utils/backends: module_info)
        self.stride = torch.tensor([8.0, 16.0, 32.0])

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Any]:
        decoded = self.rows.expand(len(images), -1, -1)
        if not self.head.num_masks:
            return decoded, []
        protos = torch.full((len(images), self.head.num_masks, SIDE // 4, SIDE // 4), 10.0)
        return decoded, ([], protos)


def _val_batch(with_masks: bool) -> dict:
    """One black 64 x 64 image whose one label is a class-1 box at x 8..24, y 40..56 (a square polygon)."""
    batch = {
        **_black_batch(1, [[0, 1, 0.25, 0.75, 0.25, 0.25]]),
        "paths": ["a.jpg"],
        "shapes": [((SIDE, SIDE), ((1.0, 1.0), (0.0, 0.0)))],
    }
    if with_masks:
        square = np.array([[8, 40], [24, 40], [24, 56], [8, 56]], np.float32) / SIDE
        batch.update(segments=[[square]], masks=torch.zeros((1, SIDE // 4, SIDE // 4), dtype=torch.uint8))
    return batch


def _fixed_model(with_masks: bool) -> _FixedDetections:
    """A class-0 box at x 16..48, y 8..40 scoring 0.6 and a class-2 box scoring 0.2 (not drawn: < 0.25)."""
    coeffs = [1.0] if with_masks else []
    rows = [[32, 24, 32, 32, 1.0, 0.6, 0.0, 0.0, *coeffs], [32, 48, 16, 16, 1.0, 0.0, 0.0, 0.2, *coeffs]]
    return _FixedDetections(rows, num_masks=len(coeffs))


@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=["detect", "segment"])
def test_evaluation_hook_gets_the_confident_predictions_as_a_drawable_batch(task) -> None:
    seen = []
    options = EvalOptions(num_classes=3, on_batch=lambda i, batch, predicted: seen.append((i, predicted(0.25))))
    task.evaluate(_fixed_model(task.with_masks), [_val_batch(task.with_masks)] * 2, options, DistContext())
    assert [i for i, _ in seen] == [0, 1]
    drawn = seen[0][1]
    assert drawn["images"].shape == (1, SIDE, SIDE, 3)
    # [image, class, cx, cy, w, h, conf], normalised: only the 0.6 box.
    torch.testing.assert_close(drawn["targets"], torch.tensor([[0, 0, 0.5, 0.375, 0.5, 0.5, 0.6]]))
    if task.with_masks:  # one mask per drawn box, at input size, equal to the box (the prototype is all +10)
        expected = torch.zeros((1, SIDE, SIDE), dtype=torch.uint8)
        expected[0, 8:40, 16:48] = 1
        torch.testing.assert_close(drawn["masks"], expected)
    else:
        assert "masks" not in drawn


@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=["detect", "segment"])
def test_val_batch_drawer_draws_labels_and_predictions_of_the_first_two_batches(task, tmp_path: Path) -> None:
    saved = []
    options = EvalOptions(num_classes=3, on_batch=val_batch_drawer(tmp_path, ["a", "b", "c"], saved.append))
    task.evaluate(_fixed_model(task.with_masks), [_val_batch(task.with_masks)] * 3, options, DistContext())
    names = ["val_batch0_labels.jpg", "val_batch0_pred.jpg", "val_batch1_labels.jpg", "val_batch1_pred.jpg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names and sorted(p.name for p in saved) == names
    labels, pred = (_read(tmp_path / f"val_batch0_{kind}.jpg")[:SIDE, :SIDE] for kind in ("labels", "pred"))
    # Left edges (1 px lines, blurred by JPEG): the class-1 label at x 8, y 40..56; the prediction at x 16, y 8..40.
    label_edge, pred_edge = (slice(44, 52), slice(7, 10)), (slice(14, 34), slice(15, 18))
    assert labels[label_edge].max() > 60 and not pred[label_edge].max() > 60, "labels only on the labels image"
    assert pred[pred_edge].max() > 60 and not labels[pred_edge].max() > 60, "predictions only on the pred image"
    assert _pixels_near(pred, class_colour(2), tolerance=40) < 5, "the 0.2 detection is not drawn"
    inside = pred[28:36, 24:40].reshape(-1, 3).mean(0)  # inside the predicted box, below its name and score
    if task.with_masks:
        assert np.abs(inside - np.array(class_colour(0)) * 0.5).max() <= 20, inside  # tinted half-way
    else:
        assert inside.max() <= 20, inside


@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=["detect", "segment"])
def test_evaluation_of_a_tiny_model_writes_val_batch_images(task, tmp_path: Path, one_torch_thread) -> None:
    make_tiny_dataset(tmp_path, SyntheticSpec(num_train=1, num_val=6, max_objects=3, min_side=64, max_side=96))
    spec = task.spec_from_cfg("yolov5n", len(SHAPE_NAMES))
    model = build_family_model(spec).eval()
    options = DatasetOptions.for_evaluation(
        img_size=64, batch_size=3, num_classes=len(SHAPE_NAMES), with_masks=task.with_masks, workers=0
    )
    dataset = LoadImagesAndLabels(tmp_path / "shapes" / "images" / "val", options, DistContext())
    loader = build_val_loader(dataset, 3, 0, DistContext())
    saved: list[Path] = []
    drawer = val_batch_drawer(tmp_path / "run", SHAPE_NAMES, on_saved=saved.append)
    task.evaluate(model, loader, EvalOptions(num_classes=len(SHAPE_NAMES), on_batch=drawer), DistContext())
    assert [path.stem for path in saved] == [f"val_batch{i}_{kind}" for i in (0, 1) for kind in ("labels", "pred")]
    for batch in (0, 1):
        labels = _read(tmp_path / "run" / f"val_batch{batch}_labels.jpg").astype(np.int16)
        pred = _read(tmp_path / "run" / f"val_batch{batch}_pred.jpg").astype(np.int16)
        # The same images; an untrained model scores nothing above PLOT_CONF, so only the labels image has boxes:
        # a drawer that draws no labels (or draws them on both) leaves the two files alike.
        assert labels.shape == pred.shape and labels.shape[0] >= 64
        changed = (np.abs(labels - pred).max(axis=2) > 40).mean()
        assert changed > 0.002, f"batch {batch}: labels and predictions images differ in {changed:.2%} of pixels"
