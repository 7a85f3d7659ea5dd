"""Ultralytics model YAMLs (yolov8 / yolo11 / yolo26, -seg, with `scales:`): check the layer lists, pick the scale."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import ConfigError, read_yaml_mapping

LOGGER = logging.getLogger(__name__)

SUPPORTED = "supported: the standard yolov8, yolo11 and yolo26 layouts (detect and -seg)"
YAML_KEYS = ("nc", "scales", "scale", "backbone", "head", "end2end", "reg_max")
# Modules only these layouts use: a YAML naming one (or having a `scales:` table) is an Ultralytics one.
MARKER_MODULES = frozenset({"C2f", "C3k2", "C2PSA", "Segment26"})
UP = (-1, 1, "nn.Upsample", (None, 2, "nearest"))
_V8_ROWS = (
    (-1, 1, "Conv", (64, 3, 2)), (-1, 1, "Conv", (128, 3, 2)), (-1, 3, "C2f", (128, True)),
    (-1, 1, "Conv", (256, 3, 2)), (-1, 6, "C2f", (256, True)), (-1, 1, "Conv", (512, 3, 2)),
    (-1, 6, "C2f", (512, True)), (-1, 1, "Conv", (1024, 3, 2)), (-1, 3, "C2f", (1024, True)),
    (-1, 1, "SPPF", (1024, 5)),  # 9: end of the backbone
    UP, ((-1, 6), 1, "Concat", (1,)), (-1, 3, "C2f", (512,)),
    UP, ((-1, 4), 1, "Concat", (1,)), (-1, 3, "C2f", (256,)),  # 15 (P3/8)
    (-1, 1, "Conv", (256, 3, 2)), ((-1, 12), 1, "Concat", (1,)), (-1, 3, "C2f", (512,)),  # 18 (P4/16)
    (-1, 1, "Conv", (512, 3, 2)), ((-1, 9), 1, "Concat", (1,)), (-1, 3, "C2f", (1024,)),  # 21 (P5/32)
)  # fmt: skip


def _v11_rows(sppf_args: tuple, neck_c3k: bool, last: tuple) -> tuple[tuple[Any, ...], ...]:
    """YOLO11 / YOLO26 rows: they differ in the SPPF arguments, the neck's C3k flag and the last neck stage."""
    return (
        (-1, 1, "Conv", (64, 3, 2)), (-1, 1, "Conv", (128, 3, 2)), (-1, 2, "C3k2", (256, False, 0.25)),
        (-1, 1, "Conv", (256, 3, 2)), (-1, 2, "C3k2", (512, False, 0.25)), (-1, 1, "Conv", (512, 3, 2)),
        (-1, 2, "C3k2", (512, True)), (-1, 1, "Conv", (1024, 3, 2)), (-1, 2, "C3k2", (1024, True)),
        (-1, 1, "SPPF", sppf_args), (-1, 2, "C2PSA", (1024,)),  # 10: end of the backbone
        UP, ((-1, 6), 1, "Concat", (1,)), (-1, 2, "C3k2", (512, neck_c3k)),
        UP, ((-1, 4), 1, "Concat", (1,)), (-1, 2, "C3k2", (256, neck_c3k)),  # 16 (P3/8)
        (-1, 1, "Conv", (256, 3, 2)), ((-1, 13), 1, "Concat", (1,)), (-1, 2, "C3k2", (512, neck_c3k)),  # 19
        (-1, 1, "Conv", (512, 3, 2)), ((-1, 10), 1, "Concat", (1,)), last,  # 22 (P5/32)
    )  # fmt: skip


STANDARD_ROWS: dict[str, tuple[tuple[Any, ...], ...]] = {
    "yolov8": _V8_ROWS,
    "yolo11": _v11_rows((1024, 5), False, (-1, 2, "C3k2", (1024, True))),
    "yolo26": _v11_rows((1024, 5, 3, True), True, (-1, 1, "C3k2", (1024, True, 0.5, True))),
}
HEAD_FROM = {"yolov8": (15, 18, 21), "yolo11": (16, 19, 22), "yolo26": (16, 19, 22)}
SEG_HEADS = {"yolov8": "Segment", "yolo11": "Segment", "yolo26": "Segment26"}
SCALE_IN_NAME = re.compile(r"yolo(?:v8|11|26)([nsmlx])(?![a-z])")  # anywhere in the name: yolo11m-custom.yaml


def _layer_rows(raw: dict[str, Any]) -> list[Any]:
    backbone, head = raw.get("backbone"), raw.get("head")
    return [*backbone, *head] if isinstance(backbone, list) and isinstance(head, list) else []


def is_ultralytics_yaml(path: Path) -> bool:
    """Whether a model YAML is Ultralytics' anchor-free kind: a `scales:` table or a C2f/C3k2/C2PSA/Segment26 layer."""
    try:
        raw = read_yaml_mapping(path)
    except ConfigError:
        return False  # unreadable: left to the YOLOv5 resolver, whose error names the file
    rows = [row for row in _layer_rows(raw) if isinstance(row, list) and len(row) == 4]
    modules = {row[2] for row in rows if isinstance(row[2], str)}  # a list there is refused by the layer check
    return "scales" in raw or bool(modules & MARKER_MODULES)


@dataclass(frozen=True)
class UltralyticsModelYaml:
    """What a checked Ultralytics model YAML says: layout, the chosen scale row, head options, mask sizes.

    `base_protos` is the prototype count before width scaling (256 in the published -seg files); 0 with
    `num_masks` for a detection model. models/anchor_free.py turns it into an AnchorFreeSpec.
    """

    layout: str
    depth_multiple: float
    width_multiple: float
    max_channels: int
    scale: str
    reg_max: int
    end_to_end: bool
    num_masks: int
    base_protos: int


