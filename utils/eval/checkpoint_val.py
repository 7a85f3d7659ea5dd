"""Validate a saved checkpoint from the command line: load it, build the val data, evaluate, report."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from utils.backends import (
    BackendInfo,
    BackendRequest,
    InferenceBackend,
    leave_cores_to_runtime,
    load_backend,
    resolve_imgsz,
)
from utils.boxes import xyxy_to_xywhn
from utils.config import DEFAULT_DATA
from utils.data.data_config import DataConfig, load_data_config
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.loader import build_val_loader
from utils.distributed import DistContext, per_rank_batch
from utils.errors import ConfigError
from utils.eval.coco import CocoTarget, check_coco_target, coco_evaluate, output_stems
from utils.eval.config import ValConfig
from utils.eval.evaluate import EvalOptions, EvalResult, format_results
from utils.plots import plot_evaluation, val_batch_drawer
from utils.runs import create_run_dir

if TYPE_CHECKING:  # the task is handed in by the entry point; evaluation sits below the task records
    from utils.tasks import Task

LOGGER = logging.getLogger(__name__)


@dataclass
class ValSetup:
    """What a validation run needs, built once: model, this rank's loader, data, and where outputs go."""

    model: InferenceBackend  # the checkpoint or exported file (utils/backends)
    loader: Any
    data: DataConfig
    names: tuple[str, ...]
    save_dir: Path | None  # None when nothing is written (no --save-json / --save-txt)
    coco_target: CocoTarget | None  # rank 0 only, when --save-json and the YAML names annotations
    imgsz: int  # --imgsz, else the size the checkpoint was trained at or the file exported at

    @property
    def size_text(self) -> str:
        """The size images ran at, as the report names it: `640`, or `384x640` for a non-square fixed-size file."""
        height, width = self.model.info.imgsz
        return f"{height}x{width}" if self.model.info.fixed_shape and height != width else str(self.imgsz)


def validate_checkpoint(cfg: ValConfig, task: Task, ctx: DistContext) -> EvalResult:
    """Evaluate checkpoint `cfg.weights` on split `cfg.split` of `cfg.data`; every rank calls it.

    Images are sharded across ranks without padding and statistics gathered, so a torchrun
    validation scores each image once. With --save-json, predictions.json goes to the run folder
    (--project/--name, e.g. runs/val/exp, exp2, ...) and, when the YAML names the split's
    annotations, mAP50 and mAP50-95 come from pycocotools COCOeval; --save-txt writes labels/ there
    and --plots the PR / F1 / P / R curves, the confusion matrix and val_batch{0,1}_labels/pred.jpg
    (rank 0). Rank 0 logs the table and per-image timings.
    """
    if cfg.speed_only:
        LOGGER.info("--task speed: timing the val split at --conf-thres 0.25 --iou-thres 0.45, no JSON")
    setup = prepare_validation(cfg, task, ctx)
    cfg = dataclasses.replace(cfg, imgsz=setup.imgsz)  # the report names the size that ran
    eval_options = EvalOptions(
        num_classes=len(setup.names),
        conf_thres=cfg.conf_thres,
        iou_thres=cfg.iou_thres,
        max_det=cfg.max_det,
        multi_label=cfg.multi_label,
        class_agnostic=cfg.single_cls and len(setup.model.info.names) > 1,
        collect_predictions=cfg.save_json or cfg.save_txt,
        collect_masks=cfg.save_json,  # --save-txt writes boxes only
        confusion=cfg.plots,
        on_batch=val_batch_drawer(setup.save_dir, setup.names) if cfg.plots and ctx.is_main else None,
    )
    result = task.evaluate(setup.model, setup.loader, eval_options, ctx)
    annotations = setup.data.annotations.get(cfg.split)
    # Outputs named by image stem (labels/, predictions.json's ids without annotations) share one mapping.
    named_by_stem = cfg.save_txt or (cfg.save_json and annotations is None)
    stems = output_stems(setup.loader.dataset.im_files, ctx, "outputs") if named_by_stem else {}
    if cfg.save_json:
        assert setup.save_dir is not None  # prepare_validation makes one whenever something is saved
        result = coco_evaluate(
            result, setup.data, cfg.split, setup.save_dir, ctx,
            single_cls=cfg.single_cls, target=setup.coco_target, stems=stems,
        )  # fmt: skip
    report(result, setup.names, cfg, ctx, annotations, agnostic=eval_options.class_agnostic, size=setup.size_text)
    if cfg.save_txt and setup.save_dir is not None:
        save_txt(result, setup.save_dir / "labels", stems, cfg.save_conf)
    if cfg.plots and setup.save_dir is not None and ctx.is_main:
        plot_evaluation(result, setup.names, setup.save_dir)
    if setup.save_dir is not None and ctx.is_main:
        LOGGER.info(f"Results saved to {setup.save_dir}")
    return result


