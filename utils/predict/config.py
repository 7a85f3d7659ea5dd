"""Flags of detect.py and segment/predict.py, parsed once into a frozen PredictConfig (YOLOv5's names and defaults)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from utils.config import AUGMENT_HELP, IMGSZ_FROM_CHECKPOINT_HELP, ROOT, stride_multiples
from utils.errors import ConfigError


@dataclass(frozen=True)
class DrawStyle:
    """How boxes and labels are drawn on the saved images and videos."""

    line_thickness: int = 3  # pixels
    hide_labels: bool = False  # no class name (and no score) above the box
    hide_conf: bool = False  # class name without the score


@dataclass(frozen=True)
class SaveOptions:
    """What is written to the run folder besides the log."""

    save_images: bool = True  # annotated images and videos (off with --nosave)
    save_txt: bool = False  # labels/<stem>.txt in YOLO format
    save_conf: bool = False  # with save_txt: the score as the last column
    save_crop: bool = False  # crops/<class name>/<stem>_<k>.jpg


@dataclass(frozen=True)
class PredictConfig:
    """Options of detect.py / segment/predict.py, resolved once from the command line."""

    weights: Path
    source: str  # file, folder, glob, video, .txt list, or a webcam index ("0")
    # (height, width) the long side is fitted into, stride multiples; None: the checkpoint's training size
    imgsz: tuple[int, int] | None = None
    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 1000
    classes: tuple[int, ...] | None = None  # keep only these class ids
    agnostic_nms: bool = False
    nms: bool = False  # end-to-end models: the one-to-many head and NMS instead of the one-to-one head
    augment: bool = False  # test-time augmentation: flipped and shrunk passes pooled before NMS (detection)
    device: str = ""
    half: bool = False  # FP16 on CUDA; ignored with a warning on CPU
    channels_last: bool = True
    vid_stride: int = 1  # every vid_stride-th video frame is predicted and written
    style: DrawStyle = field(default_factory=DrawStyle)
    save: SaveOptions = field(default_factory=SaveOptions)
    project: Path = ROOT / "runs" / "detect"
    name: str = "exp"
    exist_ok: bool = False


def build_predict_parser(task: str = "detect") -> argparse.ArgumentParser:
    """Return the argparse parser of detect.py (and segment/predict.py, whose defaults name its own folders)."""
    is_segment = task == "segment"
    parser = argparse.ArgumentParser(description=f"Run a YOLO {task} checkpoint on images, videos or a webcam")
    train_dir = "train-seg" if is_segment else "train"
    add = parser.add_argument
    add("--weights", type=Path, default=ROOT / "runs" / train_dir / "exp" / "weights" / "best.pt", help="checkpoint")
    add("--source", required=True, help="file, folder, glob ('dir/*.jpg'), video, .txt list of paths, or webcam index")
    add(
        "--imgsz",
        "--img",
        "--img-size",
        type=int,
        nargs="+",
        help=f"inference size h [w]: {IMGSZ_FROM_CHECKPOINT_HELP}",
    )
    add("--conf-thres", type=float, default=0.25, help="confidence threshold")
    add("--iou-thres", type=float, default=0.45, help="NMS IoU threshold")
    add("--max-det", type=int, default=1000, help="maximum detections per image")
    add("--device", default="", help="cuda device, e.g. 0, or cpu (default: GPU if present)")
    add("--classes", type=int, nargs="+", help="keep only these classes: --classes 0, or --classes 0 2 3")
    add("--agnostic-nms", action="store_true", help="class-agnostic NMS")
    add(
        "--nms",
        action="store_true",
        help="end-to-end models (yolo26): NMS on the one-to-many head instead of the NMS-free one-to-one head",
    )
    add("--augment", action="store_true", help=AUGMENT_HELP)
    add("--half", action="store_true", help="FP16 inference (CUDA only)")
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True, help="NHWC layout (faster on CPU)")
    add("--vid-stride", type=int, default=1, help="video frame-rate stride")
    add("--save-txt", action="store_true", help="save results to labels/*.txt")
    add("--save-conf", action="store_true", help="add the confidence to --save-txt lines")
    add("--save-crop", action="store_true", help="save cropped boxes to crops/<class>/")
    add("--nosave", action="store_true", help="do not save annotated images/videos")
    add("--line-thickness", type=int, default=3, help="bounding box thickness (pixels)")
    add("--hide-labels", action="store_true", help="hide class names and scores")
    add("--hide-conf", action="store_true", help="hide scores")
    add("--view-img", action="store_true", help=argparse.SUPPRESS)  # refused with one line: no GUI here
    add("--project", type=Path, default=ROOT / "runs" / ("predict-seg" if is_segment else "detect"))
    add("--name", default="exp", help="run folder name under --project")
    add("--exist-ok", action="store_true", help="reuse an existing run folder instead of numbering a new one")
    return parser


def predict_config_from_args(args: argparse.Namespace) -> PredictConfig:
    """Build the frozen PredictConfig from parsed flags, checking each value (one-line ConfigErrors)."""
    if args.view_img:
        raise ConfigError(
            "--view-img is not supported: OpenCV here is headless; open the saved files in the run folder"
        )
    for flag, value in (("--conf-thres", args.conf_thres), ("--iou-thres", args.iou_thres)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{flag} {value} must be within [0, 1]")
    if args.imgsz is not None and len(args.imgsz) > 2:
        raise ConfigError(f"--imgsz {' '.join(map(str, args.imgsz))}: give one side or two (height width)")
    imgsz = stride_multiples(args.imgsz) if args.imgsz is not None else None
    minimums = {"--max-det": args.max_det, "--vid-stride": args.vid_stride, "--line-thickness": args.line_thickness}
    for flag, value in minimums.items():
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if args.classes is not None and min(args.classes) < 0:
        raise ConfigError(f"--classes {' '.join(map(str, args.classes))}: class ids are 0 or more")
    return PredictConfig(
        weights=args.weights,
        source=str(args.source),
        imgsz=(imgsz[0], imgsz[-1]) if imgsz is not None else None,
        conf_thres=args.conf_thres,
        iou_thres=args.iou_thres,
        max_det=args.max_det,
        classes=tuple(args.classes) if args.classes is not None else None,
        agnostic_nms=args.agnostic_nms,
        nms=args.nms,
        augment=args.augment,
        device=args.device,
        half=args.half,
        channels_last=args.channels_last,
        vid_stride=args.vid_stride,
        style=DrawStyle(args.line_thickness, args.hide_labels, args.hide_conf),
        save=SaveOptions(not args.nosave, args.save_txt, args.save_conf, args.save_crop),
        project=args.project,
        name=args.name,
        exist_ok=args.exist_ok,
    )
