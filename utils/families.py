"""The Family record: what inference needs to know of a model family (spec, build, outputs, detection selection).

What only training needs of a family (its losses, AutoAnchor, hyp keys, recipe files) is the
FamilyTraining record in utils/train/records.py, keyed by the same name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from models import anchor_free, yolo
from utils.boxes import non_max_suppression, top_detections
from utils.config import DEFAULT_MODEL
from utils.distributed import unwrap_model
from utils.errors import ConfigError


class Spec(Protocol):
    """What every family's model spec offers the shared code (a frozen dataclass in practice)."""

    family: str
    num_classes: int
    num_masks: int

    @property
    def max_stride(self) -> int: ...  # the coarsest level's stride: input sides are multiples of it

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Family:
    """The seam between the shared code and a model family, as inference sees it; YOLOv5 (YOLOV5) is one member.

    The training, evaluation and prediction loops and the data pipeline never test which family
    they run; what differs for inference is here (for training, utils/train/records.py):
    - spec_type: the frozen spec dataclass (`from_dict`, `to_dict`, a `family` class attribute)
    - claims_cfg(cfg) -> whether a `--cfg` value (a size name or a model YAML) names this family's model;
      cfg_names: its size names as the unknown --cfg error lists them (each optionally -seg);
      detect_only_names: those that have no -seg variant (YOLOv5's P6 models), '' when none
    - spec_from_cfg(cfg, num_classes) -> spec; segmentation_spec(spec) -> the spec's -seg variant
    - build_model(spec) -> nn.Module with `.spec`, `.head`, `.stride`, `layers()`, `fuse()`
    - channels_first: decoded rows are (B, N, no) in every family ([cx, cy, w, h (input pixels), YOLOv5's
      objectness, class scores (probabilities), mask coefficients]); export writes `output0` as (B, no, N),
      the layout Ultralytics' consumers read, instead of YOLOv5's (B, N, no)
    - objectness: whether decoded rows hold YOLOv5's objectness column between the box and the class scores
    - detection_selector(end_to_end) gives the function that turns the model's decoded rows into detections
      (`non_max_suppression`'s arguments and result): NMS, or the top scores of rows from an end-to-end
      head (`decodes_end_to_end(model)`, or an exported file's metadata); force_nms(model) (--nms) makes an
      end-to-end model use NMS
    """

    name: str
    spec_type: type
    claims_cfg: Callable[[str], bool]
    cfg_names: str  # the size names it resolves, for the error that lists every family's
    spec_from_cfg: Callable[[str, int], Any]
    segmentation_spec: Callable[[Any], Any]
    build_model: Callable[[Any], nn.Module]
    channels_first: bool
    objectness: bool
    detection_selector: Callable[[bool], Callable[..., list[torch.Tensor]]]
    force_nms: Callable[[nn.Module], None]
    detect_only_names: str = ""

    def spec_from_dict(self, data: Mapping[str, Any]) -> Any:
        """Rebuild this family's spec from `spec.to_dict()` output (a checkpoint's `model_spec`)."""
        return self.spec_type.from_dict(dict(data))


YOLOV5 = Family(
    name="yolov5",
    spec_type=yolo.ModelSpec,
    claims_cfg=yolo.claims_cfg,  # checked last: it takes any existing YAML the others leave (YOLOv5 model YAMLs)
    cfg_names=yolo.CFG_NAMES,
    detect_only_names=yolo.CFG_NAMES_P6,
    spec_from_cfg=yolo.spec_from_cfg,
    segmentation_spec=yolo.segmentation_spec,
    build_model=yolo.build_model,
    channels_first=False,
    objectness=True,
    detection_selector=lambda end_to_end: non_max_suppression,
    force_nms=lambda model: None,  # always NMS
)


def decodes_end_to_end(model: nn.Module) -> bool:
    """Whether `model` decodes an end-to-end (one-to-one) head: its rows need no NMS, only the top scores.

    False for YOLOv5 models, for other anchor-free models and for an end-to-end one given --nms.
    """
    head = unwrap_model(model).head
    return bool(getattr(head, "end_to_end", False) and getattr(head, "use_one_to_one", False))


def dense_selector(end_to_end: bool) -> Callable[..., list[torch.Tensor]]:
    """NMS without objectness, or, for rows of an end-to-end model's one-to-one branch, the top scores."""
    if end_to_end:
        return top_detections
    return functools.partial(non_max_suppression, objectness=False)


def use_one_to_many(model: nn.Module) -> None:
    """--nms: an end-to-end model decodes its one-to-many head (for NMS) instead of its one-to-one head."""
    unwrap_model(model).head.use_one_to_one = False


ANCHOR_FREE = Family(
    name="anchor_free",
    spec_type=anchor_free.AnchorFreeSpec,
    claims_cfg=anchor_free.claims_cfg,
    cfg_names=anchor_free.CFG_NAMES,
    spec_from_cfg=anchor_free.spec_from_cfg,
    segmentation_spec=anchor_free.segmentation_spec,
    build_model=anchor_free.build_model,
    channels_first=True,
    objectness=False,
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
    target = unwrap_model(model_or_spec)
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
    default: models/ cannot name the other families (or the default), so the list is built here. A YAML
    path with a folder that does not exist is not read as the size name in its file name (as
    `yolov5s.yaml` alone is): that would train the stock model in place of the user's file.
    """
    path = Path(cfg)
    if path.suffix.lower() in (".yaml", ".yml") and len(path.parts) > 1 and not path.is_file():
        raise ConfigError(f"--cfg {cfg}: file not found")
    family = next((family for family in FAMILIES.values() if family.claims_cfg(cfg)), None)
    if family is None:
        names = "; ".join(family.cfg_names for family in FAMILIES.values())
        detect_only = "".join(
            f"; {family.detect_only_names}" for family in FAMILIES.values() if family.detect_only_names
        )
        listed = f"{names}, each optionally -seg{detect_only}; default {DEFAULT_MODEL}"
        raise ConfigError(f"--cfg {cfg}: not a YAML file and not a model name ({listed})")
    return family.spec_from_cfg(cfg, num_classes)


def build_model(spec: Any) -> nn.Module:
    """Build the model `spec` describes with its family's builder (CPU, train mode, biases initialised)."""
    return family_of(spec).build_model(spec)


def segmentation_spec(spec: Any) -> Any:
    """The -seg variant of a detection spec, as its family defines it (YOLOv5: 32 masks, 256 scaled protos)."""
    return family_of(spec).segmentation_spec(spec)
