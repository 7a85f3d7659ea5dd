"""Training's options: train.py's flags parsed once into the frozen TrainConfig, their checks, opt.yaml/hyp.yaml."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from utils.checkpoint import checkpoint_path_problem
from utils.config import (
    AUTO,
    AUTOBATCH,
    DEFAULT_DATA,
    DEFAULT_MODEL,
    DEFAULT_SEGMENT_MODEL,
    QUICKSTART_BATCH,
    QUICKSTART_CLOSE_MOSAIC,
    QUICKSTART_EPOCHS,
    QUICKSTART_IMGSZ,
    ROOT,
    add_common_flags,
    check_dist_timeout,
    shipped_file,
    stride_multiples,
)
from utils.data.cache import CACHE_MODES
from utils.distributed import DEFAULT_TIMEOUT_MINUTES, DistContext, per_rank_batch
from utils.errors import ConfigError
from utils.hyp import Hyp, hyp_overrides, load_hyp
from utils.train.optim import OPTIMIZERS

AMP_MODES = ("auto", "fp16", "bf16", "off")


@dataclass(frozen=True)
class TrainConfig:
    """Every training option, resolved once from the command line. Nothing mutates it.

    `optimizer` "auto" and `hyp` None (--hyp auto) stand for choices that need the train set's size;
    fit() replaces them with concrete ones (utils/train/recipe.py: resolve_recipe) before anything is
    built or written, so opt.yaml, hyp.yaml and checkpoints always hold what ran.
    """

    hyp: Hyp | None = None  # None: --hyp auto, not yet chosen
    data: Path = DEFAULT_DATA
    model: str = DEFAULT_MODEL  # --cfg: a model name (yolov5n..x, yolov8n..x, yolo11n..x, yolo26n..x, -seg) or a YAML
    weights: str = ""
    hyp_path: Path | None = None  # the hyp file; None: --hyp auto, or a Hyp given directly
    label_smoothing: float | None = None  # --label-smoothing, applied to the hyp file (None: the file's value)
    epochs: int = QUICKSTART_EPOCHS
    batch_size: int = QUICKSTART_BATCH  # global: summed over all ranks
    imgsz: int = QUICKSTART_IMGSZ
    device: str = ""
    workers: int = 4
    cache: str = "auto"  # "auto" (RAM when small) | "none" | "ram" | "shm" | "disk"
    optimizer: str = AUTO  # "auto" | "SGD" | "Adam" | "AdamW"
    cos_lr: bool = False
    patience: int = 100
    freeze: tuple[int, ...] = ()
    seed: int = 0
    deterministic: bool = False
    resume: str = ""  # "" = no resume; "last" = newest last.pt under project; else a path
    project: Path = ROOT / "runs" / "train"
    name: str = "exp"
    exist_ok: bool = False
    noval: bool = False
    nosave: bool = False
    noplots: bool = False
    save_period: int = -1
    amp: str = "auto"  # autocast: auto (fp16 on CUDA, off on CPU) | fp16 | bf16 | off
    save_period_steps: int = 0  # also write last.pt every N optimizer steps inside an epoch (0: epoch ends only)
    rect: bool = False
    multi_scale: bool = False  # --multi-scale: each batch at 0.5-1.5x imgsz (utils/train/multi_scale.py)
    noautoanchor: bool = False  # --noautoanchor: a YOLOv5 model from scratch keeps its --cfg anchors
    close_mosaic: int = QUICKSTART_CLOSE_MOSAIC
    single_cls: bool = False
    sync_bn: bool = False
    compile_mode: str = ""  # --compile: torch.compile mode of the training forward ("" = eager)
    static_loss_shapes: bool = False  # --static-loss-shapes: target assignment in fixed shapes (no host reads)
    cuda_graph: bool = False  # --cuda-graph: replay the training forward and backward from CUDA graphs
    task: str = "detect"
    overlap_mask: bool = False  # segmentation: one index mask per image instead of one mask per instance
    mask_ratio: int = 4  # segmentation: masks at image size / mask_ratio (the prototype resolution)
    channels_last: bool = True  # NHWC weights and activations (models.model_info.memory_format)
    multi_label: bool = True  # validation NMS: a box once per class above conf (YOLOv5's mAP), else best class only
    dist_timeout: float = DEFAULT_TIMEOUT_MINUTES  # minutes a collective may wait before the job fails
    callbacks: tuple[str, ...] = ()  # modules (or .py files) whose event-named functions follow the run
    mlflow: bool = False  # log to MLflow (also when MLFLOW_TRACKING_URI is set)
    wandb: bool = False  # log to Weights & Biases (also when WANDB_PROJECT is set)
    # Fields the user set on the command line (not defaults): what --resume may take from it. Not stored.
    explicit: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        """Return the options as plain YAML/checkpoint-safe data (paths as strings, hyp nested)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "explicit":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Hyp):
                value = value.to_dict()
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


