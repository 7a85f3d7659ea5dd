"""Training set-up before the loop: resume, recipe, model, datasets and loaders, weight check, start-up log."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.yolo import memory_format, model_info
from utils import checkpoint as ckpt_io
from utils.config import AUTO, TrainConfig, config_from_dict
from utils.convert import load_weights
from utils.data.augment import AugmentParams
from utils.data.data_config import DataConfig
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.labels import list_image_files
from utils.data.loader import build_train_loader, build_val_loader
from utils.distributed import DistContext, all_gather_objects, broadcast_object, per_rank_batch, run_on_main
from utils.errors import ConfigError
from utils.families import checkpoint_family, family_of, spec_from_checkpoint
from utils.hyp import Hyp
from utils.tasks import Task
from utils.train.faults import find_restarted_run
from utils.train.recipe import YOLOV5_RECIPES, RecipeFiles, needs_image_count, resolve_recipe, restored_recipe_line

LOGGER = logging.getLogger(__name__)


@dataclass
class ModelBundle:
    """The unwrapped model with what rebuilds it: its spec (any family's) and class names."""

    model: nn.Module
    spec: Any
    names: tuple[str, ...]


@dataclass
class Datasets:
    """Train/val datasets and their loaders for this rank."""

    train: LoadImagesAndLabels
    val: LoadImagesAndLabels
    train_loader: Any
    val_loader: Any
    per_rank_batch: int


# Options --resume takes from the new command line when given there; all others come from the checkpoint.
# change the remaining schedule / the global batch (docs/distributed.md), or who follows the run
RESUME_OVERRIDES = ("epochs", "batch_size", "callbacks", "mlflow")
MACHINE_OPTIONS = ("device", "workers", "resume", "dist_timeout", "amp")  # where and how this attempt runs


def _choose_resume_checkpoint(cfg: TrainConfig) -> str:
    """Rank 0: the checkpoint --resume continues (newest last.pt, or the given path, or its intact fallback)."""
    path = ckpt_io.find_last_checkpoint(cfg.project) if cfg.resume == "last" else Path(cfg.resume)
    if path is None:
        raise ConfigError(f"--resume: no last.pt found under {cfg.project}; pass the checkpoint path")
    chosen, _ = ckpt_io.load_resume_checkpoint(path)
    return str(chosen)


def resolve_resume(cfg: TrainConfig, ctx: DistContext) -> tuple[TrainConfig, dict[str, Any] | None]:
    """For --resume, decide and load the checkpoint on rank 0, give it to every rank, and return the run's options.

    The run's options come from the checkpoint; `device`, `workers` and `dist_timeout` from the
    new command line, and `--epochs` / `--batch-size` too when given there (RESUME_OVERRIDES). Any
    other option given with --resume with another value than the run's is a one-line error
    rather than silently ignored. The restored options are validated again for this world size.
    After a torchrun restart every rank takes the restart path, so they run the same collectives:
    the start's number within the job is the same on every rank, and a restart counted by any
    agent counts too (one whose workers did not fail does not count it; an agent store started
    afresh by a new rank-0 agent numbers starts from 0 again).
    """
    restart = max(ctx.generation, *all_gather_objects(ctx.restart_count, ctx))
    if restart > 0 and not cfg.resume:
        return _resume_after_restart(cfg, ctx, restart)
    if not cfg.resume:
        return cfg, None
    chosen = run_on_main(lambda: _choose_resume_checkpoint(cfg), ctx, "choosing the checkpoint to resume")
    return _load_resumed(cfg, Path(broadcast_object(chosen, ctx)), ctx)


def _restart_target(cfg: TrainConfig, ctx: DistContext) -> tuple[str | None, str | None]:
    """Rank 0 after a torchrun restart: (this job's run folder, its newest intact checkpoint), either may be None."""
    run_dir = find_restarted_run(cfg.project, ctx.run_id)
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
        flag = "--" + {"model": "cfg"}.get(changed[0], changed[0]).replace("_", "-")
        raise ConfigError(
            f"--resume continues a run with its own options; {flag} cannot be changed "
            "(allowed with --resume: --epochs, --batch-size, --device, --workers, --dist-timeout, --amp, --callbacks, "
            "--mlflow)"
        )


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
        project=run_dir.parent,
        name=run_dir.name,
        exist_ok=True,
        explicit=cfg.explicit,
    )
    _check_resumed_batch(resumed, stored, ctx)
    differ = {name: value for name, value in overrides.items() if value != getattr(stored, name)}
    changed = ", ".join(f"{name} {getattr(stored, name)} -> {value}" for name, value in differ.items())
    where = f"epoch {checkpoint['epoch'] + 2}" + (
        f" batch {checkpoint['batches_done'] + 1}" if checkpoint.get("batches_done") else ""
    )
    LOGGER.info(f"Resuming {run_dir} from {where}" + (f" ({changed})" if changed else ""))
    return resumed, checkpoint


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
    cfg: TrainConfig, data: DataConfig, ctx: DistContext, resumed: bool, files: RecipeFiles = YOLOV5_RECIPES
) -> TrainConfig:
    """Return `cfg` with `--optimizer auto` / `--hyp auto` resolved, and log the choice in one line on rank 0.

    Every rank must call it. The rule (utils/train/recipe.py) needs the train set's size only when
    both are auto: rank 0 counts the images the train split lists and broadcasts the count, so every
    rank resolves the same recipe. A resumed run keeps the optimizer and hyp of its checkpoint, even
    when --epochs or --batch-size change its number of steps: its optimizer state belongs to them.
    `files` are the model family's recipe files (YOLOv5's by default).
    """
    if resumed and cfg.optimizer != AUTO and cfg.hyp is not None:
        LOGGER.info(restored_recipe_line(cfg))
        return cfg
    count = None
    if needs_image_count(cfg):
        listed = run_on_main(lambda: len(list_image_files(data.split("train"))), ctx, "counting the train images")
        count = broadcast_object(listed, ctx)
    resolved, line = resolve_recipe(cfg, count, files)
    LOGGER.info(line)
    return resolved


