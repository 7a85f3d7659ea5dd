"""Validate a saved checkpoint from the command line: load it, build the val data, evaluate, report."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from torch import nn

from models.yolo import ModelSpec
from utils import checkpoint as ckpt_io
from utils.augment import AugmentParams
from utils.boxes import xyxy_to_xywhn
from utils.config import ConfigError, ValConfig
from utils.data_config import load_data_config
from utils.dataset import DatasetOptions, LoadImagesAndLabels
from utils.distributed import DistContext, all_gather_objects
from utils.evaluate import EvalOptions, EvalResult, format_results
from utils.loader import build_val_loader
from utils.tasks import Task

LOGGER = logging.getLogger(__name__)


def load_model_for_eval(path: Path, task: Task, ctx: DistContext, half: bool = False) -> tuple[nn.Module, dict]:
    """Build the model stored in checkpoint `path` with its EMA weights (or raw weights), fused, in eval mode.

    A checkpoint of another task (segment vs detect) is a one-line ConfigError.
    """
    checkpoint = ckpt_io.load_checkpoint(path)
    if checkpoint.get("task", "detect") != task.name:
        raise ConfigError(
            f"{path} is a {checkpoint.get('task')} checkpoint but this is the {task.name} validator; "
            f"use {'segment/val.py' if checkpoint.get('task') == 'segment' else 'val.py'}"
        )
    model = task.build_model(ModelSpec.from_dict(checkpoint["model_spec"]))
    model.load_state_dict(checkpoint.get("ema") or checkpoint["model"])
    model = model.fuse().eval().to(ctx.device)
    if half and ctx.device.type == "cuda":
        model = model.half()
    return model, checkpoint


def validate_checkpoint(cfg: ValConfig, task: Task, ctx: DistContext) -> EvalResult:
    """Evaluate checkpoint `cfg.weights` on split `cfg.task` of `cfg.data`; every rank calls it.

    Images are sharded across ranks without padding and statistics gathered, so a torchrun
    validation scores each image once. Rank 0 logs the table and per-image timings.
    """
    if cfg.batch_size % ctx.world_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by {ctx.world_size} processes")
    if cfg.half and ctx.device.type != "cuda":
        LOGGER.warning("--half needs CUDA; validating in FP32 on CPU")
    model, checkpoint = load_model_for_eval(cfg.weights, task, ctx, cfg.half)
    data = load_data_config(cfg.data, ctx)
    names = ("item",) if cfg.single_cls else data.names
    if len(names) != len(checkpoint["names"]):
        trained = len(checkpoint["names"])
        raise ConfigError(f"{cfg.weights} was trained on {trained} classes but {cfg.data} has {len(names)}")
    split = "val" if cfg.task == "speed" else cfg.task
    per_rank = cfg.batch_size // ctx.world_size
    options = DatasetOptions(
        img_size=cfg.imgsz,
        batch_size=per_rank,
        augment=False,
        aug=AugmentParams(),
        rect=True,
        pad=0.5,
        stride=int(model.stride.max()),
        single_cls=cfg.single_cls,
        with_masks=task.with_masks,
        num_classes=len(data.names),
        workers=cfg.workers,
    )
    dataset = LoadImagesAndLabels(data.split(split), options, ctx)
    loader = build_val_loader(dataset, per_rank, cfg.workers, ctx)
    eval_options = EvalOptions(
        num_classes=len(names),
        conf_thres=cfg.conf_thres,
        iou_thres=cfg.iou_thres,
        max_det=cfg.max_det,
        half=cfg.half,
        collect_predictions=cfg.save_txt,
    )
    result = task.evaluate(model, loader, eval_options, ctx)
    report(result, names, cfg, ctx)
    if cfg.save_txt:
        save_txt(result, Path(cfg.project) / cfg.name / "labels")
    return result


def report(result: EvalResult, names: tuple[str, ...], cfg: ValConfig, ctx: DistContext) -> None:
    """Log the metrics table (per class with --verbose) and the per-image time of each stage on rank 0."""
    speeds = all_gather_objects(result.speed_ms, ctx)
    mean = {key: float(np.mean([s[key] for s in speeds])) for key in speeds[0]}
    if not ctx.is_main:
        return
    LOGGER.info(format_results(result, names, cfg.verbose))
    LOGGER.info(
        f"Speed per image: {mean['preprocess']:.1f} ms pre-process, {mean['inference']:.1f} ms inference, "
        f"{mean['nms']:.1f} ms NMS at batch {cfg.batch_size // ctx.world_size} per rank, size {cfg.imgsz}"
    )
    LOGGER.info("Metric source: internal (101-point interpolated AP over IoU 0.50:0.95)")


def save_txt(result: EvalResult, folder: Path) -> None:
    """Write each image's detections as YOLO-format lines `cls cx cy w h conf` (normalised), one file per image.

    Every rank writes the images it evaluated; shards are disjoint, so no file is written twice.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for item in result.predictions:
        height, width = item.orig_hw
        boxes = xyxy_to_xywhn(item.detections[:, :4].copy(), width, height, clip=True)
        lines = [
            f"{int(det[5])} {b[0]:.6f} {b[1]:.6f} {b[2]:.6f} {b[3]:.6f} {det[4]:.5f}"
            for det, b in zip(item.detections, boxes, strict=True)
        ]
        (folder / f"{Path(item.path).stem}.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
