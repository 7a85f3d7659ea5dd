"""The Family record: what differs between model families (spec, build, loss, run preparation, hyp keys, outputs)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from models import anchor_free, yolo
from models.anchors import check_anchors
from utils.boxes import non_max_suppression, top_detections
from utils.config import DEFAULT_MODEL, ROOT
from utils.distributed import DistContext, broadcast_object, run_on_main
from utils.errors import ConfigError
from utils.hyp import Hyp
from utils.train.dense_loss import DenseLoss
from utils.train.loss import DetectionLoss
from utils.train.recipe import YOLOV5_RECIPES, RecipeFiles

LOGGER = logging.getLogger(__name__)


class Spec(Protocol):
    """What every family's model spec offers the shared code (a frozen dataclass in practice)."""

    family: str
    num_classes: int
    num_masks: int

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class OutputLayout:
    """How a family's eval forward lays out each decoded prediction, and how export writes it.

    Decoded rows are (B, N, no): [cx, cy, w, h (input pixels), objectness when `objectness`, class
    scores (probabilities), mask coefficients]. `channels_first` exports `output0` as (B, no, N), the
    layout Ultralytics' consumers read, instead of YOLOv5's (B, N, no).
    """

    objectness: bool
    channels_first: bool


@dataclass(frozen=True)
class Family:
    """The seam between the shared engine and a model family; YOLOv5 (YOLOV5) is one member.

    The training, evaluation and prediction loops and the data pipeline never test which family
    they run; what differs is here:
    - spec_type: the frozen spec dataclass (`from_dict`, `to_dict`, a `family` class attribute)
    - claims_cfg(cfg) -> whether a `--cfg` value (a size name or a model YAML) names this family's model;
      cfg_names: its size names as the unknown --cfg error lists them
    - spec_from_cfg(cfg, num_classes) -> spec; segmentation_spec(spec) -> the spec's -seg variant
    - build_model(spec) -> nn.Module with `.spec`, `.head`, `.stride`, `layers()`, `fuse()`
    - build_loss(model, hyp, imgsz) -> the detection loss (segmentation's loss builds on it, segment/loss.py)
    - prepare_run(model, train_set, hyp, imgsz, ctx): per-run preparation before DDP and EMA (every rank)
    - hyp_keys: the family-only Hyp keys its loss reads (utils/hyp.py FAMILY_HYP_KEYS)
    - recipe_files: the short-run (AdamW) and long-run (SGD) hyp files `--optimizer auto` chooses from
    - output: the decoded/exported layout; detection_selector(model) gives the function that turns the
      model's decoded rows into detections (`non_max_suppression`'s arguments and result): NMS, or the
      top scores of an end-to-end head; force_nms(model) (--nms) makes an end-to-end model use NMS
    """

    name: str
    spec_type: type
    claims_cfg: Callable[[str], bool]
    cfg_names: str  # the size names it resolves, for the error that lists every family's
    spec_from_cfg: Callable[[str, int], Any]
    segmentation_spec: Callable[[Any], Any]
    build_model: Callable[[Any], nn.Module]
    build_loss: Callable[[nn.Module, Hyp, int], Any]
    prepare_run: Callable[[nn.Module, Any, Hyp, int, DistContext], None]
    hyp_keys: tuple[str, ...]
    recipe_files: RecipeFiles
    output: OutputLayout
    detection_selector: Callable[[nn.Module], Callable[..., list[torch.Tensor]]]
    force_nms: Callable[[nn.Module], None]

    def spec_from_dict(self, data: Mapping[str, Any]) -> Any:
        """Rebuild this family's spec from `spec.to_dict()` output (a checkpoint's `model_spec`)."""
        return self.spec_type.from_dict(dict(data))

    def check_hyp(self, hyp: Hyp, source: Path | str | None) -> None:
        """Raise a one-line ConfigError naming the hyp file when it lacks a key this family's loss reads."""
        missing = hyp.missing(self.hyp_keys)
        if missing:
            where = source if source is not None else "the hyp"
            raise ConfigError(
                f"{where}: missing hyperparameter '{missing[0]}', which {self.name} models need "
                f"({', '.join(self.hyp_keys)})"
            )


def run_anchor_check(model: nn.Module, train_set: Any, hyp: Hyp, imgsz: int, ctx: DistContext) -> None:
    """AutoAnchor: check (and if poor, refit) the anchors on rank 0 and give every rank rank 0's anchors.

    `train_set` is the LoadImagesAndLabels the run trains on; every rank must call this.
    """
    head = getattr(model, "module", model).head
    labels_wh = train_set.label_wh_at(imgsz)
    # run_on_main: a failure on rank 0 reaches every rank instead of leaving them in the broadcast below.
    check = lambda: check_anchors(labels_wh, model, threshold=hyp.anchor_t, imgsz=imgsz)  # noqa: E731
    run_on_main(check, ctx, "AutoAnchor")
    anchors = broadcast_object(head.anchors.detach().cpu(), ctx)
    head.anchors.copy_(anchors.to(head.anchors.device))