def default_data(given: Path | None, info: BackendInfo, ctx: DistContext) -> Path:
    """--data, else the dataset YAML the checkpoint was trained on, else (a file that records none) the built-in one.

    Rank 0 says which it took: a run folder's best.pt is scored on its own data with no flag, and
    a file that records none (an export, YOLOv5's weights) falls back to the built-in set visibly.
    A recorded YAML that is not there any more is a one-line ConfigError asking for --data, not a
    silent switch to another dataset.
    """
    if given is not None:
        return given
    recorded = info.trained_data
    if recorded is not None and not recorded.is_file():
        raise ConfigError(f"{info.path} was trained on {recorded}, which is not there; give --data")
    chosen = recorded or DEFAULT_DATA
    if ctx.is_main:
        why = "the dataset it was trained on" if recorded is not None else "the built-in dataset"
        LOGGER.info(f"No --data: scoring {info.path} on {chosen}, {why}")
    return chosen


def check_class_count(cfg: ValConfig, trained: int, in_yaml: int) -> None:
    """Refuse a model whose classes the dataset's do not match, in one line saying what would fit.

    With --single-cls any model fits: a multi-class one is scored class-agnostic (`class_agnostic`).
    A one-class model (trained with --single-cls) on a multi-class dataset needs --single-cls here too.
    """
    if cfg.single_cls or trained == in_yaml:
        return
    hint = "; add --single-cls to score every class as one" if trained == 1 else ""
    raise ConfigError(f"{cfg.weights} was trained on {_classes(trained)} but {cfg.data} has {_classes(in_yaml)}{hint}")


def warn_on_other_names(cfg: ValConfig, trained: tuple[str, ...], in_yaml: tuple[str, ...]) -> None:
    """Warn on rank 0 when the model's class names are not the dataset's, naming the first that differs.

    The per-class table would print the YAML's names over the scores of the model's classes: a --data
    of another dataset with as many classes. A model that records no names is not checked.
    """
    differing = [index for index, (ours, theirs) in enumerate(zip(trained, in_yaml, strict=False)) if ours != theirs]
    if trained and differing:
        first = differing[0]
        LOGGER.warning(
            f"{cfg.weights} was trained on other class names than {cfg.data} lists ({len(differing)} of "
            f"{len(in_yaml)} differ, first class {first}: {trained[first]!r} vs {in_yaml[first]!r}); is --data "
            "the dataset it was trained on?"
        )


def _classes(count: int) -> str:
    return f"{count} class" if count == 1 else f"{count} classes"


def prepare_validation(cfg: ValConfig, task: Task, ctx: DistContext) -> ValSetup:
    """Check the options, load the data config, the annotations (with --save-json) and the model; build the loader.

    Every rank calls it. Problems that can be found before inference (batch divisibility, class
    count, a missing or malformed annotations file) are one-line ConfigErrors raised on every rank.
    """
    per_rank = per_rank_batch(cfg.batch_size, ctx)
    # First: cheap, and a wrong file fails fast.
    request = BackendRequest.from_flags(cfg, task.name, "val", ctx.device)
    model = load_backend(cfg.weights, request)
    imgsz = val_imgsz(model.info, cfg.imgsz)
    cfg = dataclasses.replace(cfg, data=default_data(cfg.data, model.info, ctx))
    data = load_data_config(cfg.data, ctx)
    coco_target = check_coco_target(data, cfg.split, ctx, cfg.single_cls) if cfg.save_json else None
    names = ("item",) if cfg.single_cls else data.names
    check_class_count(cfg, len(model.info.names), len(data.names))
    if ctx.is_main and not cfg.single_cls:
        warn_on_other_names(cfg, model.info.names, data.names)
    wants_dir = cfg.save_json or cfg.save_txt or cfg.plots
    save_dir = create_run_dir(cfg.project, cfg.name, cfg.exist_ok, ctx) if wants_dir else None
    options = DatasetOptions.for_evaluation(
        img_size=imgsz,
        batch_size=per_rank * ctx.world_size,  # the global batch: the same letterbox on any number of ranks
        stride=model.info.stride,
        single_cls=cfg.single_cls,
        with_masks=task.with_masks,
        num_classes=len(data.names),
        names_file=data.yaml_file,
        workers=cfg.workers,
    )
    if model.info.fixed_shape:  # every image letterboxed to the file's one size, not to its batch's rectangle
        height, width = model.info.imgsz
        options = dataclasses.replace(options, rect=False, pad=0.0, canvas_hw=(height, width))
        LOGGER.info(f"{cfg.weights} runs only {height}x{width}: every image letterboxed to it instead of rectangles")
    dataset = LoadImagesAndLabels(data.split(cfg.split), options, ctx, data.coco_source(cfg.split))
    loader = build_val_loader(dataset, per_rank, cfg.workers, ctx)
    leave_cores_to_runtime(model)
    return ValSetup(model, loader, data, names, save_dir, coco_target, imgsz)


