"""The training recipe (optimizer + hyp file) that `--optimizer auto` and `--hyp auto` choose from the run's sizes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from utils.config import AUTO, DEFAULT_HYP, QUICKSTART_HYP, ROOT
from utils.hyp import Hyp, hyp_overrides, is_yolov5_hyp_file, load_hyp
from utils.train.config import TrainConfig
from utils.train.optim import accumulate_steps


@dataclass(frozen=True)
class Recipe:
    """An optimizer and the hyp file tuned for it (learning rate, momentum, warmup, nominal batch)."""

    optimizer: str
    hyp_path: Path


# Why two complete files rather than one default hyp whose optimizer keys auto rewrites: the file the
# start-up line names is exactly what runs (hyp.yaml in the run folder equals it, --label-smoothing
# aside), a user can pass either pair to get the same run on purpose, and YOLOv5's file stays YOLOv5's.
# Both files share every augmentation and loss value; they differ in lr0, momentum, warmup and nbs.
@dataclass(frozen=True)
class RecipeFiles:
    """A model family's two recipe files: the short-run (AdamW) and the long-run (SGD) one (utils/train/records.py)."""

    short: Path
    long: Path


SHORT_RUN = Recipe("AdamW", QUICKSTART_HYP)  # lr0 0.001, nbs 16: one optimizer step per batch of 16
LONG_RUN = Recipe("SGD", DEFAULT_HYP)  # YOLOv5's scratch-low: lr0 0.01, accumulating to nbs 64
YOLOV5_RECIPES = RecipeFiles(SHORT_RUN.hyp_path, LONG_RUN.hyp_path)
LONG_RUN_NBS = 64  # LONG_RUN's nbs, so the rule needs no file (tests/test_recipe.py checks they agree)

# The fewest optimizer steps (at nbs 64) at which auto picks SGD, from benchmarks/recipes.py (docs/training.md,
# "Choosing a recipe"). SGD's mAP50-95 as a share of AdamW's, by the run's SGD steps: 0.01 at 120, 0.29 at
# 320, 0.39 at 640, 0.93 at 1,920 (224 px), 1.00 at 4,800 (2,000 images at 160 px, a tie) and 0.94 at
# 6,080 (the same images at 128 px). The two meet near 5,000 steps, where exactly moves with the data.
# 10,000 keeps AdamW for every size it won or tied at, with a margin over the longest, and gives runs of
# COCO's size (~550,000 steps) the SGD recipe YOLOv5 tuned for them.
AUTO_SGD_MIN_STEPS = 10_000

# An explicit --hyp with --optimizer auto: the optimizer the file's lr0 was tuned for. SGD recipes use
# ~0.01 (YOLOv5's files), Adam/AdamW ones ~0.001 (ours, and the rate YOLOv5's files name for Adam);
# this value is between the two, a factor of ~3 from each.
SGD_MIN_LR0 = 0.003


def optimizer_steps(num_images: int, global_batch: int, nbs: float, epochs: int) -> int:
    """Return the optimizer steps of a whole run: ceil(batches per epoch / accumulation) x epochs.

    `global_batch` is the global batch (summed over ranks): the count does not depend on the world
    size or the per-rank batch, so a run resumed on another number of ranks counts the same. The
    engine steps every `accumulate_steps(global_batch, nbs)` batches and at each epoch's end; the
    warmup's accumulation ramp adds a few early steps that this count leaves out.
    """
    if num_images < 1 or global_batch < 1 or epochs < 1:
        raise ValueError(
            f"optimizer_steps needs positive sizes: {num_images} images, batch {global_batch}, {epochs} epochs"
        )
    batches = math.ceil(num_images / global_batch)
    return math.ceil(batches / accumulate_steps(global_batch, round(nbs))) * epochs


def auto_recipe(num_images: int, global_batch: int, epochs: int) -> tuple[Recipe, int]:
    """The rule of `--optimizer auto`: return (recipe, the run's optimizer steps at YOLOv5's nominal batch 64).

    A pure function of the run's sizes. SGD with YOLOv5's scratch-low settings needs many optimizer
    steps of 64 images; a run that would give it fewer than AUTO_SGD_MIN_STEPS trains with AdamW
    stepping once per batch of 16 instead (SHORT_RUN), which makes ~4x the steps of the same data.
    """
    steps = optimizer_steps(num_images, global_batch, LONG_RUN_NBS, epochs)
    return (LONG_RUN if steps >= AUTO_SGD_MIN_STEPS else SHORT_RUN), steps


def optimizer_for_lr0(lr0: float) -> str:
    """The optimizer a hyp file with learning rate `lr0` was tuned for: SGD from SGD_MIN_LR0 up, else AdamW."""
    return LONG_RUN.optimizer if lr0 >= SGD_MIN_LR0 else SHORT_RUN.optimizer


def hyp_file_for(optimizer: str, files: RecipeFiles) -> Path:
    """The recipe file that goes with an explicit --optimizer: the long-run one for SGD (YOLOv5's scratch-low for
    YOLOv5 models), the short-run one for Adam/AdamW."""
    return files.long if optimizer == LONG_RUN.optimizer else files.short


