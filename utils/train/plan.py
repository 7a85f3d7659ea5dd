"""The run plan: every decision fit() makes before it builds anything, taken once, in one place, in order.

Resume or restart (the run's options and checkpoint), the dataset YAML, where the weights come from
(a resumed checkpoint, --weights, or --cfg from scratch), the model's spec and family, and the
recipe (`--optimizer auto` / `--hyp auto`). utils/train/setup.py builds the model, data and loaders
from the plan; the engine reads only the plan, never the options' sources.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils import checkpoint as ckpt_io
from utils.config import AUTO
from utils.convert import load_weights
from utils.data.data_config import DataConfig, load_data_config
from utils.data.image_files import list_image_files
from utils.distributed import DistContext, broadcast_object, job_start_number, per_rank_batch, run_on_main
from utils.errors import ConfigError
from utils.families import build_model, checkpoint_family, family_of, segmentation_spec, spec_from_checkpoint
from utils.tasks import Task
from utils.train.autobatch import resolve_autobatch
from utils.train.config import TrainConfig, autocast_dtype, config_from_dict
from utils.train.faults import find_restarted_run
from utils.train.mlflow_logger import mlflow_wanted
from utils.train.recipe import RecipeFiles, needs_image_count, resolve_recipe, restored_recipe_line
from utils.train.records import FamilyTraining, TrainingTask, family_training
from utils.train.results import EarlyStopper
from utils.train.wandb_logger import wandb_wanted

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """What a run trains and how, decided before anything is built (plan_run); the same on every rank.

    `cfg` is final: a resumed run's own options (with what --resume may change), a concrete optimizer
    and hyp. The model starts from `resume` (a checkpoint with optimizer state), else from `weights`
    (a checkpoint whose matching tensors are transferred), else from scratch; `spec` is the model
    to build either way (with the data's class count).
    """

    cfg: TrainConfig
    data: DataConfig
    names: tuple[str, ...]
    spec: Any
    family: FamilyTraining
    resume: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None
    restarted: bool = False  # a torchrun restart of the job (its first attempt ran this same command)

    @property
    def from_scratch(self) -> bool:
        """Whether the weights start from the seed (no resume, no --weights): AutoAnchor may refit anchors."""
        return self.resume is None and self.weights is None


def plan_model(
    cfg: TrainConfig, task: Task, names: tuple[str, ...], resume: dict[str, Any] | None
) -> tuple[Any, dict[str, Any] | None]:
    """The model to build and the checkpoint --weights starts it from: (spec, weights or None).

    A resumed run rebuilds its checkpoint's model; --weights gives the checkpoint's network with the
    data's class count (a --cfg of another family beside it is a one-line error); else --cfg.
    """
    if resume is not None:  # of this task: checked when it was loaded (_load_resumed)
        return spec_from_checkpoint(resume, cfg.resume), None
    if cfg.weights:
        weights = load_weights(cfg.weights)  # ours, or YOLOv5 / Ultralytics converted in memory
        return _spec_from_weights(cfg, task, weights, len(names)), weights
    return task.spec_from_cfg(cfg.model, len(names)), None


def _spec_from_weights(cfg: TrainConfig, task: Task, weights: dict[str, Any], num_classes: int) -> Any:
    """The network --weights fine-tunes: the checkpoint's, with the data's class count.

    A segmenter may start from a detection checkpoint, as in YOLOv5 and Ultralytics: its -seg
    variant shares the backbone, neck and box/class branches by name and shape, so those
    transfer (setup._transfer_weights logs how many) and only the mask branches start from the
    seed. Other task mismatches (a segmentation checkpoint for train.py) stay one-line errors.
    """
    from_detection = task.with_masks and weights["task"] == "detect"
    if not from_detection:
        ckpt_io.check_checkpoint_task(weights, task.name, cfg.weights, "train")
    _check_weights_family(cfg, task, weights, num_classes)
    spec = dataclasses.replace(spec_from_checkpoint(weights, cfg.weights), num_classes=num_classes)
    if not from_detection:
        return spec
    LOGGER.info(
        f"--weights {cfg.weights} is a detection checkpoint: its -seg variant's mask branches start from "
        "scratch, the layers it shares with the detector are fine-tuned"
    )
    return segmentation_spec(spec)


def plan_run(cfg: TrainConfig, training: TrainingTask, ctx: DistContext) -> RunPlan:
    """Take every decision before the build: resume, data, weights, spec and family, recipe; every rank calls it.

    Ranks agree: rank 0 reads files that only it may see (checkpoints, the train list) and
    broadcasts what it found. Problems are one-line ConfigErrors raised before any run folder exists.
    """
    restart = job_start_number(ctx)
    cfg, resume = resolve_resume(cfg, ctx, restart)
    # opt.yaml, the checkpoint and the loggers' own records say what runs: a logger the environment turns on is on.
    cfg = dataclasses.replace(cfg, mlflow=mlflow_wanted(cfg.mlflow), wandb=wandb_wanted(cfg.wandb))
    data = load_data_config(cfg.data, ctx)
    cfg = dataclasses.replace(cfg, data=data.yaml_file)  # resolved: checkpoints name it for val.py from any folder
    names = ("item",) if cfg.single_cls else tuple(data.names)
    spec, weights = plan_model(cfg, training.task, names, resume)
    family = family_training(spec)
    # --batch-size -1: measured now, on the model this run builds; the recipe below depends on the batch.
    cfg = resolve_autobatch(cfg, lambda: build_model(spec), autocast_dtype(cfg.amp, ctx.device), ctx)
    # opt.yaml, hyp.yaml and checkpoints record the concrete optimizer and hyp, never "auto".
    cfg = resolve_run_recipe(cfg, data, ctx, resume is not None, family.recipe_files)
    family.check_hyp(cfg.hyp, cfg.hyp_path)  # a hyp file without a key this family's losses read
    return RunPlan(cfg, data, names, spec, family, resume, weights, restarted=restart > 0)


# Options --resume takes from the new command line when given there; all others come from the checkpoint. They
# change the remaining schedule / the global batch (docs/distributed.md) / when it stops early, who follows it,
# or whether its figures are drawn (--noplots: none from here on; the weights and results.csv are the same)
RESUME_OVERRIDES = ("epochs", "batch_size", "patience", "callbacks", "mlflow", "wandb", "noplots")
# How this attempt runs; none changes what is trained (static_loss_shapes: the same loss to float rounding).
MACHINE_OPTIONS = (
    "device", "workers", "resume", "dist_timeout", "amp", "compile_mode", "static_loss_shapes", "cuda_graph"
)  # fmt: skip


def _choose_resume_checkpoint(cfg: TrainConfig, job: str = "") -> str:
    """Rank 0: the checkpoint --resume continues (newest last.pt, or the given path, or its intact fallback).

    `job`: on a torchrun restart, the job's id; the run's last.pt is taken instead when this job wrote it
    (the first attempt trained on from the given file, which a restart would otherwise go back to).
    """
    path = ckpt_io.find_last_checkpoint(cfg.project) if cfg.resume == "last" else Path(cfg.resume)
    if path is None:
        raise ConfigError(f"--resume: no last.pt found under {cfg.project}; pass the checkpoint path")
    if path.is_file() and path.resolve().parent.name != "weights":  # the run goes on in the folder above weights/
        raise ConfigError(
            f"--resume {path}: a run resumes in its own folder, from <run>/weights/; this file is not in a weights/ "
            f"folder (put it in its run's weights/, or start a new run from it with --weights {path})"
        )
    chosen, _ = ckpt_io.load_resume_checkpoint(path)
    last = chosen.parent / "last.pt"
    if job and last != chosen and last.is_file():
        try:
            own, checkpoint = ckpt_io.load_resume_checkpoint(last)
        except ConfigError:
            return str(chosen)
        if checkpoint.get("job") == job and own != chosen:
            LOGGER.warning(f"torchrun restart: resuming {own}, which this job wrote, rather than --resume {chosen}")
            return str(own)
    return str(chosen)


def resolve_resume(
    cfg: TrainConfig, ctx: DistContext, restart: int | None = None
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """For --resume, decide and load the checkpoint on rank 0, give it to every rank, and return the run's options.

    The run's options come from the checkpoint; `device`, `workers`, `dist_timeout`, `amp`,
    `compile_mode`, `static_loss_shapes` and `cuda_graph` from the new command line (MACHINE_OPTIONS), and
    `--epochs` / `--batch-size` too when given there (RESUME_OVERRIDES). Any other option given
    with --resume with another value than the run's is a one-line error rather than silently
    ignored. The restored options are validated again for this world size.
    After a torchrun restart (`restart`, from job_start_number when None) every rank takes the restart
    path, so they run the same collectives: the run folder this job trained, from its newest intact
    checkpoint, also when the job was started with --resume.
    """
    restart = job_start_number(ctx) if restart is None else restart
    if restart > 0 and not cfg.resume:
        return _resume_after_restart(cfg, ctx, restart)
    if not cfg.resume:
        return cfg, None
    job = ctx.run_id if restart > 0 else ""
    chosen = run_on_main(lambda: _choose_resume_checkpoint(cfg, job), ctx, "choosing the checkpoint to resume")
    return _load_resumed(cfg, Path(broadcast_object(chosen, ctx)), ctx, is_restart=restart > 0)


def _restart_target(cfg: TrainConfig, ctx: DistContext) -> tuple[str | None, str | None]:
    """Rank 0 after a torchrun restart: (this job's run folder, its newest intact checkpoint), either may be None."""
    run_dir = find_restarted_run(cfg.project, ctx.run_id, cfg.name)
    if run_dir is None:
        return None, None
    try:
        chosen, _ = ckpt_io.load_resume_checkpoint(run_dir / "weights" / "last.pt")
    except (FileNotFoundError, ConfigError):
        return str(run_dir), None
    return str(run_dir), str(chosen)


def _resume_after_restart(
    cfg: TrainConfig, ctx: DistContext, restart: int
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """torchrun restarted the workers: continue the run folder of the first attempt from its newest checkpoint.

    Without a checkpoint yet, the same folder starts again from scratch (no exp2); without a
    folder of this job (it died before creating one), a new run starts.
    """
    target = run_on_main(lambda: _restart_target(cfg, ctx), ctx, "finding the restarted job's run folder")
    run_dir, checkpoint = broadcast_object(target, ctx)
    attempt = f"torchrun restart {restart}"
    if run_dir is None:
        LOGGER.warning(f"{attempt}: no run folder of job {ctx.run_id!r} under {cfg.project}; starting a new run")
        return cfg, None
    if checkpoint is None:
        LOGGER.warning(f"{attempt}: {run_dir} has no checkpoint yet; training it again from the start")
        return dataclasses.replace(cfg, project=Path(run_dir).parent, name=Path(run_dir).name, exist_ok=True), None
    LOGGER.warning(f"{attempt}: resuming {run_dir} from {checkpoint}")
    return _load_resumed(dataclasses.replace(cfg, resume=checkpoint), Path(checkpoint), ctx, is_restart=True)


def _same(given: Any, stored: Any) -> bool:
    """Whether an option given with --resume equals the run's (paths compared resolved)."""
    if isinstance(given, Path) and isinstance(stored, Path):
        return given.resolve() == stored.resolve()
    return given == stored


def _option(cfg: TrainConfig, name: str) -> Any:
    """The value flag destination `name` gives the run; --label-smoothing's is the hyp's (the file's when not given)."""
    if name == "label_smoothing" and cfg.hyp is not None:
        return cfg.hyp.label_smoothing
    return getattr(cfg, name)


def _is_auto(name: str, value: Any) -> bool:
    """Whether a flag given with --resume asks for auto (`--optimizer auto`, `--hyp auto`): the run's own choice."""
    return (name == "optimizer" and value == AUTO) or (name == "hyp" and value is None)


def _refuse_changed_options(cfg: TrainConfig, stored: TrainConfig) -> None:
    """One-line error for an option given with --resume that differs from the run's and would be ignored."""
    changed = [
        name
        for name in sorted(cfg.explicit - set(RESUME_OVERRIDES) - set(MACHINE_OPTIONS))
        if not _is_auto(name, _option(cfg, name)) and not _same(_option(cfg, name), _option(stored, name))
    ]
    if changed:
        allowed = ", ".join(_flag(name) for name in (*RESUME_OVERRIDES, *MACHINE_OPTIONS) if name != "resume")
        raise ConfigError(
            f"--resume continues a run with its own options; {_flag(changed[0])} cannot be changed "
            f"(allowed with --resume: {allowed})"
        )


def _flag(name: str) -> str:
    """The command-line flag of TrainConfig field `name` (`model` is --cfg, `compile_mode` --compile)."""
    return "--" + {"model": "cfg", "compile_mode": "compile"}.get(name, name).replace("_", "-")


def _load_resumed(
    cfg: TrainConfig, path: Path, ctx: DistContext, is_restart: bool = False
) -> tuple[TrainConfig, dict[str, Any]]:
    """Load checkpoint `path` on rank 0, give it to every rank, and rebuild the run's options from it (resolve_resume).

    Only rank 0 is sure to see the file: on several nodes the run folder may sit on its node's own
    disk (only the dataset must be shared), and a file at the same path on another node could be
    another run's. So rank 0 reads it and broadcasts it (CPU tensors), once per resume.
    """
    read = run_on_main(lambda: ckpt_io.load_checkpoint(path, for_resume=True), ctx, f"loading {path}")
    checkpoint = broadcast_object(read, ctx)
    ckpt_io.check_checkpoint_task(checkpoint, cfg.task, path, "train")  # every resume path: before "Resuming"
    stored = config_from_dict(checkpoint["train_config"])
    if not is_restart:  # a torchrun restart repeats the first command line, which set up this run
        _refuse_changed_options(cfg, stored)
    run_dir = path.resolve().parent.parent
    overrides = {name: getattr(cfg, name) for name in RESUME_OVERRIDES if name in cfg.explicit}
    resumed = dataclasses.replace(
        stored,
        **overrides,
        resume=str(path),
        device=cfg.device,
        workers=cfg.workers,
        dist_timeout=cfg.dist_timeout,
        amp=cfg.amp,
        compile_mode=cfg.compile_mode,
        static_loss_shapes=cfg.static_loss_shapes,
        cuda_graph=cfg.cuda_graph,
        project=run_dir.parent,
        name=run_dir.name,
        exist_ok=True,
        explicit=cfg.explicit,
    )
    _check_resumed_batch(resumed, stored, ctx)
    differ = {name: value for name, value in overrides.items() if value != getattr(stored, name)}
    changed = ", ".join(f"{name} {getattr(stored, name)} -> {value}" for name, value in differ.items())
    # A mid-epoch checkpoint may hold the epoch's last batch (a stop at that step): the epoch's length is
    # not known here, so this line says what was done and the start-up line (setup.log_startup) what is next.
    epoch, batches_done = checkpoint["epoch"] + 2, checkpoint.get("batches_done", 0)
    where = f"in epoch {epoch}, after its batch {batches_done}" if batches_done else f"from epoch {epoch}"
    if not training_ended(checkpoint, resumed)[0]:  # a finished run is refused by fit() before anything is built
        LOGGER.info(f"Resuming {run_dir} {where}" + (f" ({changed})" if changed else ""))
    return resumed, checkpoint


def training_ended(checkpoint: dict[str, Any], cfg: TrainConfig) -> tuple[str, str]:
    """Why `checkpoint` has no epoch left to train under the run's options `cfg`, and what would train it on.

    ("", "") when it has: it has trained fewer than --epochs and its early-stopping record (absent in
    checkpoints of earlier versions) does not say stop with this run's --patience.
    """
    done = checkpoint["epoch"] + 1
    if done >= cfg.epochs:
        return f"already finished {done} of --epochs {cfg.epochs}", "a larger --epochs trains it on"
    record = checkpoint.get("early_stop")
    if record is None or checkpoint.get("batches_done"):  # mid-epoch: its last epoch end did not stop it
        return "", ""
    stopper = EarlyStopper(cfg.patience)
    stopper.load_state_dict(record)
    if not stopper.stopped_after(checkpoint["epoch"]):
        return "", ""
    best = stopper.best_epoch + 1
    return f"stopped early after epoch {done} (best epoch {best}, --patience {cfg.patience})", (
        "a larger --patience, or --patience 0, trains it on"
    )


def _check_resumed_batch(resumed: TrainConfig, stored: TrainConfig, ctx: DistContext) -> None:
    """The restored global batch must still divide over this attempt's ranks (one line saying how to change it)."""
    try:
        per_rank_batch(resumed.batch_size, ctx)
    except ConfigError:
        source = "given" if resumed.batch_size != stored.batch_size else "the run's stored"
        raise ConfigError(
            f"--resume: {source} --batch-size {resumed.batch_size} is not divisible by {ctx.world_size} processes; "
            f"pass --batch-size N (a multiple of {ctx.world_size}) with --resume to change the global batch"
        ) from None


def resolve_run_recipe(
    cfg: TrainConfig, data: DataConfig, ctx: DistContext, resumed: bool, files: RecipeFiles
) -> TrainConfig:
    """Return `cfg` with `--optimizer auto` / `--hyp auto` resolved, and log the choice in one line on rank 0.

    Every rank must call it. The rule (utils/train/recipe.py) needs the train set's size only when
    both are auto: rank 0 counts the images the train split lists and broadcasts the count, so every
    rank resolves the same recipe. A resumed run keeps the optimizer and hyp of its checkpoint, even
    when --epochs or --batch-size change its number of steps: its optimizer state belongs to them.
    `files` are the model family's recipe files.
    """
    if resumed and cfg.optimizer != AUTO and cfg.hyp is not None:
        LOGGER.info(restored_recipe_line(cfg))
        return cfg
    count = None
    if needs_image_count(cfg):
        listed = run_on_main(lambda: len(list_image_files(data.split("train"))), ctx, "counting the train images")
        count = broadcast_object(listed, ctx)
    resolved, line = resolve_recipe(cfg, files, count)
    LOGGER.info(line)
    return resolved


# The spec fields that make two networks of one family differ (the class count is the data's, anchors AutoAnchor's).
NETWORK_SHAPE_FIELDS = ("layout", "depth_multiple", "width_multiple", "max_channels", "reg_max", "end_to_end")


def _check_weights_family(cfg: TrainConfig, task: Task, source: dict[str, Any], num_classes: int) -> None:
    """A --cfg given beside --weights must name the checkpoint's network: its family and size (one line otherwise).

    The network comes from the checkpoint; a --cfg of another family or size (yolov5s beside a yolov5n
    checkpoint) would otherwise be silently ignored, and opt.yaml would name a model that never trained.
    """
    if "model" not in cfg.explicit:
        return
    stored = checkpoint_family(source, cfg.weights).name
    wanted_spec = task.spec_from_cfg(cfg.model, num_classes)
    wanted = family_of(wanted_spec).name
    if wanted != stored:
        raise ConfigError(
            f"--weights {cfg.weights} holds a model of the {stored} family but --cfg {cfg.model} is of the {wanted} "
            "family; drop --cfg to fine-tune the checkpoint's network"
        )
    held = spec_from_checkpoint(source, cfg.weights)
    shape = [name for name in NETWORK_SHAPE_FIELDS if hasattr(wanted_spec, name)]
    differing = [
        f"{name} {getattr(held, name, None)} against {getattr(wanted_spec, name)}"
        for name in shape
        if getattr(held, name, None) != getattr(wanted_spec, name)
    ]
    if differing:
        raise ConfigError(
            f"--weights {cfg.weights} holds another network than --cfg {cfg.model} ({', '.join(differing)}); "
            "drop --cfg to fine-tune the checkpoint's network, or train --cfg from scratch"
        )
