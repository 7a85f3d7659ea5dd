"""Run-folder figures: labels.jpg, labelled train / val batches, results.png, PR / F1 / P / R curves, confusion matrix.

Only rank 0 calls these. Batch images are drawn with OpenCV (fast enough to run inside the first
training steps); the charts use matplotlib's non-interactive Agg backend, imported on first use
so a run with `--noplots` never loads it. The hooks the engine calls (`plot_start`, `batch_drawer`,
`val_batch_drawer`, `plot_run`) log a failure as a warning instead of raising: a figure is never
worth a failed run, and the drawers run on rank 0 alone between collectives, where raising would
leave the others waiting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import torch

from utils.data.batch import images_on_device

if TYPE_CHECKING:  # figures of evaluation results: the types only, so evaluation can draw without a cycle
    from utils.eval.evaluate import EvalResult, PredictedBatch
    from utils.eval.metrics import DetectionMetrics
    from utils.train.results import ResultsCSV

LOGGER = logging.getLogger(__name__)
TRAIN_BATCH_PLOTS = 3  # train_batch0.jpg ... of the first epoch, to check labels and augmentation by eye
VAL_BATCH_PLOTS = 2  # val_batch0_labels.jpg / val_batch0_pred.jpg ... of the final validation
PLOT_CONF = 0.25  # detections drawn on val_batch*_pred.jpg score above this (YOLOv5's plot_images threshold)
OnSaved = Callable[[Path], None]  # told of each figure a drawer wrote (the TensorBoard logger adds it)


def plot_start(labels: np.ndarray, names: Sequence[str], run_dir: Path) -> list[Path]:
    """At the start of a run: labels.jpg from the training split's labels (`plot_labels`); returns what was written."""
    try:
        return [plot_labels(labels, names, run_dir / "labels.jpg")]
    except Exception as error:  # noqa: BLE001 - skipped with a warning (see the module docstring)
        LOGGER.warning(f"labels.jpg not drawn: {type(error).__name__}: {error}")
        return []


def batch_drawer(run_dir: Path, names: Sequence[str], on_saved: OnSaved | None = None) -> Callable[..., None]:
    """Return a `train_one_epoch` `on_batch` hook saving the first TRAIN_BATCH_PLOTS batches with their labels."""

    def draw(i: int, batch: dict[str, Any]) -> None:
        if i < TRAIN_BATCH_PLOTS:
            _draw_safely(lambda: _colour_jittered(batch), names, run_dir / f"train_batch{i}.jpg", on_saved)

    return draw


def _colour_jittered(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with the HSV gains it carries (colour work left to the device on CUDA) applied, in RGB."""
    if "hsv_gains" not in batch:
        return batch
    images = images_on_device(batch, torch.device("cpu"))
    return {**batch, "images": (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()}


def val_batch_drawer(save_dir: Path, names: Sequence[str], on_saved: OnSaved | None = None) -> Callable[..., None]:
    """Return an `EvalOptions.on_batch` hook drawing the first VAL_BATCH_PLOTS batches, labels and predictions.

    Batch i gives val_batch{i}_labels.jpg (the ground truth) and val_batch{i}_pred.jpg (detections
    above PLOT_CONF with class name and score, masks tinted for segmentation), as YOLOv5's val.py
    draws them. Give it to rank 0's evaluation only: it sees that rank's first batches.
    """

    def draw(i: int, batch: dict[str, Any], predicted: PredictedBatch) -> None:
        if i < VAL_BATCH_PLOTS:
            _draw_safely(lambda: batch, names, save_dir / f"val_batch{i}_labels.jpg", on_saved)
            _draw_safely(lambda: predicted(PLOT_CONF), names, save_dir / f"val_batch{i}_pred.jpg", on_saved)

    return draw


def _draw_safely(
    make_batch: Callable[[], dict[str, Any]], names: Sequence[str], path: Path, on_saved: OnSaved | None
) -> None:
    """`plot_batch(make_batch(), names, path)`, then `on_saved(path)`; a failure is a warning naming the file."""
    try:
        plot_batch(make_batch(), names, path)
    except Exception as error:  # noqa: BLE001 - skipped with a warning (see the module docstring)
        LOGGER.warning(f"{path.name} not drawn: {type(error).__name__}: {error}")
        return
    if on_saved is not None:
        on_saved(path)


def plot_run(results: ResultsCSV, result: EvalResult, names: Sequence[str], run_dir: Path) -> list[Path]:
    """At the end of a run: results.png and the final validation's figures (`plot_evaluation`); returns them."""
    try:
        written = [plot_results(results.read(), run_dir / "results.png"), *plot_evaluation(result, names, run_dir)]
    except Exception as error:  # noqa: BLE001 - the run's checkpoints are written; warn, do not fail it
        LOGGER.warning(f"plots not finished: {type(error).__name__}: {error}")
        return []
    written = [path for path in written if path is not None]
    LOGGER.info(f"Plots: {', '.join(p.name for p in written)} in {run_dir}")
    return written


def _palette(count: int) -> tuple[tuple[int, int, int], ...]:
    """`count` saturated BGR colours whose hues step by the golden ratio, so neighbours differ."""
    hues = (np.arange(count) * 0.618034 % 1.0 * 180).astype(np.uint8)  # OpenCV hue range is 0-179
    hsv = np.stack([hues, np.full(count, 220, np.uint8), np.full(count, 255, np.uint8)], axis=1)[None]
    return tuple(tuple(int(v) for v in bgr) for bgr in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0])