def _transfer_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load the entries of `state` whose names and shapes match `model` (fine-tuning to new classes)."""
    own = model.state_dict()
    matching = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(matching, strict=False)
    LOGGER.info(f"Transferred {len(matching)}/{len(own)} tensors from {source}")


def build_model_bundle(
    cfg: TrainConfig, task: Task, data: DataConfig, ctx: DistContext, resume: dict[str, Any] | None
) -> ModelBundle:
    """Build the model (from scratch, from --weights, or from the resume checkpoint) on ctx.device.

    Initial weights come from the shared seed, so they are identical on every rank before DDP
    even broadcasts them.
    """
    names = ("item",) if cfg.single_cls else data.names
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if resume is not None:
            ckpt_io.check_checkpoint_task(resume, task.name, cfg.resume, "train")
            spec = spec_from_checkpoint(resume, cfg.resume)
            model = task.build_model(spec)
            model.load_state_dict(resume["model"])
        elif cfg.weights:
            source = load_weights(cfg.weights)  # ours, or YOLOv5 / Ultralytics converted in memory
            ckpt_io.check_checkpoint_task(source, task.name, cfg.weights, "train")
            _check_weights_family(cfg, task, source, len(names))
            spec = dataclasses.replace(spec_from_checkpoint(source, cfg.weights), num_classes=len(names))
            model = task.build_model(spec)
            _transfer_weights(model, source.get("ema") or source["model"], cfg.weights)
        else:
            spec = task.spec_from_cfg(cfg.model, len(names))
            model = task.build_model(spec)
    freeze_layers(model, cfg.freeze)
    return ModelBundle(model.to(ctx.device, memory_format=memory_format(cfg.channels_last)), spec, tuple(names))


def _check_weights_family(cfg: TrainConfig, task: Task, source: dict[str, Any], num_classes: int) -> None:
    """A --cfg given beside --weights must name a model of the checkpoint's family (one line otherwise).

    The network comes from the checkpoint; a --cfg of another family would otherwise be silently ignored.
    """
    if "model" not in cfg.explicit:
        return
    stored = checkpoint_family(source, cfg.weights).name
    wanted = family_of(task.spec_from_cfg(cfg.model, num_classes)).name
    if wanted != stored:
        raise ConfigError(
            f"--weights {cfg.weights} holds a model of the {stored} family but --cfg {cfg.model} is of the {wanted} "
            "family; "
            "drop --cfg to fine-tune the checkpoint's network"
        )


def freeze_layers(model: nn.Module, freeze: tuple[int, ...]) -> None:
    """Freeze layers by index: one value N freezes layers 0..N-1, several values freeze those layers.

    Layers are numbered in the order of `model.layers()` (backbone first, then neck and head).
    """
    if not freeze:
        return
    indices = set(range(freeze[0])) if len(freeze) == 1 else set(freeze)
    frozen = 0
    for index, layer in enumerate(model.layers()):
        if index in indices:
            for parameter in layer.parameters():
                parameter.requires_grad_(False)
                frozen += parameter.numel()
    LOGGER.info(f"Froze layers {sorted(indices)} ({frozen:,} parameters)")


def augment_params(hyp: Hyp, rect: bool) -> AugmentParams:
    """Select the augmentation fields of `hyp`; rectangular batches disable mosaic and mixup."""
    names = {f.name for f in dataclasses.fields(AugmentParams)}
    values = {k: v for k, v in hyp.to_dict().items() if k in names}
    if rect:
        values.update(mosaic=0.0, mixup=0.0)
    return AugmentParams(**values)


def build_datasets(cfg: TrainConfig, task: Task, data: DataConfig, bundle: ModelBundle, ctx: DistContext) -> Datasets:
    """Build this rank's train and val datasets and loaders.

    `cfg.batch_size` is global; each rank loads `batch_size // world_size` images per step.
    Validation is sharded across ranks without padding (ShardedInferenceSampler) and its
    statistics gathered, so each val image is scored exactly once and no rank idles.
    Raises a one-line ConfigError on every rank when ranks built different train or val sets.
    """
    per_rank = per_rank_batch(cfg.batch_size, ctx)
    stride = int(bundle.model.stride.max())
    common = dict(
        img_size=cfg.imgsz,
        stride=stride,
        single_cls=cfg.single_cls,
        with_masks=task.with_masks,
        mask_ratio=cfg.mask_ratio,
        overlap_mask=cfg.overlap_mask,
        num_classes=len(data.names),
        seed=cfg.seed,
        workers=cfg.workers,
    )
    train_options = DatasetOptions(
        batch_size=per_rank,
        augment=True,
        aug=augment_params(cfg.hyp, cfg.rect),
        rect=cfg.rect,
        cache_mode=cfg.cache,
        close_mosaic_epoch=max(cfg.epochs - cfg.close_mosaic, 0) if cfg.close_mosaic else None,
        hsv_on_device=ctx.device.type == "cuda",  # the GPU jitters a batch in microseconds, a worker 1.5 ms/image
        **common,
    )
    train = LoadImagesAndLabels(data.split("train"), train_options, ctx, data.coco_source("train"))
    val_options = DatasetOptions.for_evaluation(batch_size=per_rank * 2, **common)
    val = LoadImagesAndLabels(data.split("val"), val_options, ctx, data.coco_source("val"))
    # Shards and sharded validation assume one dataset: nodes with differing copies fail here, not later.
    train.check_same_on_every_rank("train set")
    val.check_same_on_every_rank("val set")
    train_loader = build_train_loader(
        train, per_rank, cfg.workers, ctx, cfg.seed, shuffle=not cfg.rect, epochs=cfg.epochs
    )
    val_loader = build_val_loader(val, per_rank * 2, cfg.workers, ctx)
    return Datasets(train, val, train_loader, val_loader, per_rank)


def verify_identical_weights(model: nn.Module, ctx: DistContext) -> None:
    """Raise when ranks hold different model weights or buffers; every rank must call it.

    After DDP's broadcast every rank must hold bit-identical tensors, so each rank hashes the
    raw bytes of every floating-point tensor and the digests are compared exactly (a summed
    checksum would miss swapped or slightly different values).
    """
    if not ctx.is_distributed:
        return
    digests = {
        name: hashlib.sha1(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
    }
    every = all_gather_objects(digests, ctx)
    differing = sorted({name for other in every[1:] for name in digests if other.get(name) != every[0].get(name)})
    if differing:
        raise RuntimeError(f"model weights differ across ranks in {len(differing)} tensors, first {differing[0]}")


def log_startup(cfg: TrainConfig, bundle: ModelBundle, datasets: Datasets, accumulate: int, ctx: DistContext) -> None:
    """Log the numbers that catch mistakes: world size, batches, accumulation, model and data sizes."""
    LOGGER.info(model_info(bundle.model, cfg.imgsz))
    cached = len(datasets.train.cache) if datasets.train.cache is not None else 0
    LOGGER.info(
        f"world size {ctx.world_size} | global batch {cfg.batch_size} | per-rank batch {datasets.per_rank_batch} | "
        f"accumulate {accumulate} (nominal batch {int(cfg.hyp.nbs)}) | train images {len(datasets.train)} "
        f"(this rank's shard {len(datasets.train.shard)}, cached {cached}) | val images {len(datasets.val)} | "
        f"{len(datasets.train_loader)} steps/epoch | device {ctx.device}"
    )
