"""Defaults and flags every entry point shares; each job's own options live beside it.

Training's options are utils/train/config.py (TrainConfig), validation's utils/eval/config.py
(ValConfig), prediction's utils/predict/config.py and export's utils/export/__init__.py.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from utils.distributed import DEFAULT_TIMEOUT_MINUTES, read_launch_env
from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
MAX_STRIDE = 32  # the largest stride of the P5 models, the most --imgsz is rounded to before the model is known
DEFAULT_DATA = ROOT / "data" / "synthetic.yaml"
# `--optimizer auto` / `--hyp auto` (the defaults) choose one of two recipe files from the run's size
# (utils/train/recipe.py): YOLOv5's SGD recipe for runs with many optimizer steps, and for the others
# AdamW stepping once per batch of 16 (on 400 images x 60 epochs the SGD recipe reached a quarter of
# AdamW's mAP50-95, docs/training.md). `python train.py` with no flags is the quick start: a short from-scratch
# run on the built-in dataset that finishes in under 15 minutes on 2 CPU cores.
AUTO = "auto"
# The quick start's models, chosen by benchmarks/recipes.py --cfg (docs/models.md: Choosing a model): on the built-in
# set and a generated one yolov8n reached about three times yolov5n's mAP50-95 in the same 20 epochs, and
# yolov8n-seg 1.5 and 2.3 times yolov5n-seg's mask mAP50-95.
DEFAULT_MODEL = "yolov8n"
DEFAULT_SEGMENT_MODEL = "yolov8n-seg"
DEFAULT_HYP = ROOT / "data" / "hyps" / "hyp.scratch-low.yaml"  # YOLOv5's default; auto's long-run recipe
QUICKSTART_HYP = ROOT / "data" / "hyps" / "hyp.quickstart.yaml"  # auto's short-run recipe (AdamW)
QUICKSTART_IMGSZ = 224
# --imgsz of every entry point that reads a checkpoint (val, detect, export): the size it was trained at.
IMGSZ_FROM_CHECKPOINT_HELP = (
    "image size in pixels (default: the size the checkpoint was trained at, 640 for converted YOLOv5 / "
    "Ultralytics weights)"
)
# --augment of val.py and detect.py (utils/backends/augmented.py).
AUGMENT_HELP = (
    "test-time augmentation (detection): also run the image flipped at 0.83x and at 0.67x, pool the boxes "
    "before NMS; three forwards per image"
)
QUICKSTART_EPOCHS = 20
QUICKSTART_BATCH = 16
AUTOBATCH = -1  # --batch-size -1: measure the largest batch that fits (utils/train/autobatch.py)
QUICKSTART_CLOSE_MOSAIC = 0  # last epochs trained on plain letterboxed images (0: mosaic throughout, YOLOv5)


def shipped_file(value: str | Path) -> Path:
    """A --data / --hyp value as a path; a bare file name that is not in the working directory names the file of
    that name this project ships under data/ (`--hyp hyp.scratch-low.yaml`, `--data synthetic.yaml`), as YOLOv5
    looks bare names up in its own folders. Anything else, or a name shipped twice or not at all, stays as given
    (a missing file is then the caller's one-line error)."""
    path = Path(value).expanduser()
    if path.exists() or len(path.parts) != 1:
        return path
    found = sorted((ROOT / "data").rglob(path.name))
    return found[0] if len(found) == 1 and found[0].is_file() else path


def add_common_flags(
    parser: argparse.ArgumentParser, data_default: Path | None = DEFAULT_DATA, data_help: str = "dataset YAML"
) -> None:
    """Flags shared by training and validation entry points (--imgsz differs: see each parser)."""
    parser.add_argument("--data", type=shipped_file, default=data_default, help=data_help)
    parser.add_argument("--device", default="", help="cuda device, e.g. 0 or 0,1, or cpu (default: GPU if present)")
    parser.add_argument("--workers", type=int, default=4, help="max dataloader workers per rank")
    parser.add_argument(
        "--single-cls",
        action="store_true",
        help="treat every class as one: train a one-class model, or score any model class-agnostic",
    )
    parser.add_argument(
        "--multi-label",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mAP validation keeps a box once per class above --conf-thres, as YOLOv5/Ultralytics validate "
        "(default); --no-multi-label keeps only each box's best class",
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep conv weights and activations in NHWC (channels_last) layout, faster on CPU (oneDNN) and on "
        "CUDA tensor cores; --no-channels-last for NCHW",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_MINUTES,
        metavar="MINUTES",
        help="how long a rank may wait for the others in a collective before the job fails (process-group timeout)",
    )


def check_dist_timeout(minutes: float) -> None:
    """Refuse a --dist-timeout that is not a positive, finite number of minutes (one-line ConfigError)."""
    if not (math.isfinite(minutes) and minutes > 0):
        raise ConfigError(f"--dist-timeout {minutes:g} must be a positive number of minutes (default 30)")


def flag_words(option: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    """The command-line words that give flag `option` (of parser `action`) the Python `value`; [] for None.

    The keyword APIs (utils/cli/entry.py) and tune.py's trial commands both turn values back into
    flags with it; a switch given a non-bool is a one-line ConfigError naming `where`.
    """
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be True or False")
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be True or False")
        return [option] if value else []
    if action.nargs in ("+", "*") or isinstance(value, list | tuple):
        values = list(value) if isinstance(value, list | tuple) else [value]
        return [option, *map(str, values)] if values else []
    if action.nargs == "?" and isinstance(value, bool):  # --cache / --resume alone
        return [option] if value else []
    text = str(value)
    # A value that starts with a dash (--name -x) would be read as a flag; joined with "=" it is a value.
    return [f"{option}={text}"] if text.startswith("-") else [option, text]


def stride_multiples(sides: Sequence[int], flag: str = "--imgsz", stride: int = MAX_STRIDE) -> tuple[int, ...]:
    """`sides` rounded up to multiples of `stride` (at least one stride), as YOLOv5 rounds --img-size.

    Options are rounded to MAX_STRIDE when parsed (the warning says a P6 model needs 64); once the
    model is known its largest stride (64 for the YOLOv5 P6 models) rounds them again
    (utils/train/engine.py, utils/backends/base.py).
    A side that changes is one warning, printed by the job's first process only (rank 0 as torchrun
    or SLURM number it, utils/distributed.py: read_launch_env): every rank builds its options before
    logging is set up. A side below 1 is a one-line ConfigError.
    """
    if any(side < 1 for side in sides):
        raise ConfigError(f"{flag} {' '.join(map(str, sides))}: sides are positive numbers of pixels")
    rounded = tuple(max(stride, math.ceil(side / stride) * stride) for side in sides)
    if rounded != tuple(sides) and read_launch_env()[0] == 0:
        why = "64 for the P6 models" if stride == MAX_STRIDE else "the model's largest stride"
        LOGGER.warning(
            f"{flag} {' '.join(map(str, sides))}: sides must be multiples of {stride} ({why}); "
            f"using {' '.join(map(str, rounded))}"
        )
    return rounded