def val_imgsz(info: BackendInfo, requested: int | None) -> int:
    """The side val resizes images to: --imgsz, else the trained or exported size (its long side if not square).

    A fixed-shape export runs only its own size (a non-square one is letterboxed to it whole:
    DatasetOptions.canvas_hw); another --imgsz is a one-line ConfigError naming the file.
    """
    if requested is None or (info.fixed_shape and requested == max(info.imgsz)):
        return max(info.imgsz)
    return resolve_imgsz(info, (requested, requested))[0]


def report(
    result: EvalResult,
    names: tuple[str, ...],
    cfg: ValConfig,
    ctx: DistContext,
    annotations: Path | None = None,
    *,
    agnostic: bool = False,
    size: str = "",
) -> None:
    """Log the metrics table (per class with --verbose), per-image stage times and the metric source on rank 0.

    `annotations` is the split's COCO file from the dataset YAML, if any; `agnostic`: the NMS ignored
    classes (a multi-class model scored --single-cls); `size`: the size images ran at (ValSetup.size_text, else
    --imgsz). `--task speed` logs the times only.
    """
    mean = result.speed_ms  # per image over every rank's images
    if not ctx.is_main:
        return
    if not cfg.speed_only:
        LOGGER.info(format_results(result, names, cfg.verbose))
    LOGGER.info(
        f"Speed per image: {mean['preprocess']:.1f} ms pre-process, {mean['inference']:.1f} ms inference, "
        f"{mean['nms']:.1f} ms NMS at batch {per_rank_batch(cfg.batch_size, ctx)} per rank, size {size or cfg.imgsz}"
    )
    if not cfg.speed_only:
        if agnostic:  # one box per object whatever its class: multi-label would only repeat it
            labels = "class-agnostic single-label (--single-cls)"
        else:
            labels = "multi-label" if cfg.multi_label else "single-label (--no-multi-label)"
        source = metric_source_text(result, cfg.save_json, annotations)
        LOGGER.info(f"Metric source: {source}; {labels} NMS at --conf-thres {cfg.conf_thres}")


def metric_source_text(result: EvalResult, save_json: bool, annotations: Path | None) -> str:
    """Say which metric produced mAP50 / mAP50-95: pycocotools on which file, or the internal one and why."""
    internal = "internal (101-point interpolated AP over IoU 0.50:0.95)"
    if result.metric_source == "pycocotools":
        if result.mask_metrics is not None and result.mask_metric_source != "pycocotools":
            return f"pycocotools COCOeval on {annotations} for boxes; masks: {internal}, see the warning above"
        return f"pycocotools COCOeval on {annotations}"
    if annotations is not None and not save_json:
        return f"{internal}; add --save-json for pycocotools COCOeval on {annotations}"
    if save_json and annotations is None:
        return f"{internal}; the dataset YAML names no COCO annotations file for this split"
    return internal


def save_txt(result: EvalResult, folder: Path, stems: Mapping[str, str], save_conf: bool = False) -> None:
    """Write each image's detections as YOLO-format lines `cls cx cy w h` (normalised), one file per image.

    With `save_conf` each line ends with the score (YOLOv5's --save-conf); without it the files are
    label files a dataset can use as they are. Files are named by `stems` (output_stems; an image
    not in it by its own stem). Every rank writes the images it evaluated; shards are disjoint, so
    no file is written twice.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for item in result.predictions:
        height, width = item.orig_hw
        boxes = xyxy_to_xywhn(item.detections[:, :4].copy(), width, height, clip=True)
        lines = [
            f"{int(det[5])} {b[0]:.6f} {b[1]:.6f} {b[2]:.6f} {b[3]:.6f}" + (f" {det[4]:.5f}" if save_conf else "")
            for det, b in zip(item.detections, boxes, strict=True)
        ]
        stem = stems.get(item.path, Path(item.path).stem)
        (folder / f"{stem}.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
