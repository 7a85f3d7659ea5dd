"""The evaluation loop of every task: inference, NMS, box matching (DetectionScorer), metrics gathered over ranks."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from utils.backends import as_backend
from utils.boxes import box_iou, load_nms, scale_boxes, xywh_to_xyxy, xyxy_to_xywhn
from utils.data.batch import image_hw, images_on_device
from utils.distributed import DistContext, all_gather_objects, all_reduce_sum
from utils.eval.metrics import ConfusionMatrix, DetectionMetrics, iou_thresholds, match_predictions
from utils.logs import tqdm_disabled

LOGGER = logging.getLogger(__name__)
# batch, device -> the loss's keyword inputs (targets, and masks for segmentation): Task.loss_inputs.
LossInputs = Callable[[dict[str, Any], torch.device], dict[str, torch.Tensor]]
# conf_thres -> one evaluated batch with its detections above conf_thres as labels (DetectionScorer.predicted_batch).
PredictedBatch = Callable[[float], dict[str, Any]]
# (batch index, batch as loaded, its predictions) -> None: EvalOptions.on_batch, e.g. utils.plots.val_batch_drawer.
BatchHook = Callable[[int, dict[str, Any], PredictedBatch], None]


@dataclass(frozen=True)
class EvalOptions:
    """What the evaluation loop needs besides the model and the data."""

    num_classes: int
    conf_thres: float = 0.001
    iou_thres: float = 0.6
    max_det: int = 300
    # mAP: a box is kept once per class scoring above conf_thres (YOLOv5's and Ultralytics' validators);
    # False keeps only each box's best class, as a deployed detector reports it.
    multi_label: bool = True
    # Every class scored as one (val --single-cls with a multi-class model, as YOLOv5's): each box once, with
    # its best class's score, suppressed across classes, and its class set to 0.
    class_agnostic: bool = False
    collect_predictions: bool = False  # keep per-image boxes in original pixels (COCO JSON, --save-txt)
    collect_masks: bool = True  # with collect_predictions: also keep RLE masks (segmentation, COCO JSON)
    confusion: bool = False  # also count a box confusion matrix (conf > 0.25, IoU > 0.45), summed over ranks
    description: str = "val"
    # Sees every batch after NMS (rank 0 draws val_batch*.jpg with it). May differ between ranks, so it
    # must not run collectives; predictions are only built when it calls the PredictedBatch it gets.
    on_batch: BatchHook | None = None
    # Asked before each batch (training passes its stop-signal flag): once true, this rank evaluates no more
    # batches, and when any rank stopped early every rank raises EvalInterrupted instead of scoring a part of
    # the set. One small all-reduce after the loop when set; None: the loop always runs to its end.
    interrupt: Callable[[], bool] | None = None


class EvalInterrupted(Exception):
    """`EvalOptions.interrupt` stopped the evaluation on some rank: no rank returns metrics of a part of the set."""

    def __init__(self, evaluated: int, total: int | None) -> None:
        of = f" of {total}" if total is not None else ""
        super().__init__(f"evaluation interrupted after {evaluated}{of} batches on this rank")
        self.evaluated, self.total = evaluated, total


@dataclass
class ImagePredictions:
    """Detections of one image in original-image pixels: rows x1 y1 x2 y2 conf cls (float32 numpy)."""

    path: str
    orig_hw: tuple[int, int]
    detections: np.ndarray
    masks_rle: list[dict] | None = None  # segmentation: pycocotools RLE per detection at original size


@dataclass
class EvalResult:
    """Metrics of one evaluation, identical on every rank."""

    metrics: DetectionMetrics
    num_images: int
    num_instances: int
    loss_items: np.ndarray | None  # mean validation losses (the loss's item_names), None without a loss function
    # Per image over every rank's images (each rank's seconds summed, over all images): preprocess, inference,
    # nms (CUDA: each shape warmed untimed).
    speed_ms: dict[str, float]
    class_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # labels per class, all ranks
    predictions: list[ImagePredictions] = field(default_factory=list)  # this rank's only
    mask_metrics: DetectionMetrics | None = None  # segmentation: the same metrics on masks
    metric_source: str = "internal"  # or "pycocotools" once COCOeval replaced the mAPs
    mask_metric_source: str = "internal"  # the same for `mask_metrics` (segm needs usable ground-truth masks)
    confusion: ConfusionMatrix | None = None  # with EvalOptions.confusion: all ranks' images
    # Images holding at least one label of each class, all ranks: the verbose table's per-class "Images".
    class_images: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def as_dict(self) -> dict[str, float]:
        """Return precision, recall, mAP50, mAP50-95 (box), mask_* (segmentation) and fitness (box + mask)."""
        out = self.metrics.as_dict()
        if self.mask_metrics is not None:
            masks = self.mask_metrics.as_dict()
            out.update({f"mask_{key}": value for key, value in masks.items() if key != "fitness"})
            out["fitness"] += masks["fitness"]
        return out


@dataclass
class ImageScore:
    """One image's evaluation: detections in original pixels and which are correct at each IoU threshold."""

    detections: np.ndarray  # (n, 6) x1 y1 x2 y2 conf cls, original-image pixels
    correct: np.ndarray  # (n, 10) bool, box IoU
    target_cls: np.ndarray  # (m,) classes of the image's labels
    mask_correct: np.ndarray | None = None  # (n, 10) bool, mask IoU (segmentation)
    masks_rle: list[dict] | None = None  # segmentation with collect_predictions