# torch.compile's modes (its `mode` argument), what --compile MODE takes; the bare flag means "default".
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Option names a checkpoint may store -> the TrainConfig field they fill (`cfg` is `model`), so --resume reads them.
RENAMED_OPTIONS = {"cfg": "model"}


def config_from_dict(options: dict[str, Any]) -> TrainConfig:
    """Rebuild a TrainConfig from `TrainConfig.to_dict()` output (a checkpoint's stored options)."""
    known = {f.name: f for f in fields(TrainConfig)}
    values: dict[str, Any] = {}
    for key, value in options.items():
        key = RENAMED_OPTIONS.get(key, key)
        if key not in known:
            continue  # options of another version: ignore rather than refuse to resume
        if key == "hyp" and value is not None:
            value = Hyp(**value)
        elif key in ("data", "hyp_path", "project") and value is not None:
            value = Path(value)
        elif key in ("freeze", "callbacks"):
            value = tuple(value)
        values[key] = value
    return TrainConfig(**values)


def build_train_parser(task: str = "detect") -> argparse.ArgumentParser:
    """Return the argparse parser of train.py (and segment/train.py), YOLOv5-compatible flags."""
    parser = argparse.ArgumentParser(
        description=f"Train a YOLO {task} model (launch with torchrun for several GPUs). With no flags: the CPU "
        "quick start on the built-in dataset (its time and mAP: docs/models.md); add --data for your own. The "
        "optimizer and hyp file are chosen from the run's size unless given (docs/training.md: Choosing a recipe)."
    )
    add_common_flags(parser)
    parser.add_argument(
        "--imgsz",
        "--img",
        "--img-size",
        type=int,
        default=QUICKSTART_IMGSZ,
        help=f"training image size in pixels (default {QUICKSTART_IMGSZ}, the quick start's; YOLOv5: 640)",
    )
    _add_model_flags(parser, task)
    _add_training_flags(parser)
    _add_speed_flags(parser)
    _add_run_flags(parser, task)
    if task == "segment":
        parser.add_argument(
            "--overlap-mask", action="store_true", help="one index mask per image, not one per instance (less RAM)"
        )
        parser.add_argument("--mask-ratio", type=int, default=4, help="mask downsample ratio (4 = prototype size)")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, task: str) -> None:
    """What is trained: --cfg, --weights, --hyp."""
    default_cfg = DEFAULT_SEGMENT_MODEL if task == "segment" else DEFAULT_MODEL
    parser.add_argument(
        "--cfg",
        dest="model",
        default=default_cfg,
        help="model name (yolov5n..x, yolov8n..x, yolo11n..x, yolo26n..x; -seg) or a model YAML path",
    )
    parser.add_argument("--weights", default="", help="checkpoint to fine-tune from ('' = train from scratch)")
    parser.add_argument(
        "--hyp",
        default=AUTO,
        help="hyperparameter YAML, or auto (default): the recipe file of the optimizer for the model's family, "
        "data/hyps/hyp.scratch-low.yaml (YOLOv5's) or hyp.anchor-free.scratch.yaml for SGD, "
        "data/hyps/hyp.quickstart.yaml or hyp.anchor-free.quickstart.yaml for Adam/AdamW",
    )


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    """How it is trained: schedule, batch, cache, optimizer, seeds, mid-epoch saves, augmentation switches."""
    parser.add_argument("--epochs", type=int, default=QUICKSTART_EPOCHS)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=QUICKSTART_BATCH,
        help="GLOBAL batch, summed over all ranks; -1: AutoBatch (the largest that fits every rank's GPU)",
    )
    parser.add_argument(
        "--cache",
        nargs="?",
        const="ram",
        default="auto",
        help="cache resized train images: auto (RAM when they need <= 10%% of free memory) | ram (each rank its "
        "shard) | shm (one copy per node in /dev/shm, every rank samples the whole dataset) | disk | none",
    )
    parser.add_argument(
        "--optimizer",
        default=AUTO,
        help="auto (default: SGD for runs with many optimizer steps, else AdamW; with --hyp, the optimizer of its "
        "lr0) | SGD | Adam | AdamW (YOLOv5: SGD)",
    )
    parser.add_argument("--cos-lr", action="store_true", help="cosine LR schedule (default linear)")
    parser.add_argument("--label-smoothing", type=float, default=None, help="label smoothing epsilon (overrides hyp)")
    parser.add_argument("--patience", type=int, default=100, help="early stop after this many epochs without gain")
    parser.add_argument("--freeze", nargs="+", type=int, default=[], help="freeze first N layers (one value) or a list")
    parser.add_argument("--seed", type=int, default=0, help="global seed; each rank augments with seed + rank")
    parser.add_argument("--deterministic", action="store_true", help="use deterministic algorithms (slower)")
    parser.add_argument(
        "--save-period-steps",
        type=int,
        default=0,
        help="also write last.pt every N optimizer steps within an epoch, to resume mid-epoch (0: off)",
    )
    parser.add_argument("--rect", action="store_true", help="rectangular training batches (disables mosaic)")
    parser.add_argument(
        "--multi-scale",
        action="store_true",
        help="train each batch at a size drawn from 0.5-1.5x --imgsz (a multiple of the model's stride; the same on "
        "every rank), as YOLOv5's --multi-scale; validation stays at --imgsz. Up to 2.25x the activation memory",
    )
    parser.add_argument(
        "--noautoanchor",
        action="store_true",
        help="YOLOv5 models from scratch: keep the --cfg anchors even when fewer than 98%% of the labels fit them "
        "(AutoAnchor off); anchor-free models have none",
    )
    parser.add_argument(
        "--close-mosaic",
        type=int,
        default=QUICKSTART_CLOSE_MOSAIC,
        help="train the last N epochs without mosaic and mixup (0: mosaic throughout, as YOLOv5)",
    )