def needs_image_count(cfg: TrainConfig) -> bool:
    """Whether resolving `cfg` needs the train set's size: only when both the optimizer and the hyp are auto."""
    return cfg.optimizer == AUTO and cfg.hyp is None


def resolve_recipe(
    cfg: TrainConfig, files: RecipeFiles, num_train_images: int | None = None
) -> tuple[TrainConfig, str]:
    """Return `cfg` with a concrete optimizer and hyp, and the one start-up line that says why.

    - both given (or restored by --resume): unchanged;
    - `--hyp FILE` only: SGD for a YOLOv5 file (`is_yolov5_hyp_file`), as YOLOv5 trains it whatever its
      lr0, accumulating to nbs 64; for another file the optimizer its lr0 was tuned for (`optimizer_for_lr0`);
    - `--optimizer NAME` only: the recipe file for NAME (`hyp_file_for`);
    - neither: `auto_recipe` on `num_train_images` (the images listed in the train split), the global
      batch and the epochs. Raises ValueError when that count is needed and not given.
    `files` are the model family's recipe files (the rule is the same for every family).
    --label-smoothing applies to whichever file is loaded here.
    """
    if cfg.optimizer != AUTO and cfg.hyp is not None:
        return cfg, f"recipe: {_describe(cfg.optimizer, cfg.hyp, cfg.hyp_path)}: --optimizer and --hyp given"
    if cfg.hyp is not None and cfg.hyp_path is not None and is_yolov5_hyp_file(cfg.hyp_path):
        optimizer, reason = LONG_RUN.optimizer, "a YOLOv5 hyp file (no nbs) trains with YOLOv5's default optimizer"
        chosen = _describe(optimizer, cfg.hyp, cfg.hyp_path)
        return dataclasses.replace(cfg, optimizer=optimizer), f"optimizer auto -> {chosen}: {reason}"
    if cfg.hyp is not None:
        optimizer = optimizer_for_lr0(cfg.hyp.lr0)
        kind = "an SGD" if optimizer == LONG_RUN.optimizer else "an Adam/AdamW"
        reason = f"the given hyp's lr0 {cfg.hyp.lr0:g} is {kind} learning rate (SGD from {SGD_MIN_LR0:g}, SGD_MIN_LR0)"
        chosen = _describe(optimizer, cfg.hyp, cfg.hyp_path)
        return dataclasses.replace(cfg, optimizer=optimizer), f"optimizer auto -> {chosen}: {reason}"
    if cfg.optimizer != AUTO:
        path = hyp_file_for(cfg.optimizer, files)
        hyp = load_hyp(path, hyp_overrides(cfg.label_smoothing))
        line = f"hyp auto -> {_describe(cfg.optimizer, hyp, path)}: the recipe file for --optimizer {cfg.optimizer}"
        return dataclasses.replace(cfg, hyp=hyp, hyp_path=path), line
    if num_train_images is None:
        raise ValueError("resolve_recipe: --optimizer auto and --hyp auto need the number of train images")
    recipe, long_steps = auto_recipe(num_train_images, cfg.batch_size, cfg.epochs)
    recipe = Recipe(recipe.optimizer, files.long if recipe == LONG_RUN else files.short)
    hyp = load_hyp(recipe.hyp_path, hyp_overrides(cfg.label_smoothing))
    resolved = dataclasses.replace(cfg, optimizer=recipe.optimizer, hyp=hyp, hyp_path=recipe.hyp_path)
    sizes = f"{num_train_images:,} images / batch {cfg.batch_size} x {cfg.epochs} epochs"
    if recipe.optimizer == LONG_RUN.optimizer:
        why = f"{long_steps:,} optimizer steps at nominal batch {LONG_RUN_NBS} ({sizes}) >= {AUTO_SGD_MIN_STEPS:,}"
    else:
        own = optimizer_steps(num_train_images, cfg.batch_size, hyp.nbs, cfg.epochs)
        why = (
            f"{own:,} optimizer steps ({sizes}); SGD at nominal batch {LONG_RUN_NBS} would get {long_steps:,} "
            f"< {AUTO_SGD_MIN_STEPS:,}"
        )
    chosen = _describe(recipe.optimizer, hyp, recipe.hyp_path)
    return resolved, f"optimizer auto -> {chosen}: {why} (AUTO_SGD_MIN_STEPS)"


def restored_recipe_line(cfg: TrainConfig) -> str:
    """The start-up line of a resumed run, whose optimizer and hyp come from its checkpoint unchanged."""
    return f"recipe: {_describe(cfg.optimizer, cfg.hyp, cfg.hyp_path)}: the run's own, restored by --resume"


def _describe(optimizer: str, hyp: Hyp | None, path: Path | None) -> str:
    """'AdamW lr0 0.001 nbs 16 (data/hyps/hyp.quickstart.yaml)': what a recipe line names."""
    values = f" lr0 {hyp.lr0:g} nbs {hyp.nbs:g}" if hyp is not None else ""
    return f"{optimizer}{values}" + (f" ({_short(path)})" if path is not None else "")


def _short(path: Path) -> str:
    """`path` relative to the repository when inside it (the start-up line stays short), else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