class DetectionScorer:
    """The detection-specific steps of the evaluation loop; SegmentationScorer extends it with masks.

    `split_output` separates the eval forward's output into decoded predictions and what the loss
    takes; `score_batch` matches one batch.
    """

    num_masks = 0
    with_masks = False

    def split_output(self, output: Any) -> tuple[torch.Tensor, Any]:
        """Return (decoded (B, N, no), loss input) from the eval forward's output."""
        return output[0], output[1]

    def score_batch(
        self, outputs: list[torch.Tensor], loss_input: Any, targets: torch.Tensor, batch: dict[str, Any], collect: bool
    ) -> list[ImageScore]:
        """Match each image's NMS output against its labels; targets (N, 6) with boxes in input pixels."""
        input_hw = image_hw(batch["images"])
        scores = []
        for index, pred in enumerate(outputs):
            labels = targets[targets[:, 0] == index, 1:]
            detections, correct = match_image_boxes(pred, labels, batch["shapes"][index], input_hw)
            scores.append(ImageScore(detections.cpu().numpy(), correct, labels[:, 0].cpu().numpy()))
        return scores

    def predicted_batch(
        self, batch: dict[str, Any], outputs: list[torch.Tensor], loss_input: Any, conf_thres: float
    ) -> dict[str, Any]:
        """Return `batch`'s images with its detections above `conf_thres` as labels, for drawing.

        outputs: NMS rows per image (n, 6+) x1 y1 x2 y2 conf cls in input pixels. The result has
        `images` and `targets (N, 7)` [image, cls, cx, cy, w, h, conf] normalised (on the CPU), the
        layout `utils.plots.plot_batch` draws with scores.
        """
        height, width = image_hw(batch["images"])
        rows = []
        for index, pred in enumerate(outputs):
            kept = pred[pred[:, 4] > conf_thres, :6].float()
            boxes = xyxy_to_xywhn(kept[:, :4], width, height, clip=True)
            rows.append(torch.cat((kept.new_full((len(kept), 1), index), kept[:, 5:6], boxes, kept[:, 4:5]), 1))
        targets = torch.cat(rows).cpu() if rows else torch.zeros((0, 7))
        return {"images": batch["images"], "targets": targets}


@dataclass
class _Stats:
    correct: list[np.ndarray] = field(default_factory=list)
    conf: list[np.ndarray] = field(default_factory=list)
    pred_cls: list[np.ndarray] = field(default_factory=list)
    target_cls: list[np.ndarray] = field(default_factory=list)
    mask_correct: list[np.ndarray] = field(default_factory=list)
    image_classes: list[np.ndarray] = field(default_factory=list)  # each image's distinct label classes

    def add(self, score: ImageScore) -> None:
        self.correct.append(score.correct)
        self.conf.append(score.detections[:, 4])
        self.pred_cls.append(score.detections[:, 5])
        self.target_cls.append(score.target_cls)
        self.image_classes.append(np.unique(score.target_cls))
        if score.mask_correct is not None:
            self.mask_correct.append(score.mask_correct)

    def concatenated(self) -> tuple[np.ndarray, ...]:
        """(correct, conf, pred_cls, target_cls, mask_correct, image_classes), each joined over this rank's images."""
        empty = (np.zeros((0, 10), bool), np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32))
        parts = (self.correct, self.conf, self.pred_cls, self.target_cls, self.mask_correct, self.image_classes)
        empties = (*empty, empty[0], empty[3])
        return tuple(np.concatenate(p, 0) if p else e for p, e in zip(parts, empties, strict=True))