def _add_speed_flags(parser: argparse.ArgumentParser) -> None:
    """How each step runs on the device: precision, SyncBatchNorm, torch.compile, static loss shapes, CUDA graphs."""
    parser.add_argument(
        "--amp",
        choices=AMP_MODES,
        default="auto",
        help="mixed precision: auto (fp16 with loss scaling on CUDA, as YOLOv5; fp32 on CPU), fp16, bf16 (no loss "
        "scaling; Ampere and newer GPUs), off",
    )
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across GPUs (CUDA and DDP only)")
    parser.add_argument(
        "--compile",
        dest="compile_mode",
        nargs="?",
        const="default",
        default="",
        choices=COMPILE_MODES,
        metavar="MODE",
        help="torch.compile the training forward (under DDP: the DDP module); MODE default, reduce-overhead, "
        "max-autotune or max-autotune-no-cudagraphs. Off by default: the first step then compiles (about a "
        "minute), paid back only on long runs (docs/training.md)",
    )
    parser.add_argument(
        "--static-loss-shapes",
        action="store_true",
        help="assign targets in fixed shapes (every candidate pair, masked) instead of listing matches with "
        "nonzero, so the detection loss never makes a GPU step wait for a host read: the same loss to float "
        "rounding, more arithmetic: slower on an H200 too (docs/training.md), so off by default",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay the model's training forward and backward from CUDA graphs captured at the first batch, so "
        "the host launches two graphs instead of each kernel (one GPU; batches of other shapes run eagerly). "
        "Costs the graphs' own activation memory (docs/training.md)",
    )


