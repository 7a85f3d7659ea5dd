"""Run-folder figures: labels drawn where they belong on batch images, results.png and the curves."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import torch

from utils.eval.metrics import DetectionMetrics
from utils.plots import class_colour, column_fractions, plot_batch, plot_confusion_matrix, plot_curves, plot_results

SIDE = 64


def _black_batch(num_images: int, targets: list[list[float]]) -> dict:
    return {
        "images": torch.zeros((num_images, 3, SIDE, SIDE), dtype=torch.uint8),
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
