"""What only training needs of each model family and task: losses, AutoAnchor, required hyp keys, recipe files.

The inference side of the same seams is utils/families.py (Family) and utils/tasks.py (Task);
nothing there imports this module, so detect, export, val and torch.hub never load training
code. A family is known here by its `Family.name`; a task's training record wraps its `Task`.
Adding a model family means one Family record, one FamilyTraining record here, and its loss
class in each task's `losses` (DETECT_TRAINING below, SEGMENT_TRAINING in segment/training.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from models.anchors import check_anchors
from utils.config import ROOT
from utils.distributed import DistContext, broadcast_object, run_on_main, unwrap_model
from utils.errors import ConfigError
from utils.families import ANCHOR_FREE, FAMILIES, YOLOV5, family_of
from utils.hyp import FAMILY_HYP_KEYS, Hyp
from utils.tasks import DETECT, Task
from utils.train.config import TrainConfig
from utils.train.dense_loss import DenseLoss
from utils.train.loss import DetectionLoss
from utils.train.recipe import YOLOV5_RECIPES, RecipeFiles

LOGGER = logging.getLogger(__name__)

PrepareRun = Callable[[nn.Module, Any, Hyp, int, DistContext, bool], None]


@dataclass(frozen=True)
class FamilyTraining:
    """The training side of a model family (its `Family` has the same `name`).

    - prepare_run(model, train_set, hyp, imgsz, ctx, autoanchor): per-run preparation from scratch, before
      DDP and the EMA copy (every rank calls it): YOLOv5's AutoAnchor (unless `autoanchor` is False:
      --noautoanchor), nothing for anchor-free models
    - hyp_keys: the family-only Hyp keys its losses read (Hyp fields that default to None)
    - recipe_files: the short-run (AdamW) and long-run (SGD) hyp files `--optimizer auto` chooses from
    - search_space: tune.py's default search space over this family's hyp (data/hyps/space.*.yaml)
    """

    name: str
    prepare_run: PrepareRun
    hyp_keys: tuple[str, ...]
    recipe_files: RecipeFiles
    search_space: Path

    def check_hyp(self, hyp: Hyp, source: Path | str | None) -> None:
        """Raise a one-line ConfigError naming the hyp file when it lacks a key this family's losses read."""
        missing = hyp.missing(self.hyp_keys)
        if missing:
            where = source if source is not None else "the hyp"
            recipes = (self.recipe_files.long, self.recipe_files.short)
            files = " or ".join(str(path.relative_to(ROOT)) for path in recipes)
            raise ConfigError(
                f"{where}: missing hyperparameter '{missing[0]}', which {self.name} models need "
                f"({', '.join(self.hyp_keys)}); a hyp file made for other models (YOLOv5's fit yolov5* models) "
                f"does not fit: use --hyp auto, or start from {files}"
            )


def run_anchor_check(
    model: nn.Module, train_set: Any, hyp: Hyp, imgsz: int, ctx: DistContext, autoanchor: bool = True
) -> None:
    """AutoAnchor: check (and if poor, refit) the anchors on rank 0 and give every rank rank 0's anchors.

    `train_set` is the LoadImagesAndLabels the run trains on; every rank must call this. Without
    `autoanchor` (--noautoanchor) the model keeps the anchors of its --cfg, as in YOLOv5.
    """
    if not autoanchor:
        LOGGER.info("--noautoanchor: the anchors of --cfg are kept, unchecked")
        return
    head = unwrap_model(model).head
    labels_wh = train_set.label_wh_at(imgsz)
    # run_on_main: a failure on rank 0 reaches every rank instead of leaving them in the broadcast below.
    check = lambda: check_anchors(labels_wh, model, threshold=hyp.anchor_t, imgsz=imgsz)  # noqa: E731
    run_on_main(check, ctx, "AutoAnchor")
    anchors = broadcast_object(head.anchors.detach().cpu(), ctx)
    head.anchors.copy_(anchors.to(head.anchors.device))


def prepare_nothing(
    model: nn.Module, train_set: Any, hyp: Hyp, imgsz: int, ctx: DistContext, autoanchor: bool = True
) -> None:
    """Anchor-free models need no per-run preparation: points come from the strides, not from the labels."""


YOLOV5_TRAINING = FamilyTraining(
    name=YOLOV5.name,
    prepare_run=run_anchor_check,
    hyp_keys=("obj", "obj_pw", "anchor_t"),
    recipe_files=YOLOV5_RECIPES,
    search_space=ROOT / "data/hyps/space.yolov5.yaml",
)
ANCHOR_FREE_TRAINING = FamilyTraining(
    name=ANCHOR_FREE.name,
    prepare_run=prepare_nothing,
    hyp_keys=("dfl",),
    recipe_files=RecipeFiles(
        ROOT / "data/hyps/hyp.anchor-free.quickstart.yaml", ROOT / "data/hyps/hyp.anchor-free.scratch.yaml"
    ),
    search_space=ROOT / "data/hyps/space.anchor-free.yaml",
)
FAMILY_TRAINING: dict[str, FamilyTraining] = {record.name: record for record in (ANCHOR_FREE_TRAINING, YOLOV5_TRAINING)}
assert FAMILY_TRAINING.keys() == FAMILIES.keys(), "every model family needs its training record"
assert all(set(record.hyp_keys) <= set(FAMILY_HYP_KEYS) for record in FAMILY_TRAINING.values()), "Hyp lacks a key"


def family_training(model_or_spec: Any) -> FamilyTraining:
    """The FamilyTraining of a spec or a model (DDP-wrapped or not), by its Family's name."""
    return FAMILY_TRAINING[family_of(model_or_spec).name]


def no_loss_options(cfg: TrainConfig) -> dict[str, Any]:
    """Detection's losses take nothing beyond the hyp and the image size."""
    return {}


@dataclass(frozen=True)
class TrainingTask:
    """A task as the engine trains it: its `Task` (inference, evaluation) plus its loss for each model family.

    - losses: Family name -> loss class with `from_hyp(model, hyp, imgsz, **options)`; the loss is called
      as (preds, *, targets, [masks,] reduce_counts) -> (loss, items) and its `item_names` name the items
      (results.csv columns)
    - loss_options(cfg) -> the task's extra constructor arguments (segmentation's `overlap`)
    """

    task: Task
    losses: Mapping[str, type]
    loss_options: Callable[[TrainConfig], dict[str, Any]] = field(default=no_loss_options)

    def __post_init__(self) -> None:
        missing = sorted(set(FAMILIES) - set(self.losses))
        assert not missing, f"{self.task.name}: no loss for model families {missing}"

    @property
    def name(self) -> str:
        """The task's name (detect, segment): what checkpoints record."""
        return self.task.name

    def build_loss(self, model: nn.Module, cfg: TrainConfig) -> Any:
        """The loss of the model's family for this task, gains from `cfg.hyp` scaled for the head and `cfg.imgsz`."""
        loss_type = self.losses[family_of(model).name]
        options = {"static_shapes": cfg.static_loss_shapes, **self.loss_options(cfg)}
        return loss_type.from_hyp(model, cfg.hyp, cfg.imgsz, **options)


DETECT_TRAINING = TrainingTask(
    task=DETECT,
    losses={YOLOV5.name: DetectionLoss, ANCHOR_FREE.name: DenseLoss},
)