def _add_run_flags(parser: argparse.ArgumentParser, task: str) -> None:
    """Where the run goes and who follows it: resume, run folder, saving, plots, callbacks, MLflow."""
    parser.add_argument("--resume", nargs="?", const="last", default="", help="resume a run: path to last.pt or latest")
    parser.add_argument("--project", type=Path, default=ROOT / "runs" / ("train-seg" if task == "segment" else "train"))
    parser.add_argument("--name", default="exp", help="run folder name under --project")
    parser.add_argument("--exist-ok", action="store_true", help="reuse an existing run folder instead of exp2, exp3...")
    parser.add_argument("--noval", action="store_true", help="validate only after the final epoch")
    parser.add_argument("--nosave", action="store_true", help="only save the final checkpoint")
    parser.add_argument(
        "--noplots",
        action="store_true",
        help="skip train_batch*.jpg, results.png, the PR/F1/P/R curves and the confusion matrix",
    )
    parser.add_argument(
        "--evolve",
        type=int,
        nargs="?",
        const=300,
        default=0,
        metavar="TRIALS",
        help="tune the hyperparameters instead: tune.py with --trials TRIALS (default 300) in runs/evolve",
    )
    parser.add_argument("--save-period", type=int, default=-1, help="also save epoch<N>.pt every N epochs (-1: off)")
    parser.add_argument(
        "--callbacks",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="modules (pkg.name or a .py path) whose functions named like training events are called on rank 0 "
        "(docs/python-api.md: Callbacks)",
    )
    parser.add_argument(
        "--mlflow",
        action="store_true",
        help="log params, per-epoch metrics and artifacts to MLflow (MLflow's default local store, or "
        "MLFLOW_TRACKING_URI, which also turns it on); needs `pip install mlflow`",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="log options, per-epoch metrics, best.pt and figures to Weights & Biases (project WANDB_PROJECT, which "
        "also turns it on, else the run folder's parent; WANDB_MODE=offline keeps it local); needs `pip install wandb`",
    )


def explicit_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> frozenset[str]:
    """Return the destinations of the flags `argv` sets explicitly (a default is not explicit, even if equal)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(probe.parse_args(argv)))


def train_config_from_argv(argv: list[str] | None, task: str = "detect") -> TrainConfig:
    """Parse train.py's command line into a TrainConfig that also records which options were given."""
    parser = build_train_parser(task)
    cfg = config_from_args(parser.parse_args(argv), task)
    return dataclasses.replace(cfg, explicit=explicit_options(parser, argv))


def config_from_args(args: argparse.Namespace, task: str = "detect") -> TrainConfig:
    """Build the frozen TrainConfig from parsed flags, reading the hyp YAML once."""
    check_dist_timeout(args.dist_timeout)  # here, not in validate(): the process group is made with it
    names = {f.name for f in fields(TrainConfig)}
    values: dict[str, Any] = {key: value for key, value in vars(args).items() if key in names}
    # --hyp auto is loaded once fit() knows the train set's size (utils/train/recipe.py); a file is loaded now.
    hyp_path = None if str(args.hyp) == AUTO else shipped_file(args.hyp)
    values.update(
        hyp=None if hyp_path is None else load_hyp(hyp_path, hyp_overrides(args.label_smoothing)),
        hyp_path=hyp_path,
        cache=str(args.cache).lower(),
        freeze=tuple(args.freeze),
        callbacks=tuple(args.callbacks),
        resume=args.resume or "",
        task=task,
        imgsz=stride_multiples((args.imgsz,))[0],
    )
    return TrainConfig(**values)