def read_ultralytics_yaml(path: Path, num_classes: int) -> UltralyticsModelYaml:
    """Read a yolov8/yolo11/yolo26(-seg) model YAML; the scale letter comes from a `yolo11n.yaml`-style file name,
    else the file's `scale`, else its first `scales` row (as Ultralytics does).

    The layer lists must equal the standard layout row by row (we build that network in Python, not
    from the lists); the first difference is a one-line ConfigError naming the file and the layer.
    `num_classes` (from the dataset) wins over the file's `nc`.
    """
    raw = read_yaml_mapping(path)
    unknown = [key for key in raw if key not in YAML_KEYS]
    if unknown:
        raise ConfigError(f"{path}: unknown key '{unknown[0]}' (allowed: {', '.join(YAML_KEYS)})")
    rows = _layer_rows(raw)
    if not rows or any(not isinstance(row, list) or len(row) != 4 or not isinstance(row[3], list) for row in rows):
        raise ConfigError(f"{path}: 'backbone' and 'head' must be lists of [from, repeats, module, args] layers")
    layout = _layout_of(rows)
    _check_rows(rows, layout, path)
    num_masks, base_protos = _head_args(rows[-1], layout, path) or (0, 0)
    depth, width, max_channels, scale = _scale_row(raw, path)
    if "nc" in raw and raw["nc"] != num_classes:
        LOGGER.info("%s: overriding nc=%s with the dataset's %d classes", path, raw["nc"], num_classes)
    reg_max = raw.get("reg_max", 16)
    if isinstance(reg_max, bool) or not isinstance(reg_max, int):
        raise ConfigError(f"{path}: 'reg_max' must be an integer, got {reg_max!r}")
    end_to_end = bool(raw.get("end2end", False))
    return UltralyticsModelYaml(layout, depth, width, max_channels, scale, reg_max, end_to_end, num_masks, base_protos)


def _layout_of(rows: list[list[Any]]) -> str:
    """Which standard layout to compare with: C2f rows are YOLOv8's; YOLO26's SPPF has 4 arguments."""
    modules = [row[2] for row in rows]
    if "C2f" in modules:
        return "yolov8"
    sppf = next((row for row in rows if row[2] == "SPPF"), None)
    return "yolo26" if sppf is not None and len(sppf[3]) == 4 else "yolo11"


def _check_rows(rows: list[list[Any]], layout: str, path: Path) -> None:
    """Refuse the first layer (before the head) that differs from the standard `layout`, or a different count."""
    standard = STANDARD_ROWS[layout]
    for index, (row, wanted) in enumerate(zip(rows[:-1], standard, strict=False)):
        if _normalise(row) != wanted:
            differs = f"layer {index} {_show(row)} differs from {layout}'s {_show(wanted)}"
            raise ConfigError(f"{path}: {differs}; {SUPPORTED}")
    if len(rows) - 1 != len(standard):
        raise ConfigError(f"{path}: {len(rows) - 1} layers before the head, {layout} has {len(standard)}; {SUPPORTED}")


def _head_args(row: list[Any], layout: str, path: Path) -> tuple[int, int] | None:
    """Check `[[P3, P4, P5], 1, Detect, [nc]]` (or Segment with [nc, masks, protos]); return (masks, protos) or None."""
    source, repeats, module, args = _normalise(row)
    seg = SEG_HEADS[layout]
    is_nc = bool(args) and (args[0] == "nc" or (isinstance(args[0], int) and not isinstance(args[0], bool)))
    extras = args[1:]
    good_extras = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in extras)
    shape_ok = (module == "Detect" and not extras) or (module == seg and len(extras) == 2 and good_extras)
    if (source, repeats) != (HEAD_FROM[layout], 1) or not is_nc or not shape_ok:
        expected = f"[{list(HEAD_FROM[layout])}, 1, Detect, [nc]] or [..., {seg}, [nc, 32, 256]]"
        raise ConfigError(f"{path}: head {_show(row)} differs from {layout}'s {expected}; {SUPPORTED}")
    return None if module == "Detect" else (extras[0], extras[1])


def _scale_row(raw: dict[str, Any], path: Path) -> tuple[float, float, int, str]:
    """(depth, width, max_channels, letter) from the `scales` table (see spec_from_ultralytics_yaml for the letter)."""
    scales = raw.get("scales")
    if not isinstance(scales, dict) or not scales:
        raise ConfigError(f"{path}: needs a 'scales' table of [depth, width, max_channels] rows (n, s, m, l, x)")
    named = SCALE_IN_NAME.search(path.stem.lower())
    letter = named.group(1) if named else raw.get("scale")
    if letter is None:
        letter = next(iter(scales))
        LOGGER.info("%s: no scale in the file name or 'scale' key; using the first row, '%s'", path, letter)
    row = scales.get(letter)
    numbers = isinstance(row, list) and len(row) == 3 and all(type(v) in (int, float) for v in row)
    if not numbers or not all(math.isfinite(v) and v > 0 for v in row):
        raise ConfigError(f"{path}: scale '{letter}' is not a [depth, width, max_channels] row of positive numbers")
    return float(row[0]), float(row[1]), int(row[2]), str(letter)


def _normalise(row: Any) -> Any:
    """A YAML layer as a comparable tuple: lists become tuples and the `None` string becomes None."""
    if isinstance(row, list | tuple):
        return tuple(_normalise(v) for v in row)
    return None if row == "None" else row


def _show(row: Any) -> str:
    """Write a layer the way the YAMLs do: [-1, 2, C3k2, [512, False]]."""
    if isinstance(row, list | tuple):
        return "[" + ", ".join(_show(v) for v in row) + "]"
    return "'nearest'" if row == "nearest" else str(row)
