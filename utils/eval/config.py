"""Validation's options: val.py's flags parsed once into the frozen ValConfig, with their range checks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from utils.config import (
    AUGMENT_HELP,
    DEFAULT_DATA,
    IMGSZ_FROM_CHECKPOINT_HELP,
    ROOT,
    add_common_flags,
    check_dist_timeout,
    stride_multiples,
)
from utils.distributed import DEFAULT_TIMEOUT_MINUTES
from utils.errors import ConfigError


@dataclass(frozen=True)
class ValConfig:
    """Options of val.py, resolved once from the command line."""

    weights: Path
    data: Path | None = None  # None: the dataset the checkpoint was trained on, else the built-in one
    batch_size: int = 32  # global
    imgsz: int | None = None  # None: the size the checkpoint was trained at (utils/checkpoint.py: trained_imgsz)
    conf_thres: float = 0.001
    iou_thres: float = 0.6
    max_det: int = 300
    split: str = "val"  # "val" | "test": the dataset YAML's split to score (--task val|test)
    speed_only: bool = False  # --task speed: time the val split at conf 0.25 / IoU 0.45, no metrics table
    device: str = ""
    workers: int = 4
    single_cls: bool = False
    verbose: bool = False
    half: bool = False
    save_json: bool = False
    save_txt: bool = False
    save_conf: bool = False  # --save-txt lines end with the score
    plots: bool = False
    channels_last: bool = True
    multi_label: bool = True  # see TrainConfig.multi_label
    nms: bool = False  # end-to-end models: the one-to-many head and NMS instead of the one-to-one head
    augment: bool = False  # test-time augmentation: flipped and shrunk passes pooled before NMS (detection)
    dist_timeout: float = DEFAULT_TIMEOUT_MINUTES  # see TrainConfig.dist_timeout
    project: Path = ROOT / "runs" / "val"
    name: str = "exp"
    exist_ok: bool = False


def build_val_parser(task: str = "detect") -> argparse.ArgumentParser:
    """Return the argparse parser of val.py (and segment/val.py)."""
    parser = argparse.ArgumentParser(description=f"Validate a YOLO {task} checkpoint on a dataset")
    add_common_flags(
        parser,
        data_default=None,
        data_help="dataset YAML (default: the one the checkpoint was trained on when it is there, else "
        f"{DEFAULT_DATA.relative_to(ROOT)})",
    )
    parser.add_argument("--weights", type=Path, required=True, help="checkpoint path (best.pt / last.pt)")
    parser.add_argument("--imgsz", "--img", "--img-size", type=int, default=None, help=IMGSZ_FROM_CHECKPOINT_HELP)
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch size, summed over all ranks")
    parser.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    parser.add_argument("--iou-thres", type=float, default=0.6, help="NMS IoU threshold")
    parser.add_argument("--max-det", type=int, default=300, help="maximum detections per image")
    parser.add_argument("--task", default="val", choices=("val", "test", "speed"), help="split to run, or speed")
    parser.add_argument("--verbose", action="store_true", help="print a per-class table")
    parser.add_argument("--half", action="store_true", help="FP16 inference (CUDA only)")
    parser.add_argument("--save-json", action="store_true", help="write COCO-format predictions.json")
    parser.add_argument("--save-txt", action="store_true", help="write YOLO-format predictions per image")
    parser.add_argument("--save-conf", action="store_true", help="end each --save-txt line with its score")
    parser.add_argument(
        "--nms",
        action="store_true",
        help="end-to-end models (yolo26): NMS on the one-to-many head instead of the NMS-free one-to-one head",
    )
    parser.add_argument("--augment", action="store_true", help=AUGMENT_HELP)
    parser.add_argument(
        "--plots", action="store_true", help="write PR/F1/P/R curves and the confusion matrix to the run folder"
    )
    parser.add_argument("--project", type=Path, default=ROOT / "runs" / ("val-seg" if task == "segment" else "val"))
    parser.add_argument("--name", default="exp")
    parser.add_argument("--exist-ok", action="store_true")
    return parser


def val_config_from_args(args: argparse.Namespace) -> ValConfig:
    """Build the frozen ValConfig from parsed flags, checking value ranges (one-line errors).

    `--task` keeps YOLOv5's name and values: `val`/`test` choose the split, `speed` times the val
    split at YOLOv5's speed settings (conf 0.25, NMS IoU 0.45) without JSON or plots.
    """
    for flag, value in (("--conf-thres", args.conf_thres), ("--iou-thres", args.iou_thres)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{flag} {value} must be within [0, 1]")
    for flag, value in (("--batch-size", args.batch_size), ("--max-det", args.max_det)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers} must be >= 0")
    check_dist_timeout(args.dist_timeout)
    names = {f.name for f in fields(ValConfig)}
    values = {key: value for key, value in vars(args).items() if key in names}
    if args.imgsz is not None:
        values["imgsz"] = stride_multiples((args.imgsz,))[0]
    if args.task == "speed":
        values.update(split="val", speed_only=True, conf_thres=0.25, iou_thres=0.45, save_json=False, plots=False)
    else:
        values["split"] = args.task
    return ValConfig(**values)