def validate(cfg: TrainConfig, ctx: DistContext) -> None:
    """Reject impossible option combinations before any work starts, with one line naming the flag.

    Every rank runs the same checks on the same options, so every rank raises together.
    """
    if cfg.batch_size == AUTOBATCH and cfg.resume:
        raise ConfigError("--batch-size -1 (AutoBatch) with --resume: give a size, or leave it out to keep the run's")
    if cfg.batch_size < 1 and cfg.batch_size != AUTOBATCH:
        raise ConfigError(f"--batch-size {cfg.batch_size} must be at least 1, or -1 for AutoBatch")
    if (not cfg.resume or "batch_size" in cfg.explicit) and cfg.batch_size != AUTOBATCH:
        per_rank_batch(cfg.batch_size, ctx)  # a resumed run's own batch is checked once restored
    if cfg.epochs < 1:
        raise ConfigError(f"--epochs {cfg.epochs} must be at least 1")
    if cfg.close_mosaic < 0:
        raise ConfigError(f"--close-mosaic {cfg.close_mosaic} must be >= 0")
    if cfg.cache not in CACHE_MODES:
        raise ConfigError(f"--cache {cfg.cache} is not one of {', '.join(CACHE_MODES)}")
    if cfg.optimizer not in (AUTO, *OPTIMIZERS):
        raise ConfigError(f"--optimizer {cfg.optimizer} is not one of {', '.join((AUTO, *OPTIMIZERS))}")
    if cfg.workers < 0:
        raise ConfigError(f"--workers {cfg.workers} must be >= 0")
    if cfg.save_period_steps < 0:
        raise ConfigError(f"--save-period-steps {cfg.save_period_steps} must be >= 0 (0: save at epoch ends only)")
    if not 0 <= cfg.seed < 2**32:  # numpy seeds are unsigned 32-bit; -1 would fail only when shards are drawn
        raise ConfigError(f"--seed {cfg.seed} must be in [0, 2**32); every rank derives its randomness from it")
    if cfg.mask_ratio not in (1, 2, 4, 8):
        raise ConfigError(f"--mask-ratio {cfg.mask_ratio} must be one of 1, 2, 4, 8 (a divisor of the stride 8)")
    if cfg.hyp is not None and cfg.hyp.nbs < 1:  # an auto-chosen file is ours, with nbs 16 or 64
        raise ConfigError(f"{cfg.hyp_path}: nbs {cfg.hyp.nbs} must be at least 1")
    smoothing = cfg.hyp.label_smoothing if cfg.hyp is not None else cfg.label_smoothing
    if smoothing is not None and not 0.0 <= smoothing < 1.0:
        raise ConfigError(f"--label-smoothing {smoothing} must be in [0, 1)")
    if cfg.cuda_graph:
        _check_cuda_graph(cfg, ctx)
    if cfg.weights and (problem := checkpoint_path_problem(Path(cfg.weights))):  # a folder, an exported model
        raise ConfigError(f"--weights {cfg.weights} {problem}")
    if cfg.weights and not Path(cfg.weights).is_file():
        raise ConfigError(f"--weights {cfg.weights}: file not found")
    if not cfg.resume and not Path(cfg.data).is_file():
        raise ConfigError(f"--data {cfg.data}: file not found")


def _check_cuda_graph(cfg: TrainConfig, ctx: DistContext) -> None:
    """--cuda-graph runs on one CUDA device in one process, without --compile."""
    if ctx.device.type != "cuda":
        raise ConfigError(f"--cuda-graph needs a CUDA device; this run trains on {ctx.device.type}")
    if ctx.is_distributed:
        raise ConfigError(
            f"--cuda-graph runs in one process; this run has {ctx.world_size} (DDP's collectives inside graphs are "
            "not supported here)"
        )
    if cfg.compile_mode:
        raise ConfigError("--cuda-graph and --compile exclude each other (--compile reduce-overhead has its own)")
    if cfg.multi_scale:
        raise ConfigError("--cuda-graph replays one input shape and --multi-scale changes it every batch; drop one")


def save_run_config(cfg: TrainConfig, run_dir: Path, ctx: DistContext) -> None:
    """Write opt.yaml (resolved options) and hyp.yaml to the run folder, on rank 0 only.

    `cfg` must be resolved: opt.yaml names the concrete optimizer and hyp file, hyp.yaml holds the
    values that ran (what --resume and a user repeating the run need), never "auto".
    """
    if not ctx.is_main:
        return
    assert cfg.hyp is not None and cfg.optimizer != AUTO, "save_run_config: resolve the recipe first"
    run_dir.mkdir(parents=True, exist_ok=True)
    options = cfg.to_dict()
    hyp = options.pop("hyp")
    (run_dir / "opt.yaml").write_text(yaml.safe_dump(options, sort_keys=False), encoding="utf-8")
    (run_dir / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False), encoding="utf-8")


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """--amp as an autocast dtype: auto is fp16 on CUDA (YOLOv5's AMP) and fp32 (None) elsewhere."""
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
