"""Map Ultralytics YOLOv8 / YOLO11 / YOLO26 checkpoints (detect and -seg) onto our AnchorFreeModel by structure.

An Ultralytics `.pt` pickles a whole `DetectionModel` / `SegmentationModel` whose `model` is a Sequential
of numbered layers. Those indices equal `AnchorFreeModel.layers()`, and inside every layer our blocks
register their sub-modules in the order Ultralytics' do (models/csp_blocks.py, models/dense_head.py),
so a layer's tensors pair with ours one-to-one in state-dict order. Every pair must agree in shape and
in kind (weight, bias, running_mean ...); the one reshape is the DFL's fixed (1, reg_max, 1, 1) conv
weight onto our `head.bins.weight` (reg_max,). Activations, residual flags and pools must be ours too
(`check_marks`); the SPPF's first conv may be linear (Ultralytics 8.4.0-8.4.140), which the spec then records.
Layout, scale, classes, names, strides, reg_max, end-to-end and the mask sizes all come from the file;
anything else is a one-line ConfigError.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from models.anchor_free import SCALES, STRIDES, AnchorFreeModel, AnchorFreeSpec, build_model
from utils.errors import ConfigError
from utils.pickled_model import (
    ConvertedModel,
    check_marks,
    children,
    conv_out_channels,
    flatten_tensors,
    layer_list,
)
from utils.safe_pickle import Placeholder

SUPPORTED = "only the standard yolov8, yolo11 and yolo26 n-x layouts (detect and -seg) convert"
_V8_NECK = ("Upsample", "Concat", "C2f", "Upsample", "Concat", "C2f", "Conv", "Concat", "C2f", "Conv", "Concat", "C2f")
_V11_NECK = tuple("C3k2" if kind == "C2f" else kind for kind in _V8_NECK)
# Layer class names by index before the head (the last layer), per layout: what AnchorFreeModel.layers() lists.
LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "yolov8": ("Conv", "Conv", "C2f", "Conv", "C2f", "Conv", "C2f", "Conv", "C2f", "SPPF", *_V8_NECK),
    "yolo11": ("Conv", "Conv", "C3k2", "Conv", "C3k2", "Conv", "C3k2", "Conv", "C3k2", "SPPF", "C2PSA", *_V11_NECK),
}
LAYER_KINDS["yolo26"] = LAYER_KINDS["yolo11"]
HEAD_TASKS = {"Detect": "detect", "Segment": "segment", "Segment26": "segment"}
# Base repeats of the P4 stage (layer 6), which tell the depth of a scale row apart.
P4_STAGE_REPEATS = {"yolov8": 6, "yolo11": 2, "yolo26": 2}


def is_ultralytics(model: Placeholder) -> bool:
    """Whether a pickled model is one of Ultralytics' classes (`ultralytics.nn.tasks.DetectionModel`, ...)."""
    return model.source.startswith("ultralytics.")


def detect_layout(model: Placeholder, layers: list[Placeholder], path: Path) -> str:
    """The layout name from the module classes (C2f: yolov8; C3k2 + C2PSA: yolo11, or yolo26 with an end-to-end
    head / reg_max 1 / `end2end` in model.yaml), after checking every layer's class against it."""
    kinds = [layer.class_name for layer in layers]
    head = layers[-1]
    yaml = model.attribute("yaml")
    if "C2f" in kinds:
        layout = "yolov8"
    elif "C3k2" in kinds and "C2PSA" in kinds:
        is_26 = "one2one_cv2" in children(head) or head.attribute("reg_max") == 1
        is_26 = is_26 or (isinstance(yaml, Mapping) and bool(yaml.get("end2end")))
        layout = "yolo26" if is_26 else "yolo11"
    else:
        raise ConfigError(f"{path}: {model.source} has neither C2f (YOLOv8) nor C3k2 + C2PSA (YOLO11/26); {SUPPORTED}")
    expected = LAYER_KINDS[layout]
    for index, (kind, wanted) in enumerate(zip(kinds, expected, strict=False)):
        if kind != wanted:
            raise ConfigError(f"{path}: {layout}-style layer {index} is {kind}, expected {wanted}; {SUPPORTED}")
    if len(kinds) != len(expected) + 1 or kinds[-1] not in HEAD_TASKS:
        raise ConfigError(
            f"{path}: {len(kinds)} layers ending in {kinds[-1]}, the {layout} layout has {len(expected)} layers "
            f"and a Detect or Segment head; {SUPPORTED}"
        )
    return layout