def match_image_boxes(pred: torch.Tensor, labels: torch.Tensor, shape: Any, input_hw: tuple[int, int]) -> tuple:
    """Scale one image's detections and labels to original pixels and match them at 10 IoU thresholds.

    pred: (n, 6+) x1 y1 x2 y2 conf cls in input pixels; labels: (m, 5) cls cx cy w h in input pixels.
    Returns (detections (n, 6) in original pixels, correct (n, 10) bool numpy).
    """
    orig_hw, ratio_pad = shape
    detections = pred[:, :6].clone()
    detections[:, :4] = scale_boxes(detections[:, :4], input_hw, orig_hw, ratio_pad)
    true_boxes = xywh_to_xyxy(labels[:, 1:5].clone())
    true_boxes = scale_boxes(true_boxes, input_hw, orig_hw, ratio_pad)
    iou = box_iou(true_boxes, detections[:, :4]) if len(detections) and len(labels) else None
    return detections, match_classes(detections, labels[:, 0], iou)


def match_classes(detections: torch.Tensor, true_cls: torch.Tensor, iou: torch.Tensor | None) -> np.ndarray:
    """Return (n_pred, 10) bool: detection j (rows x1 y1 x2 y2 conf cls) is a true positive at each IoU threshold.

    `iou` (n_true, n_pred) is box or mask IoU; None means nothing can match. Matching follows
    pycocotools: detections in descending confidence take their best unmatched label.
    """
    if iou is None:
        return np.zeros((len(detections), 10), bool)
    return match_predictions(
        detections[:, 5].cpu().numpy(),
        true_cls.cpu().numpy(),
        iou.cpu().numpy(),
        iou_thresholds().numpy(),
        detections[:, 4].cpu().numpy(),
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    options: EvalOptions,
    ctx: DistContext,
    *,
    scorer: DetectionScorer | None = None,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_inputs: LossInputs | None = None,
) -> EvalResult:
    """Run `model` (eval mode) over this rank's validation batches and return metrics over all ranks.

    The one evaluation loop of every task (call it through `Task.evaluate`, which supplies the
    task's scorer and loss inputs). Every rank must call it: per-image match statistics are
    gathered from all ranks (the val sampler shards images without padding, so each image is
    scored exactly once) and every rank computes the same metrics. `model` is an inference backend
    (utils/backends: val.py's checkpoint or exported file) or a plain module (the EMA or an
    unwrapped model), never DDP, so ranks with different numbers of batches never meet in a
    collective mid-loop. `scorer` holds the task-specific matching (DetectionScorer by default).
    With `loss_fn`, the mean validation loss is computed too, from the inputs `loss_inputs(batch,
    device)` gives (the same Task hook the training loop uses).
    `options.on_batch`, when set, sees each batch after NMS (rank 0 draws the first ones);
    `options.interrupt`, when set, can end the loop early on every rank with EvalInterrupted.
    """
    scorer = scorer or DetectionScorer()
    model = as_backend(model)  # a loaded file's backend, or the live model training hands in
    select = model.selector()  # NMS over the family's layout, or an end-to-end top-k
    load_nms()  # before the first timed NMS
    device, dtype = model.device, model.dtype  # the input in the model's precision (half after val.py --half)
    was_training = model.training
    model.eval()
    stats, predictions = _Stats(), []
    confusion = ConfusionMatrix(options.num_classes) if options.confusion else None
    loss_sum = torch.zeros(len(getattr(loss_fn, "item_names", ())) or 3, device=device)
    seen = torch.zeros(2, device=device)  # images, batches with loss
    timings = np.zeros(3)
    warmed: set[torch.Size] = set()
    progress = tqdm(batches, desc=options.description, disable=tqdm_disabled(ctx), leave=False)
    evaluated, stopped = 0, False
    for batch_index, batch in enumerate(progress):
        if options.interrupt is not None and options.interrupt():
            stopped = True
            progress.close()
            break
        evaluated = batch_index + 1
        start = time.perf_counter()
        images = images_on_device(batch, device, dtype)
        targets = batch["targets"].to(device, copy=True)  # scaled in place below; never touch the batch
        _sync(device)
        after_pre = time.perf_counter()
        if device.type == "cuda" and images.shape not in warmed:
            # Untimed: CUDA's first call at a shape loads and picks its kernels (about 100 ms per --rect shape on
            # an H200), a one-off cost that made fp16 read slower than fp32 on 200 images.
            warmed.add(images.shape)
            model(images)
            _sync(device)
        before_inference = time.perf_counter()
        decoded, loss_input = scorer.split_output(model(images))
        _sync(device)
        after_inference = time.perf_counter()
        if loss_fn is not None and loss_inputs is not None:
            loss_sum += loss_fn(loss_input, **loss_inputs(batch, device))[1]
            seen[1] += 1
        targets[:, 2:6] *= torch.tensor(images.shape[2:], device=device).flip(0).repeat(2)  # to input pixels (W, H)
        nms = functools.partial(
            _select, select, decoded.float(), iou_thres=options.iou_thres, max_det=options.max_det,
            num_masks=scorer.num_masks, agnostic=options.class_agnostic,
        )  # fmt: skip
        outputs = nms(options.conf_thres, multi_label=options.multi_label and not options.class_agnostic)
        after_nms = time.perf_counter()
        timings += (after_pre - start, after_inference - before_inference, after_nms - after_inference)
        if confusion is not None:  # in input pixels: letterboxing scales both axes alike, so IoU is the same
            # The deployment picture: one class per box, whatever the mAP used.
            single = outputs if not options.multi_label else nms(confusion.conf)
            _count_confusion(confusion, single, targets)
        keep_masks = options.collect_predictions and options.collect_masks
        scores = scorer.score_batch(outputs, loss_input, targets, batch, keep_masks)
        _collect(scores, batch, stats, predictions if options.collect_predictions else None)
        seen[0] += len(outputs)
        if options.on_batch is not None:
            predicted = functools.partial(scorer.predicted_batch, batch, outputs, loss_input)
            options.on_batch(batch_index, batch, predicted)
    model.train(was_training)
    if options.interrupt is not None:  # the same options on every rank: all of them take part
        _agree_on_interrupt(stopped, evaluated, batches, device, ctx)
    result = _summarise(stats, loss_sum, seen, timings, predictions, options, ctx, scorer.with_masks)
    if confusion is not None:  # options are the same on every rank, so all take part
        matrix = torch.as_tensor(confusion.matrix, device=device)
        confusion.matrix = all_reduce_sum(matrix, ctx).cpu().numpy()
        result.confusion = confusion
    return result