YOLOV5 = Family(
    name="yolov5",
    spec_type=yolo.ModelSpec,
    claims_cfg=yolo.claims_cfg,  # checked last: it takes any existing YAML the others leave (YOLOv5 model YAMLs)
    cfg_names=yolo.CFG_NAMES,
    spec_from_cfg=yolo.spec_from_cfg,
    segmentation_spec=yolo.segmentation_spec,
    build_model=yolo.build_model,
    build_loss=DetectionLoss.from_hyp,
    prepare_run=run_anchor_check,
    hyp_keys=("obj", "obj_pw", "anchor_t"),
    recipe_files=YOLOV5_RECIPES,
    output=OutputLayout(objectness=True, channels_first=False),
    detection_selector=lambda model: non_max_suppression,
    force_nms=lambda model: None,  # always NMS
)


def prepare_nothing(model: nn.Module, train_set: Any, hyp: Hyp, imgsz: int, ctx: DistContext) -> None:
    """Anchor-free models need no per-run preparation: points come from the strides, not from the labels."""


def dense_selector(model: nn.Module) -> Callable[..., list[torch.Tensor]]:
    """NMS without objectness, or, for an end-to-end model decoding its one-to-one branch, the top scores."""
    head = getattr(model, "module", model).head
    if head.end_to_end and head.use_one_to_one:
        return top_detections
    return functools.partial(non_max_suppression, objectness=False)


def use_one_to_many(model: nn.Module) -> None:
    """--nms: an end-to-end model decodes its one-to-many head (for NMS) instead of its one-to-one head."""
    getattr(model, "module", model).head.use_one_to_one = False


ANCHOR_FREE = Family(
    name="anchor_free",
    spec_type=anchor_free.AnchorFreeSpec,
    claims_cfg=anchor_free.claims_cfg,
    cfg_names=anchor_free.CFG_NAMES,
    spec_from_cfg=anchor_free.spec_from_cfg,
    segmentation_spec=anchor_free.segmentation_spec,
    build_model=anchor_free.build_model,
    build_loss=DenseLoss.from_hyp,
    prepare_run=prepare_nothing,
    hyp_keys=("dfl",),
    recipe_files=RecipeFiles(
        ROOT / "data/hyps/hyp.anchor-free.quickstart.yaml", ROOT / "data/hyps/hyp.anchor-free.scratch.yaml"
    ),
    output=OutputLayout(objectness=False, channels_first=True),
    detection_selector=dense_selector,
    force_nms=use_one_to_many,
)

# In the order `--cfg` values are offered to them; a checkpoint without `model_family` is YOLOv5's.
FAMILIES: dict[str, Family] = {family.name: family for family in (ANCHOR_FREE, YOLOV5)}
DEFAULT_FAMILY = YOLOV5.name


def family_named(name: str, source: Path | str = "checkpoint") -> Family:
    """The Family called `name`; an unknown name is a one-line ConfigError naming `source`."""
    if name not in FAMILIES:
        raise ConfigError(f"{source}: unknown model family '{name}' (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of(model_or_spec: Any) -> Family:
    """The Family of a spec, or of a model (DDP-wrapped or not) through its `.spec`; none recorded = YOLOv5."""
    target = getattr(model_or_spec, "module", model_or_spec)
    spec = getattr(target, "spec", target)
    return family_named(getattr(spec, "family", DEFAULT_FAMILY))


def checkpoint_family(checkpoint: Mapping[str, Any], source: Path | str = "checkpoint") -> Family:
    """The Family a checkpoint records (`model_family`); files written before families existed are YOLOv5's."""
    return family_named(checkpoint.get("model_family", DEFAULT_FAMILY), source)


def spec_from_checkpoint(checkpoint: Mapping[str, Any], source: Path | str = "checkpoint") -> Any:
    """Rebuild the model spec a checkpoint stores, with the family it records."""
    return checkpoint_family(checkpoint, source).spec_from_dict(checkpoint["model_spec"])


def spec_from_cfg(cfg: str, num_classes: int) -> Any:
    """Resolve `--cfg` (a size name or a model YAML) with the first family that claims it.

    A value no family claims is a one-line ConfigError listing every family's size names and the
    default: models/ cannot name the other families (or the default), so the list is built here.
    """
    family = next((family for family in FAMILIES.values() if family.claims_cfg(cfg)), None)
    if family is None:
        names = "; ".join(family.cfg_names for family in FAMILIES.values())
        listed = f"{names}, each optionally -seg; default {DEFAULT_MODEL}"
        raise ConfigError(f"--cfg {cfg}: not a YAML file and not a model name ({listed})")
    return family.spec_from_cfg(cfg, num_classes)


def build_model(spec: Any) -> nn.Module:
    """Build the model `spec` describes with its family's builder (CPU, train mode, biases initialised)."""
    return family_of(spec).build_model(spec)


def segmentation_spec(spec: Any) -> Any:
    """The -seg variant of a detection spec, as its family defines it (YOLOv5: 32 masks, 256 scaled protos)."""
    return family_of(spec).segmentation_spec(spec)
