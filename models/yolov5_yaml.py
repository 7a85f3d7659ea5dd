"""YOLOv5 model YAMLs: check their `backbone:`/`head:` layer lists against the P5 and P6 layouts our network builds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import ConfigError

SUPPORTED = "supported: the standard yolov5n-x and -seg P5 layouts and the yolov5n6-x6 P6 layout"
LAYOUT_KEYS = ("backbone", "head", "activation", "channel_multiple")

# YOLOv5 v6.0+ models/yolov5{n,s,m,l,x}.yaml layer by layer, as [from, number, module, args] before
# depth and width scaling: exactly what models/yolo.py's Backbone and PANNeck build (layers 0-23).
STANDARD_LAYERS: tuple[tuple[Any, ...], ...] = (
    (-1, 1, "Conv", (64, 6, 2, 2)),  # 0-P1/2
    (-1, 1, "Conv", (128, 3, 2)),  # 1-P2/4
    (-1, 3, "C3", (128,)),
    (-1, 1, "Conv", (256, 3, 2)),  # 3-P3/8
    (-1, 6, "C3", (256,)),
    (-1, 1, "Conv", (512, 3, 2)),  # 5-P4/16
    (-1, 9, "C3", (512,)),
    (-1, 1, "Conv", (1024, 3, 2)),  # 7-P5/32
    (-1, 3, "C3", (1024,)),
    (-1, 1, "SPPF", (1024, 5)),  # 9: end of the backbone
    (-1, 1, "Conv", (512, 1, 1)),
    (-1, 1, "nn.Upsample", (None, 2, "nearest")),
    ((-1, 6), 1, "Concat", (1,)),
    (-1, 3, "C3", (512, False)),  # 13
    (-1, 1, "Conv", (256, 1, 1)),
    (-1, 1, "nn.Upsample", (None, 2, "nearest")),
    ((-1, 4), 1, "Concat", (1,)),
    (-1, 3, "C3", (256, False)),  # 17 (P3/8)
    (-1, 1, "Conv", (256, 3, 2)),
    ((-1, 14), 1, "Concat", (1,)),
    (-1, 3, "C3", (512, False)),  # 20 (P4/16)
    (-1, 1, "Conv", (512, 3, 2)),
    ((-1, 10), 1, "Concat", (1,)),
    (-1, 3, "C3", (1024, False)),  # 23 (P5/32)
)
HEAD_FROM = (17, 20, 23)  # layer 24: Detect or Segment on P3, P4, P5

# YOLOv5 v6.0+ models/hub/yolov5{n,s,m,l,x}6.yaml the same way: a stride-64 stage (768 channels at P5,
# 1024 at P6) and one more step each way in the neck (layers 0-32), as models/yolo.py builds it for 4 levels.
STANDARD_LAYERS_P6: tuple[tuple[Any, ...], ...] = (
    *STANDARD_LAYERS[:7],  # 0-6: the P5 models' stem and stages to P4/16
    (-1, 1, "Conv", (768, 3, 2)),  # 7-P5/32
    (-1, 3, "C3", (768,)),
    (-1, 1, "Conv", (1024, 3, 2)),  # 9-P6/64
    (-1, 3, "C3", (1024,)),
    (-1, 1, "SPPF", (1024, 5)),  # 11: end of the backbone
    (-1, 1, "Conv", (768, 1, 1)),
    (-1, 1, "nn.Upsample", (None, 2, "nearest")),
    ((-1, 8), 1, "Concat", (1,)),
    (-1, 3, "C3", (768, False)),  # 15
    (-1, 1, "Conv", (512, 1, 1)),
    (-1, 1, "nn.Upsample", (None, 2, "nearest")),
    ((-1, 6), 1, "Concat", (1,)),
    (-1, 3, "C3", (512, False)),  # 19
    (-1, 1, "Conv", (256, 1, 1)),
    (-1, 1, "nn.Upsample", (None, 2, "nearest")),
    ((-1, 4), 1, "Concat", (1,)),
    (-1, 3, "C3", (256, False)),  # 23 (P3/8)
    (-1, 1, "Conv", (256, 3, 2)),
    ((-1, 20), 1, "Concat", (1,)),
    (-1, 3, "C3", (512, False)),  # 26 (P4/16)
    (-1, 1, "Conv", (512, 3, 2)),
    ((-1, 16), 1, "Concat", (1,)),
    (-1, 3, "C3", (768, False)),  # 29 (P5/32)
    (-1, 1, "Conv", (768, 3, 2)),
    ((-1, 12), 1, "Concat", (1,)),
    (-1, 3, "C3", (1024, False)),  # 32 (P6/64)
)
HEAD_FROM_P6 = (23, 26, 29, 32)  # layer 33: Detect on P3, P4, P5, P6
# Output level count -> (the layers before the head, the head's inputs).
LAYOUTS = {3: (STANDARD_LAYERS, HEAD_FROM), 4: (STANDARD_LAYERS_P6, HEAD_FROM_P6)}
LEVEL_NAMES = {3: "P3-P5", 4: "P3-P6"}
DEFAULT_NUM_MASKS, DEFAULT_BASE_PROTOS = 32, 256  # YOLOv5's Segment(nm=32, npr=256) defaults


@dataclass(frozen=True)
class HeadArgs:
    """What the YAML's last layer says about the head: output levels, mask coefficients, base prototypes.

    `num_levels` is 3 (P3-P5) or 4 (P3-P6). `num_masks` and `base_protos` are 0 for Detect;
    `base_protos` is YOLOv5's `npr` before width scaling (256 in every -seg YAML).
    """

    num_levels: int
    num_masks: int
    base_protos: int


def read_yolov5_layout(raw: dict[str, Any], path: Path) -> HeadArgs | None:
    """Check a model YAML's YOLOv5 keys; return the head's arguments, or None when it has no layer lists.

    `activation` must be SiLU and `channel_multiple` 8 (what our blocks use). `backbone` and `head`
    must equal the standard yolov5n-x (Detect) or -seg (Segment) P5 layout, or the yolov5n6-x6 P6
    layout, row by row, with `nc` and `anchors` placeholders (or an integer class count) in the head's
    arguments. Anything else is a one-line ConfigError naming the file and the first difference,
    because we build those layouts in Python rather than interpreting the lists (docs/DESIGN.md, "no
    YAML-to-graph eval").
    """
    activation = raw.get("activation")
    if activation is not None and str(activation).replace(" ", "") != "nn.SiLU()":
        raise ConfigError(f"{path}: activation {activation} is not supported; the models use nn.SiLU()")
    if raw.get("channel_multiple", 8) != 8:
        raise ConfigError(f"{path}: channel_multiple {raw['channel_multiple']} is not supported; channels round to 8")
    if "backbone" not in raw and "head" not in raw:
        return None
    if not isinstance(raw.get("backbone"), list) or not isinstance(raw.get("head"), list):
        raise ConfigError(f"{path}: 'backbone' and 'head' must both be lists of [from, number, module, args] layers")
    if "num_masks" in raw:
        raise ConfigError(f"{path}: 'num_masks' cannot be combined with 'head'; set masks in the Segment arguments")
    rows = [*raw["backbone"], *raw["head"]]
    if not rows:
        raise ConfigError(f"{path}: 'backbone' and 'head' list no layers")
    for index, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 4 or not isinstance(row[3], list):
            raise ConfigError(f"{path}: layer {index} must be [from, number, module, args], got {row!r}")
    num_levels = _check_head_levels(rows, path)
    layers, head_from = LAYOUTS[num_levels]
    for index, (row, standard) in enumerate(zip(rows[:-1], layers, strict=False)):
        if _normalise(row) != standard:
            raise ConfigError(
                f"{path}: layer {index} {_show(row)} differs from the standard {_show(standard)}; {SUPPORTED}"
            )
    if len(rows) - 1 != len(layers):
        raise ConfigError(
            f"{path}: {len(rows) - 1} layers before the head, the standard {LEVEL_NAMES[num_levels]} layout has "
            f"{len(layers)}; {SUPPORTED}"
        )
    return _head_args(rows[-1], head_from, path)


def _check_head_levels(rows: list[list[Any]], path: Path) -> int:
    """Return the head's level count (3 or 4); refuse a last layer that is not Detect/Segment, or other levels.

    Four levels must be P3-P6 (a P2-P5 model has four too); P2, P7 and P3-P4 models are refused, and
    so is Segment on four levels (YOLOv5 publishes no P6 -seg model), each in one line.
    """
    source, _, module, _ = rows[-1]
    if module not in ("Detect", "Segment"):
        raise ConfigError(f"{path}: the last layer is {module}, not Detect or Segment; {SUPPORTED}")
    num_levels = len(source) if isinstance(source, list) else 1
    names = _level_names(rows)
    if num_levels not in LAYOUTS or (names and names != LEVEL_NAMES[num_levels]):
        levels = f"{names} ({num_levels} output levels)" if names else f"{num_levels} output levels"
        raise ConfigError(f"{path}: {levels} is not supported; {SUPPORTED}")
    if module == "Segment" and num_levels != 3:
        raise ConfigError(f"{path}: Segment on {num_levels} levels is not supported; there are no P6 -seg models")
    return num_levels


def _level_names(rows: list[list[Any]]) -> str:
    """Name the head's input levels ('P3-P6') by walking the layers' strides; '' when a layer is not understood.

    Only for the error message: Conv's third argument and nn.Upsample's second change the stride,
    Concat takes its first input's, every other module keeps it.
    """
    strides: list[float] = []
    try:
        for index, (source, _, module, args) in enumerate(rows):
            first = source[0] if isinstance(source, list) else source
            stride = 1.0 if index == 0 else strides[first if first >= 0 else index + first]
            if module == "Conv" and len(args) > 2:
                stride *= args[2]
            elif module == "nn.Upsample":
                stride /= args[1]
            elif module not in ("C3", "SPPF", "Concat", "Detect", "Segment"):
                return ""
            strides.append(stride)
        names = [f"P{round(math.log2(strides[i]))}" for i in rows[-1][0]]
    except (TypeError, IndexError, ValueError):
        return ""
    return f"{names[0]}-{names[-1]}" if len(names) > 1 else names[0]


def _head_args(row: list[Any], head_from: tuple[int, ...], path: Path) -> HeadArgs:
    """Check the last layer `[head_from, 1, Detect|Segment, [nc, anchors(, nm, npr)]]` and read nm, npr.

    `head_from` is the layout's head inputs: [17, 20, 23] for P5, [23, 26, 29, 32] for P6.
    """
    source, number, module, args = row
    allowed = 2 if module == "Detect" else 4
    is_nc = len(args) >= 2 and (args[0] == "nc" or (isinstance(args[0], int) and not isinstance(args[0], bool)))
    extras = args[2:]
    if (
        _normalise(row)[:2] != (head_from, 1)
        or not is_nc
        or args[1] != "anchors"
        or len(args) > allowed
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in extras)
    ):
        expected = "[nc, anchors]" if module == "Detect" else "[nc, anchors, 32, 256]"
        raise ConfigError(
            f"{path}: head {_show(row)} differs from the standard [{_show(head_from)}, 1, {module}, {expected}]; "
            f"{SUPPORTED}"
        )
    if module == "Detect":
        return HeadArgs(len(head_from), 0, 0)
    defaults = (DEFAULT_NUM_MASKS, DEFAULT_BASE_PROTOS)
    num_masks, base_protos = (*extras, *defaults[len(extras) :])
    return HeadArgs(len(head_from), num_masks, base_protos)


def _normalise(row: list[Any]) -> tuple[Any, ...]:
    """A YAML layer as a comparable tuple: lists become tuples and YOLOv5's `None` string becomes None."""

    def plain(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(plain(v) for v in value)
        return None if value == "None" else value

    return tuple(plain(v) for v in row)


def _show(row: Any) -> str:
    """Write a layer the way YOLOv5's YAMLs do: [-1, 3, C3, [512, False]]."""
    if isinstance(row, list | tuple):
        return "[" + ", ".join(_show(v) for v in row) + "]"
    return "'nearest'" if row == "nearest" else str(row)