def read_scale(model: Placeholder, layout: str, layers: list[Placeholder], path: Path) -> tuple[float, float, int, str]:
    """(depth_multiple, width_multiple, max_channels, scale letter): model.yaml's `scale` row of `scales`, its
    `depth_multiple`/`width_multiple`, or else the published row whose widths and depth the layers show."""
    yaml = model.attribute("yaml")
    if isinstance(yaml, Mapping):
        scales, scale = yaml.get("scales"), yaml.get("scale")
        if isinstance(scales, Mapping) and scales:
            scale = scale if scale in scales else next(iter(scales))  # Ultralytics' own fallback: the first row
            depth, width, max_channels = scales[scale]
            return float(depth), float(width), int(max_channels), str(scale)
        if "depth_multiple" in yaml and "width_multiple" in yaml:
            max_channels = int(yaml.get("max_channels", 1024))
            return float(yaml["depth_multiple"]), float(yaml["width_multiple"]), max_channels, ""
    stem, p5 = conv_out_channels(layers[0]), conv_out_channels(layers[7])
    repeats = len(children(children(layers[6])["m"]))
    for scale, (depth, width, max_channels) in SCALES[layout].items():
        row = AnchorFreeSpec(layout, depth, width, max_channels, num_classes=1)
        if (row.width(64), row.width(1024), row.depth(P4_STAGE_REPEATS[layout])) == (stem, p5, repeats):
            return depth, width, max_channels, scale
    raise ConfigError(
        f"{path}: no model.yaml scale, and stem {stem} / P5 {p5} channels with {repeats} P4 blocks match no "
        f"published {layout} n-x row; {SUPPORTED}"
    )


def _strides(model: Placeholder, head: Placeholder, path: Path) -> None:
    """Refuse a model whose strides are not P3-P5's 8, 16, 32 (the only levels our head has)."""
    stride = model.attribute("stride")
    stride = stride if isinstance(stride, torch.Tensor) else head.attribute("stride")
    if not isinstance(stride, torch.Tensor) or stride.float().tolist() != list(STRIDES):
        shown = stride.tolist() if isinstance(stride, torch.Tensor) else stride
        raise ConfigError(f"{path}: strides {shown} are not 8, 16, 32; {SUPPORTED}")


def _linear_pool_reduce(sppf: Placeholder) -> bool:
    """Whether the SPPF's first conv is linear: always in YOLO26; in YOLOv8/YOLO11 when Ultralytics 8.4.0-8.4.140
    built the model from its YAML (8.4.141 restored the activation; a fine-tuned older model keeps its own)."""
    reduce = children(sppf).get("cv1")
    act = children(reduce).get("act") if isinstance(reduce, Placeholder) else None
    return isinstance(act, Placeholder) and act.class_name == "Identity"


def spec_from_ultralytics(model: Placeholder, layers: list[Placeholder], path: Path) -> AnchorFreeSpec:
    """Describe the pickled model as our AnchorFreeSpec: layout, scale, classes, reg_max, end-to-end, masks."""
    layout = detect_layout(model, layers, path)
    head = layers[-1]
    _strides(model, head, path)
    depth, width, max_channels, scale = read_scale(model, layout, layers, path)
    is_seg = HEAD_TASKS[head.class_name] == "segment"
    try:
        return AnchorFreeSpec(
            layout,
            depth,
            width,
            max_channels,
            num_classes=int(head.attribute("nc")),
            reg_max=int(head.attribute("reg_max", 16)),
            end_to_end="one2one_cv2" in children(head),
            num_masks=int(head.attribute("nm")) if is_seg else 0,
            num_protos=int(head.attribute("npr")) if is_seg else 0,
            scale=scale,
            linear_pool_reduce=layout != "yolo26" and _linear_pool_reduce(layers[9]),
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: the {head.class_name} head's attributes do not describe a model: {error}") from None


def map_layers(layers: list[Placeholder], model: AnchorFreeModel, path: Path) -> dict[str, torch.Tensor]:
    """Return our state dict filled layer by layer, pairing tensors in state-dict order (see the module docstring).

    Our head's `stride` buffer has no counterpart in the file and keeps our value (checked equal already).
    """
    own = model.state_dict()
    prefixes = {id(module): f"{name}." for name, module in model.named_modules()}
    weights = {"head.stride": own["head.stride"].clone()}
    for index, (layer, ours) in enumerate(zip(layers, model.layers(), strict=True)):
        theirs: dict[str, torch.Tensor] = {}
        flatten_tensors(layer, "", theirs)
        prefix = prefixes[id(ours)]
        our_keys = [key for key in own if key.startswith(prefix) and key not in weights]
        where = f"{path}: layer {index} ({layer.class_name})"
        check_marks(layer, ours, where)
        if len(theirs) != len(our_keys):
            raise ConfigError(f"{where} has {len(theirs)} tensors, ours {len(our_keys)}; {SUPPORTED}")
        for (name, tensor), key in zip(theirs.items(), our_keys, strict=True):
            if key.endswith("bins.weight") and tensor.numel() == own[key].numel():
                tensor = tensor.reshape(own[key].shape)  # DFL: a (1, reg_max, 1, 1) conv weight, ours (reg_max,)
            if tensor.shape != own[key].shape or name.rsplit(".", 1)[-1] != key.rsplit(".", 1)[-1]:
                raise ConfigError(
                    f"{where}: tensor {name} {tuple(tensor.shape)} does not fit our {key} {tuple(own[key].shape)}"
                )
            weights[key] = tensor.detach().clone().contiguous()
    return {key: weights[key] for key in own}


def ultralytics_model(model: Placeholder, path: Path) -> ConvertedModel:
    """Map a pickled Ultralytics DetectionModel / SegmentationModel onto our AnchorFreeModel."""
    layers = layer_list(model)
    spec = spec_from_ultralytics(model, layers, path)
    return ConvertedModel(HEAD_TASKS[layers[-1].class_name], spec, map_layers(layers, build_model(spec), path))
