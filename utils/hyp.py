"""Training hyperparameters: the Hyp dataclass and hyp YAML loading (ours and YOLOv5's files alike)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from utils.errors import ConfigError, read_yaml_mapping

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hyp:
    """Training hyperparameters, read from a hyp YAML (every key required but YOLOV5_HYP_DEFAULTS; unknown rejected)."""

    lr0: float
    lrf: float
    momentum: float
    weight_decay: float
    warmup_epochs: float
    warmup_momentum: float
    warmup_bias_lr: float
    box: float
    cls: float
    cls_pw: float
    iou_t: float
    fl_gamma: float
    label_smoothing: float
    hsv_h: float
    hsv_s: float
    hsv_v: float
    degrees: float
    translate: float
    scale: float
    shear: float
    perspective: float
    flipud: float
    fliplr: float
    mosaic: float
    mixup: float
    copy_paste: float
    nbs: float  # nominal batch: gradients are accumulated up to it, weight decay scales with it
    # Loss keys of one model family only (utils/train/records.py: FamilyTraining.hyp_keys says which its
    # losses read; a run checks them once its model is known). None: not in the file.
    obj: float | None = None  # YOLOv5: objectness gain
    obj_pw: float | None = None  # YOLOv5: objectness BCE positive weight
    anchor_t: float | None = None  # YOLOv5: anchor-to-label size ratio limit for matching (and AutoAnchor)
    dfl: float | None = None  # anchor-free: distribution focal loss gain

    def to_dict(self) -> dict[str, float]:
        """Return the hyperparameters as a plain dict (for YAML and checkpoints); keys the file lacked are left out."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    def missing(self, keys: tuple[str, ...]) -> list[str]:
        """Return those of `keys` this hyp has no value for, in the given order."""
        return [key for key in keys if getattr(self, key) is None]


# Keys only some model families' losses read: the Hyp fields that default to None. A file may leave them out.
FAMILY_HYP_KEYS = tuple(f.name for f in fields(Hyp) if f.default is None)


# Keys YOLOv5's hyp files leave out, with the values YOLOv5's train.py uses for them: it hard-codes the
# nominal batch 64, takes label smoothing from a flag (default 0.0), and older files lack fl_gamma.
YOLOV5_HYP_DEFAULTS = {"nbs": 64.0, "label_smoothing": 0.0, "fl_gamma": 0.0}


# Where each hyperparameter means something: probabilities, fractions and momenta in [0, 1]; rates, the nominal batch
# and the anchor ratio above 0; every other value (gains, degrees, epochs of warmup) 0 or more. All finite.
UNIT_KEYS = frozenset({
    "momentum", "warmup_momentum", "iou_t", "label_smoothing", "hsv_h", "hsv_s", "hsv_v", "translate", "flipud",
    "fliplr", "mosaic", "mixup", "copy_paste",
})  # fmt: skip
POSITIVE_KEYS = frozenset({"lr0", "lrf", "nbs", "anchor_t"})


def value_problem(key: str, value: float) -> str:
    """Why `value` cannot be hyperparameter `key` ('' when it can): not finite, or outside the key's range."""
    if not math.isfinite(value):
        return f"{value} is not a finite number"
    if key in UNIT_KEYS and not 0 <= value <= 1:
        return f"{value:g} is outside [0, 1]"
    if key in POSITIVE_KEYS and value <= 0:
        return f"{value:g} must be above 0"
    return f"{value:g} must be 0 or more" if value < 0 else ""


def hyp_overrides(label_smoothing: float | None) -> dict[str, float]:
    """The hyp values command-line flags replace: --label-smoothing when given (None: the file's value)."""
    return {} if label_smoothing is None else {"label_smoothing": label_smoothing}


def load_hyp(path: Path, overrides: dict[str, float] | None = None) -> Hyp:
    """Load a hyp YAML into a Hyp; unknown, missing or non-numeric keys are one-line errors naming the file.

    The loss keys of one family (FAMILY_HYP_KEYS) may be absent; the run checks the ones its model's
    family needs once the model is known (utils/train/records.py: FamilyTraining.check_hyp).
    A YOLOv5 hyp file loads as it is: a missing `nbs`, `label_smoothing` or `fl_gamma` takes
    YOLOV5_HYP_DEFAULTS, and YOLOv5's `anchors` key (anchors per level for AutoAnchor) is ignored,
    because anchors come from `--cfg` (or `--weights`) and are refitted only when they fit the labels poorly.
    One warning line names the file and what was filled in or ignored. `overrides` (flags such as
    --label-smoothing) replace file values.
    """
    raw = read_yaml_mapping(path)
    overrides = overrides or {}
    names = {f.name for f in fields(Hyp)}
    unknown = sorted(set(raw) - names - {"anchors"})
    if unknown:
        raise ConfigError(f"{path}: unknown hyperparameter '{unknown[0]}' (known: {', '.join(sorted(names))})")
    missing = sorted(names - set(raw) - set(YOLOV5_HYP_DEFAULTS) - set(FAMILY_HYP_KEYS))
    if missing:
        raise ConfigError(f"{path}: missing hyperparameter '{missing[0]}'")
    defaults = {key: value for key, value in YOLOV5_HYP_DEFAULTS.items() if key not in raw}
    values: dict[str, float] = {}
    for key, value in {**raw, **defaults, **overrides}.items():
        number = _number(value)
        if number is None:
            raise ConfigError(f"{path}: hyperparameter '{key}' must be a number, got {value!r}")
        if key != "anchors" and (problem := value_problem(key, number)):
            where = "--label-smoothing" if key in overrides else f"{path}: hyperparameter '{key}'"
            raise ConfigError(f"{where}: {problem}")
        values[key] = number
    anchors = values.pop("anchors", None)
    _log_yolov5_hyp(path, {key: value for key, value in defaults.items() if key not in overrides}, anchors)
    return Hyp(**values)


def _number(value: Any) -> float | None:
    """A hyp value as a float: a YAML number, or text float() reads (YAML 1.1 reads 1e-3, without a dot, as text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def is_yolov5_hyp_file(path: Path) -> bool:
    """Whether the hyp file at `path` is one of YOLOv5's: it has no `nbs`, which YOLOv5's train.py hard-codes.

    Such a file was tuned under YOLOv5's default optimizer, SGD, whatever its lr0 (hyp.Objects365.yaml's
    0.00258 is an SGD rate there); ours always name their nominal batch.
    """
    return "nbs" not in read_yaml_mapping(path)


def _log_yolov5_hyp(path: Path, defaults: dict[str, float], anchors: float | None) -> None:
    """Say in one line which of YOLOv5's train.py values filled `path`'s missing keys and that `anchors` is ignored."""
    notes = []
    if defaults:
        filled = ", ".join(f"{key}={value:g}" for key, value in defaults.items())
        notes.append(f"missing keys take YOLOv5's train.py values {filled}")
    if anchors is not None:
        notes.append(
            f"'anchors: {anchors:g}' is ignored (anchors come from --cfg or --weights; from scratch, AutoAnchor "
            "refits them only if they fit the labels poorly)"
        )
    if notes:
        # A warning, not info: this runs before logging is set up, where only warnings reach stderr.
        LOGGER.warning("%s: YOLOv5 hyp file: %s", path, "; ".join(notes))