def _agree_on_interrupt(
    stopped: bool, evaluated: int, batches: Iterable[Any], device: torch.device, ctx: DistContext
) -> None:
    """Raise EvalInterrupted on every rank when any rank left its loop early (`stopped`, after `evaluated` batches).

    A rank whose flag turned true only after its last batch has evaluated its whole share and says no.
    """
    anywhere = all_reduce_sum(torch.tensor([int(stopped)], device=device), ctx)
    if int(anywhere.item()):
        raise EvalInterrupted(evaluated, len(batches) if hasattr(batches, "__len__") else None)


def _select(select: Callable[..., list[torch.Tensor]], decoded: torch.Tensor, conf_thres: float, *, agnostic: bool,
            **options: Any) -> list[torch.Tensor]:  # fmt: skip
    """`select`'s detections (NMS or top scores); `agnostic`: suppressed across classes, every class then 0."""
    outputs = select(decoded, conf_thres, agnostic=agnostic, **options)
    if agnostic:
        for detections in outputs:
            detections[:, 5] = 0
    return outputs


def _collect(
    scores: Iterable[Any], batch: dict[str, Any], stats: _Stats, predictions: list[ImagePredictions] | None
) -> None:
    """Add a batch's per-image scores to `stats` and, when collecting (`predictions` given), its detections."""
    for index, score in enumerate(scores):
        stats.add(score)
        if predictions is not None:
            orig_hw = tuple(int(v) for v in batch["shapes"][index][0])
            predictions.append(ImagePredictions(batch["paths"][index], orig_hw, score.detections, score.masks_rle))


