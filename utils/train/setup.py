"""What fit() builds from the run plan before the loop: model, datasets and loaders, weight check, start-up log."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.model_info import memory_format, model_info
from utils.data.augment import AugmentParams
from utils.data.data_config import DataConfig
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.loader import TrainLoader, build_train_loader, build_val_loader
from utils.distributed import DistContext, all_gather_objects, per_rank_batch
from utils.errors import ConfigError
from utils.families import build_model
from utils.hyp import Hyp
from utils.tasks import Task
from utils.train.config import TrainConfig
from utils.train.plan import RunPlan

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


def _transfer_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load the entries of `state` whose names and shapes match `model` (fine-tuning to new classes)."""
    own = model.state_dict()
    matching = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(matching, strict=False)
    LOGGER.info(f"Transferred {len(matching)}/{len(own)} tensors from {source}")


def build_model_bundle(plan: RunPlan, ctx: DistContext) -> ModelBundle:
    """Build the planned model on ctx.device: from the resumed checkpoint, from --weights, or from scratch.

    Initial weights come from the shared seed, so they are identical on every rank before DDP
    even broadcasts them.
    """
    cfg = plan.cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = build_model(plan.spec)
    if plan.resume is not None:
        model.load_state_dict(plan.resume["model"])
    elif plan.weights is not None:
        _transfer_weights(model, plan.weights.get("ema") or plan.weights["model"], cfg.weights)
    freeze_layers(model, cfg.freeze)
    return ModelBundle(model.to(ctx.device, memory_format=memory_format(cfg.channels_last)), plan.spec, plan.names)


def freeze_layers(model: nn.Module, freeze: tuple[int, ...]) -> None:
    """Freeze layers by index: one value N freezes layers 0..N-1, several values freeze those layers.

    Layers are numbered in the order of `model.layers()` (backbone first, then neck and head);
    YOLOv5's --freeze has the same two forms, so `--freeze 10` freezes its backbone. A bad
    index raises a one-line ConfigError before anything is frozen, since an index past the
    last layer would otherwise be logged as frozen and one that freezes everything would
    only fail in the first backward pass.
    """
    if not freeze:
        return
    layers = model.layers()
    indices = _frozen_indices(freeze, len(layers))
    frozen_params = {id(p) for index in indices for p in layers[index].parameters()}
    if not any(p.requires_grad and id(p) not in frozen_params for p in model.parameters()):
        raise ConfigError(
            f"--freeze {' '.join(map(str, freeze))} freezes every trainable layer of this model "
            f"(layers 0-{len(layers) - 1}), so nothing is left to train; freeze fewer layers"
        )
    frozen = 0
    for parameter in model.parameters():
        if id(parameter) in frozen_params:
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    LOGGER.info(f"Froze layers {sorted(indices)} ({frozen:,} parameters)")


def _frozen_indices(freeze: tuple[int, ...], num_layers: int) -> set[int]:
    """The layer indices --freeze names, or a ConfigError naming --freeze and the model's valid range.

    One value N means "the first N layers" (0 freezes none); several values are layer indices,
    each in 0..num_layers-1. N = num_layers passes here and is refused by the caller's
    nothing-left-to-train check, whose message says what is wrong with it.
    """
    flag = f"--freeze {' '.join(map(str, freeze))}"
    last = num_layers - 1
    if len(freeze) == 1:
        count = freeze[0]
        if not 0 <= count <= num_layers:
            raise ConfigError(
                f"{flag}: this model has {num_layers} layers (0-{last}) and one value N freezes the first N, "
                f"so N must be 0-{last}"
            )
        return set(range(count))
    bad = [index for index in freeze if not 0 <= index <= last]
    if bad:
        raise ConfigError(f"{flag}: no layer {', '.join(map(str, bad))} in this model; its layers are 0-{last}")
    return set(freeze)


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
        names_file=data.yaml_file,
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
    # Rectangles of the global validation batch: the same letterbox, hence the same metrics, on any number of ranks.
    val_options = DatasetOptions.for_evaluation(batch_size=per_rank * 2 * ctx.world_size, **common)
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
        f"{epoch_batches_line(datasets.train_loader, cfg.epochs, cfg.noval)} | device {ctx.device}"
    )


def epoch_batches_line(loader: TrainLoader, epochs: int, noval: bool = False) -> str:
    """'N batches/epoch', and for a run resumed mid-epoch where in its epoch it goes on, for the start-up line.

    After a mid-epoch resume `len(loader)` counts only the batches left in that epoch, and a stop at
    an epoch's last step leaves none: the run then validates and saves that epoch before the next
    one. Stating that here keeps "0 batches/epoch" and the epoch's "train: 0 images" line from
    reading like an empty dataset. `noval`: only the run's last epoch is validated.
    """
    total = loader.batches_per_epoch
    left, epoch = len(loader), loader.sampler.epoch + 1  # the epoch `start` selected, 1-based
    line = f"{total} batches/epoch"
    if loader.sampler.plan_epoch == loader.sampler.epoch:  # resumed on another geometry: the unseen images only
        return f"{line} (resumed epoch {epoch}: {left} batch(es) of the images it had not trained)"
    if left == total:
        return line
    if left > 0:
        return f"{line} (resumed epoch {epoch} goes on at batch {total - left + 1}, {left} left)"
    after = f"then epoch {epoch + 1} starts" if epoch < epochs else "which ends the run"
    done = "saved" if noval and epoch < epochs else "validated and saved"
    return f"{line} (resumed epoch {epoch} has no batch left: it is {done}, {after})"