PALETTE = _palette(20)  # BGR colours cycled by class id
MAX_LEGEND_CLASSES = 20  # per-class curves get a legend entry only up to this many classes


def class_colour(class_id: int) -> tuple[int, int, int]:
    """Return the BGR colour used for `class_id` in every figure."""
    return PALETTE[int(class_id) % len(PALETTE)]


def plot_batch(batch: dict[str, Any], names: Sequence[str], path: Path, max_images: int = 16) -> Path:
    """Draw up to `max_images` images of a collated batch in a grid, with their labels; save as `path`.

    `batch` is what the loader yields (uint8 RGB `images (B, H, W, 3)`, `targets (N, 6)` [image,
    class, cx, cy, w, h] normalised; with `masks`, per-instance uint8 `(N, h, w)` or int16
    overlap-index `(B, h, w)` masks are tinted in the class colour). Boxes are drawn in the class
    colour with the class name above them. Predictions (`PredictedBatch`) have `targets (N, 7)`,
    the score in the last column, drawn after the name. Returns `path`.
    """
    images = batch["images"][:max_images].numpy()
    count, height, width = images.shape[:3]
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    grid = np.full((rows * height, columns * width, 3), 255, np.uint8)
    targets = batch["targets"].numpy()
    masks = batch.get("masks")
    overlap = masks is not None and masks.dtype == torch.int16  # (B, h, w) index masks (see utils/data/masks.py)
    for index in range(count):
        top, left = (index // columns) * height, (index % columns) * width
        tile = np.ascontiguousarray(images[index][:, :, ::-1])  # RGB -> OpenCV's BGR
        rows_here = np.flatnonzero(targets[:, 0] == index)
        if masks is not None and len(rows_here):
            instance_masks = _instance_masks(masks, index, rows_here, overlap)
            _tint_masks(tile, instance_masks, targets[rows_here, 1])
        for row in rows_here:
            _draw_box(tile, targets[row, 1:], names)
        cv2.rectangle(tile, (0, 0), (width - 1, height - 1), (255, 255, 255), 1)  # tile border
        grid[top : top + height, left : left + width] = tile
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), grid):
        raise OSError(f"{path}: could not write the image")
    return path


def _instance_masks(masks: torch.Tensor, image: int, rows: np.ndarray, overlap: bool) -> np.ndarray:
    """Return the image's instance masks `(n, h, w)` bool from per-instance or overlap-index masks."""
    if not overlap:
        return masks[torch.as_tensor(rows)].numpy() > 0.5
    index_mask = masks[image].numpy()
    return np.stack([index_mask == k + 1 for k in range(len(rows))])


def _tint_masks(tile: np.ndarray, masks: np.ndarray, classes: np.ndarray) -> None:
    """Blend each instance's mask (at any resolution) into `tile` in its class colour, in place."""
    height, width = tile.shape[:2]
    for mask, class_id in zip(masks, classes, strict=True):
        full = cv2.resize(mask.astype(np.uint8), (width, height), interpolation=cv2.INTER_NEAREST).astype(bool)
        tile[full] = (0.5 * tile[full] + 0.5 * np.array(class_colour(int(class_id)))).astype(np.uint8)


def _draw_box(tile: np.ndarray, label: np.ndarray, names: Sequence[str]) -> None:
    """Draw one normalised [class, cx, cy, w, h] label (or prediction, with its score after h) on a BGR tile."""
    height, width = tile.shape[:2]
    class_id, cx, cy, w, h, *score = label.tolist()
    x1, y1 = round((cx - w / 2) * width), round((cy - h / 2) * height)
    x2, y2 = round((cx + w / 2) * width), round((cy + h / 2) * height)
    colour = class_colour(int(class_id))
    cv2.rectangle(tile, (x1, y1), (x2, y2), colour, 1)
    name = names[int(class_id)] if int(class_id) < len(names) else str(int(class_id))
    name += f" {score[0]:.2f}" if score else ""
    cv2.putText(tile, name, (x1, max(y1 - 2, 8)), cv2.FONT_HERSHEY_SIMPLEX, 0.3, colour, 1, cv2.LINE_AA)