def _count_confusion(confusion: ConfusionMatrix, outputs: list[torch.Tensor], targets: torch.Tensor) -> None:
    """Add one batch to `confusion`: NMS outputs (n, 6+) and targets (N, 6) with boxes in input pixels."""
    for index, pred in enumerate(outputs):
        labels = targets[targets[:, 0] == index, 1:6]
        confusion.update(pred[:, :6], torch.cat((labels[:, :1], xywh_to_xyxy(labels[:, 1:5])), 1))


def _summarise(stats, loss_sum, seen, timings, predictions, options, ctx, with_masks: bool) -> EvalResult:
    """Gather per-rank statistics and compute the metrics every rank returns."""
    gathered = all_gather_objects(stats.concatenated(), ctx)
    correct, conf, pred_cls, target_cls, mask_correct, image_classes = (
        np.concatenate(parts, 0) for parts in zip(*gathered, strict=True)
    )
    metrics = DetectionMetrics.from_stats(correct, conf, pred_cls, target_cls, options.num_classes)
    mask_metrics = (
        DetectionMetrics.from_stats(mask_correct, conf, pred_cls, target_cls, options.num_classes)
        if with_masks
        else None
    )
    all_reduce_sum(loss_sum, ctx)
    all_reduce_sum(seen, ctx)
    # Weighted by images: a rank with few (or none) counts as little as it timed, not as one rank in W.
    seconds = all_reduce_sum(torch.as_tensor(timings, dtype=torch.float64, device=seen.device), ctx)
    per_image = (1000 * seconds / max(int(seen[0].item()), 1)).tolist()
    speed = dict(zip(("preprocess", "inference", "nms"), per_image, strict=True))
    loss_items = (loss_sum / seen[1]).cpu().numpy() if seen[1] > 0 else None
    counts = np.bincount(target_cls.astype(np.int64), minlength=options.num_classes)
    images = np.bincount(image_classes.astype(np.int64), minlength=options.num_classes)
    return EvalResult(
        metrics, int(seen[0].item()), int(len(target_cls)), loss_items, speed, counts, predictions, mask_metrics,
        class_images=images,
    )  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_results(result: EvalResult, names: tuple[str, ...], verbose: bool) -> str:
    """Return the results table: an 'all' row, and one row per class when `verbose`.

    The 'all' row's Images counts every image; a class row's counts the images with at least one
    label of that class (as Ultralytics' table does), so a rare class shows how few images score it.
    Segmentation results get a second group of P, R, mAP50, mAP50-95 columns for the masks.
    """
    groups = [result.metrics] if result.mask_metrics is None else [result.metrics, result.mask_metrics]
    titles = ("P", "R", "mAP50", "mAP50-95")
    suffixes = ("",) if len(groups) == 1 else ("(B)", "(M)")
    width = 11 if len(groups) == 1 else 12  # "mAP50-95(B)" fills 11: a column apart from the one before
    header = f"{'Class':>20}{'Images':>11}{'Instances':>11}" + "".join(
        f"{title + suffix:>{width}}" for suffix in suffixes for title in titles
    )
    row = "{:>20}{:>11}{:>11}" + f"{{:>{width}.3f}}" * 4 * len(groups)
    overall = [value for m in groups for value in (m.precision, m.recall, m.map50, m.map50_95)]
    lines = [header, row.format("all", result.num_images, result.num_instances, *overall)]
    if verbose:
        for i, class_id in enumerate(result.metrics.class_ids):
            name = names[class_id] if class_id < len(names) else str(class_id)
            values = [v for m in groups for v in (m.class_precision[i], m.class_recall[i], m.ap50[i], m.ap[i])]
            images, instances = _class_count(result.class_images, class_id), _class_count(result.class_counts, class_id)
            lines.append(row.format(name, images, instances, *values))
    return "\n".join(lines)


def _class_count(counts: np.ndarray, class_id: int) -> int:
    """counts[class_id], 0 for a class past the array (a result built without per-class counts)."""
    return int(counts[class_id]) if class_id < len(counts) else 0