def _pyplot() -> Any:
    """Return matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_labels(labels: np.ndarray, names: Sequence[str], path: Path) -> Path:
    """Draw a split's label statistics (YOLOv5's labels.jpg); save as `path` and return it.

    `labels`: (M, 5) [class, cx, cy, w, h] normalised, every instance of the split
    (`LoadImagesAndLabels.labels`: each rank holds all of them, only the image cache is sharded).
    Three panels: instances per class (named up to MAX_LEGEND_CLASSES classes), a 2-D histogram
    of box centres (x, y, image orientation: y grows downwards) and one of box sizes (w, h).
    """
    classes = labels[:, 0].astype(np.int64)
    counts = np.bincount(classes, minlength=len(names))
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    colours = [tuple(v / 255 for v in class_colour(c)[::-1]) for c in range(len(counts))]  # BGR -> RGB in [0, 1]
    axes[0].bar(range(len(counts)), counts, color=colours)
    axes[0].set_ylabel("instances")
    axes[0].set_title(f"{len(labels)} instances, {int((counts > 0).sum())} of {len(counts)} classes")
    if len(counts) <= MAX_LEGEND_CLASSES:
        tick_names = [names[c] if c < len(names) else str(c) for c in range(len(counts))]
        axes[0].set_xticks(range(len(counts)), tick_names, rotation=90)
    else:
        axes[0].set_xlabel("class")
    for axis, (first, second), title in ((axes[1], (1, 2), "box centres"), (axes[2], (3, 4), "box sizes")):
        # Empty bins stay white (cmin); viridis starts dark, so a bin holding a single box is visible.
        *_, mesh = axis.hist2d(labels[:, first], labels[:, second], bins=50, range=[[0, 1], [0, 1]], cmin=1)
        figure.colorbar(mesh, ax=axis, fraction=0.046, label="boxes")
        x_name, y_name = ("x", "y") if first == 1 else ("width", "height")
        axis.set_xlabel(x_name)
        axis.set_ylabel(y_name)
        axis.set_title(f"{title} (normalised)")
        axis.set_aspect("equal")
    axes[1].invert_yaxis()  # as in the image: y = 0 is the top edge
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_results(rows: list[dict[str, str]], path: Path) -> Path | None:
    """Plot every column of results.csv `rows` (`ResultsCSV.read()`) against the epoch; save as `path`.

    One panel per column (train losses, metrics, val losses, learning rates). Returns `path`, or
    None when there are no epochs yet.
    """
    if not rows:
        return None
    columns = [name for name in rows[0] if name != "epoch"]
    epochs = [int(row["epoch"]) for row in rows]
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    per_row = 5
    figure, axes = plt.subplots(
        math.ceil(len(columns) / per_row), per_row, figsize=(3 * per_row, 2.6 * math.ceil(len(columns) / per_row))
    )
    axes = np.atleast_1d(axes).ravel()
    for axis, name in zip(axes, columns, strict=False):
        values = [float(row[name]) if row[name] not in ("", None) else float("nan") for row in rows]
        axis.plot(epochs, values, marker=".", linewidth=1.5)
        axis.set_title(name, fontsize=9)
        axis.tick_params(labelsize=7)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in axes[len(columns) :]:
        axis.axis("off")
    # Fixed spacing that fits the titles and tick labels of small panels: tight_layout measured every label of the
    # grid, which took longer than drawing it (about a second at the end of every run on a 2-core machine).
    figure.subplots_adjust(left=0.04, right=0.99, bottom=0.06, top=0.94, wspace=0.3, hspace=0.45)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_evaluation(result: EvalResult, names: Sequence[str], save_dir: Path) -> list[Path]:
    """Write an EvalResult's figures and return their paths.

    Box curves, `mask_` curves for segmentation, and confusion_matrix.png when it counted one.
    """
    # After COCOeval replaced the reported mAPs, say that the curves' APs are the internal matcher's.
    source = " (internal)" if result.metric_source != "internal" else ""
    written = plot_curves(result.metrics, names, save_dir, source=source)
    if result.mask_metrics is not None:
        written += plot_curves(result.mask_metrics, names, save_dir, prefix="mask_", source=source)
    if result.confusion is not None:
        written.append(plot_confusion_matrix(result.confusion.matrix, names, save_dir / "confusion_matrix.png"))
    return written


def column_fractions(matrix: np.ndarray) -> np.ndarray:
    """Return `matrix` with each column divided by its sum (all-zero columns stay 0)."""
    columns = matrix.sum(0, keepdims=True)
    return np.divide(matrix, columns, out=np.zeros(matrix.shape), where=columns > 0)


def plot_confusion_matrix(matrix: np.ndarray, names: Sequence[str], path: Path) -> Path:
    """Draw a `(nc + 1, nc + 1)` [predicted, true] count matrix with each true-class column normalised to 1.

    The last row and column are background (missed labels, detections of nothing). Cells are
    annotated with their fraction when there are at most MAX_LEGEND_CLASSES classes.
    """
    fractions = column_fractions(matrix)
    labels = [*names, "background"]
    plt = _pyplot()
    side = min(4 + 0.45 * len(labels), 24)
    figure, axis = plt.subplots(1, 1, figsize=(side, side * 0.85))
    image = axis.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axis, fraction=0.046)
    if len(names) <= MAX_LEGEND_CLASSES:
        axis.set_xticks(range(len(labels)), labels, rotation=90, fontsize=8)
        axis.set_yticks(range(len(labels)), labels, fontsize=8)
        for (row, column), value in np.ndenumerate(fractions):
            if value >= 0.005:
                colour = "white" if value > 0.6 else "black"
                axis.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    axis.set_xlabel("True")
    axis.set_ylabel("Predicted")
    axis.set_title("Confusion matrix (each true column sums to 1)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)
    return path


def plot_curves(
    metrics: DetectionMetrics, names: Sequence[str], save_dir: Path, prefix: str = "", source: str = ""
) -> list[Path]:
    """Write `{prefix}PR_curve.png`, `{prefix}F1_curve.png`, `{prefix}P_curve.png`, `{prefix}R_curve.png`.

    Thin lines per class (labelled up to MAX_LEGEND_CLASSES classes), a thick line for the mean
    over classes. PR is the interpolated precision at IoU 0.5 (its area is mAP50); F1 / P / R are
    against the confidence threshold, the F1 legend naming the best mean F1 and its confidence.
    `source` is appended to the PR legend's mAP. Returns the written paths (none when no class has labels).
    """
    curves = metrics.curves
    if curves is None or len(curves.class_ids) == 0:
        return []
    labels = [names[c] if c < len(names) else str(c) for c in curves.class_ids.tolist()]
    written = [
        _curve_figure(
            np.linspace(0.0, 1.0, curves.pr_curve.shape[1]),  # the recall levels AP interpolates at (101)
            curves.pr_curve,
            labels,
            ("Recall", "Precision"),
            f"all classes {curves.pr_curve.mean():.3f} mAP@0.5{source}",
            save_dir / f"{prefix}PR_curve.png",
            class_values=curves.ap[:, 0],
        )
    ]
    by_confidence = (("F1", "F1", curves.f1_curve), ("P", "Precision", curves.p_curve), ("R", "Recall", curves.r_curve))
    for short, title, values in by_confidence:
        mean = values.mean(0)
        best = int(mean.argmax())
        summary = f"all classes {mean[best]:.2f} at {curves.curve_conf[best]:.3f}"
        path = save_dir / f"{prefix}{short}_curve.png"
        written.append(_curve_figure(curves.curve_conf, values, labels, ("Confidence", title), summary, path))
    return written


def _curve_figure(
    x_values: np.ndarray,
    per_class: np.ndarray,
    labels: list[str],
    axis_names: tuple[str, str],
    mean_label: str,
    path: Path,
    class_values: np.ndarray | None = None,
) -> Path:
    """Draw one row of `per_class` (n, len(x_values)) per class and their mean; save as `path`."""
    plt = _pyplot()
    figure, axis = plt.subplots(1, 1, figsize=(7, 5))
    show_legend = len(labels) <= MAX_LEGEND_CLASSES
    for i, (row, label) in enumerate(zip(per_class, labels, strict=True)):
        text = f"{label} {class_values[i]:.3f}" if class_values is not None else label
        axis.plot(x_values, row, linewidth=1, alpha=0.6, label=text if show_legend else None)
    axis.plot(x_values, per_class.mean(0), linewidth=3, color="tab:blue", label=mean_label)
    axis.set_xlabel(axis_names[0])
    axis.set_ylabel(axis_names[1])
    axis.set_xlim(0, 1)
    axis.set_ylim(0, 1.02)
    axis.legend(loc="lower left" if axis_names[0] == "Recall" else "lower center", fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)
    return path
