"""Convert YOLOv5 / Ultralytics checkpoints (pickled model objects) into this project's weights-only format.

    python3 -m utils.convert yolov5s.pt yolov5s-converted.pt

`--weights yolov5s.pt` (or `yolo11n.pt`) in train.py, val.py, detect.py and export.py converts in
memory instead (`load_weights`). The file is read with utils/safe_pickle.py, so nothing in it runs.
Ultralytics' YOLOv8 / YOLO11 / YOLO26 models go to utils/convert_ultralytics.py; this module maps
YOLOv5's by structure: its numbered layer list (`model.0` ... `model.24`, P6: `model.33`) lines up with
`DetectionModel.layers()`, each YOLOv5 block's sub-module names are renamed to ours (C3's
cv1/cv2/cv3/m are deep_in/skip/mix/blocks, ...), every tensor must match our tensor of that
name in shape, and every activation, residual flag and pool must be ours (`check_marks`): a file
that does not fill our model exactly is refused with one line naming the first difference.
Anchors, strides, class names and the scale (depth/width multiples) come from the file.
"""

from __future__ import annotations

import argparse
import logging
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from models.yolo import BASE_DEPTHS, BASE_WIDTHS, ModelSpec, build_model
from utils.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from utils.convert_ultralytics import is_ultralytics, ultralytics_model
from utils.distributed import DistContext
from utils.errors import ConfigError, exit_on_user_error
from utils.families import spec_from_checkpoint
from utils.pickled_model import (
    ConvertedModel,
    check_marks,
    children,
    conv_out_channels,
    find_model,
    flatten_tensors,
    layer_list,
    weights_only_checkpoint,
)
from utils.safe_pickle import Placeholder, UnsafePickleError, load_untrusted

LOGGER = logging.getLogger(__name__)

# YOLOv5 v6+ P5 layer types by index (yolov5n..x and -seg share it); index 24 is the head.
YOLOV5_LAYOUT = (
    "Conv", "Conv", "C3", "Conv", "C3", "Conv", "C3", "Conv", "C3", "SPPF",
    "Conv", "Upsample", "Concat", "C3", "Conv", "Upsample", "Concat", "C3",
    "Conv", "Concat", "C3", "Conv", "Concat", "C3",
)  # fmt: skip
# The P6 models' (yolov5n6..x6): a stride-64 stage and one more neck step each way; index 33 is the head (Detect).
YOLOV5_LAYOUT_P6 = (
    "Conv", "Conv", "C3", "Conv", "C3", "Conv", "C3", "Conv", "C3", "Conv", "C3", "SPPF",
    "Conv", "Upsample", "Concat", "C3", "Conv", "Upsample", "Concat", "C3", "Conv", "Upsample", "Concat", "C3",
    "Conv", "Concat", "C3", "Conv", "Concat", "C3", "Conv", "Concat", "C3",
)  # fmt: skip
HEADS = {"Detect": "detect", "Segment": "segment"}
# YOLOv5 sub-module name -> ours, per YOLOv5 block type (children not listed keep their name).
RENAMES: dict[str, dict[str, str]] = {
    "C3": {"cv1": "deep_in", "cv2": "skip", "cv3": "mix", "m": "blocks"},
    "Bottleneck": {"cv1": "reduce", "cv2": "spatial"},
    "SPPF": {"cv1": "reduce", "cv2": "mix"},
    "Proto": {"cv1": "expand", "cv2": "refine", "cv3": "project"},
    "Detect": {"m": "convs"},
    "Segment": {"m": "convs"},
}
DERIVED_BUFFERS = frozenset({"anchor_grid"})  # YOLOv5 < 6.0 stored this copy of the anchors; ours computes it


def _layers(model: Placeholder, path: Path) -> list[Placeholder]:
    """The numbered layers, checked against the YOLOv5 v6+ P5 or P6 layout (one-line error otherwise).

    The layer count picks the layout the types are compared with: 34 layers is P6, any other count P5.
    """
    layers = layer_list(model)
    kinds = tuple(layer.class_name for layer in layers)
    layout = YOLOV5_LAYOUT_P6 if len(kinds) == len(YOLOV5_LAYOUT_P6) + 1 else YOLOV5_LAYOUT
    supported = "only the YOLOv5 v6+ P5 (yolov5n-x, -seg) and P6 (yolov5n6-x6) layouts convert"
    if len(kinds) == len(layout) + 1 and kinds[:-1] == layout and kinds[-1] in HEADS:
        if layers[-1].attribute("_buffers", {}).get("anchors") is None:
            raise ConfigError(f"{path}: {model.source} has an anchor-free head (YOLOv8-style); {supported}")
        if layout is YOLOV5_LAYOUT_P6 and kinds[-1] != "Detect":
            raise ConfigError(f"{path}: {model.source} is a P6 model with a {kinds[-1]} head; {supported}")
        return layers
    if len(kinds) > len(layout) + 1:
        what = f"{len(kinds)} layers (a custom model)"
    else:
        index = next((i for i, (a, b) in enumerate(zip(kinds, layout, strict=False)) if a != b), len(kinds) - 1)
        expected = layout[index] if index < len(layout) else "Detect or Segment"
        what = f"layer {index} is {kinds[index]}, expected {expected}"
    raise ConfigError(f"{path}: {model.source}: {what}; {supported}")


def _scale(model: Placeholder, layers: list[Placeholder]) -> tuple[float, float]:
    """(depth_multiple, width_multiple): from the model's YAML, else inferred from layer sizes."""
    yaml = model.attribute("yaml")
    if isinstance(yaml, Mapping) and "depth_multiple" in yaml and "width_multiple" in yaml:
        return float(yaml["depth_multiple"]), float(yaml["width_multiple"])
    stem_channels = conv_out_channels(layers[0])
    blocks = len(children(children(layers[2])["m"]))
    return blocks / BASE_DEPTHS[0], stem_channels / BASE_WIDTHS[0]


def spec_from_pickle(model: Placeholder, layers: list[Placeholder], path: Path) -> ModelSpec:
    """Describe the pickled model as our ModelSpec: scale, anchors in pixels, classes, mask sizes."""
    head = layers[-1]
    anchors_grid = head.attribute("_buffers")["anchors"].float()  # (levels, anchors, 2) in grid units
    stride = head.attribute("stride")
    stride = model.attribute("stride") if not isinstance(stride, torch.Tensor) else stride
    if not isinstance(stride, torch.Tensor) or stride.numel() != len(anchors_grid):
        raise ConfigError(f"{path}: the head's strides are missing or do not match its {len(anchors_grid)} levels")
    anchors_px = anchors_grid * stride.float().view(-1, 1, 1)
    depth, width = _scale(model, layers)
    spec = ModelSpec(
        depth_multiple=depth,
        width_multiple=width,
        anchors=tuple(tuple(round(v, 4) for v in level.flatten().tolist()) for level in anchors_px),
        num_classes=int(head.attribute("nc")),
    )
    if head.class_name == "Segment":
        num_protos = conv_out_channels(children(children(head)["proto"])["cv1"])
        spec = replace(spec, num_masks=int(head.attribute("nm")), num_protos=int(num_protos))
    return spec


def map_weights(layers: list[Placeholder], model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Return our state dict filled from the pickled layers; any missing, extra or misshaped tensor is an error."""
    prefixes = {id(module): f"{name}." for name, module in model.named_modules()}
    theirs: dict[str, torch.Tensor] = {}
    for index, (layer, ours) in enumerate(zip(layers, model.layers(), strict=True)):
        check_marks(layer, ours, f"{path}: layer {index} ({layer.class_name})")
        flatten_tensors(layer, prefixes[id(ours)], theirs, RENAMES, DERIVED_BUFFERS)
    own = model.state_dict()
    theirs.setdefault("head.stride", own["head.stride"])  # YOLOv5 keeps it as a plain attribute
    extra = [key for key in theirs if key not in own]
    missing = [key for key in own if key not in theirs]
    if extra or missing:
        detail = f"unexpected tensor {extra[0]}" if extra else f"no tensor for {missing[0]}"
        raise ConfigError(f"{path}: does not fit our {type(model).__name__}: {detail}")
    for key, tensor in own.items():
        if theirs[key].shape != tensor.shape:
            shapes = f"{tuple(theirs[key].shape)} in the file, {tuple(tensor.shape)} here"
            raise ConfigError(f"{path}: tensor {key} has shape {shapes}")
    if not torch.allclose(theirs["head.stride"].float(), own["head.stride"]):
        strides = f"{theirs['head.stride'].tolist()} differ from ours {own['head.stride'].tolist()}"
        raise ConfigError(f"{path}: strides {strides}")
    return {key: theirs[key].detach().clone().contiguous() for key in own}


def yolov5_model(model_node: Placeholder, path: Path) -> ConvertedModel:
    """Map a pickled YOLOv5 DetectionModel / SegmentationModel onto ours (one-line ConfigError when it does not fit)."""
    layers = _layers(model_node, path)
    spec = spec_from_pickle(model_node, layers, path)
    return ConvertedModel(HEADS[layers[-1].class_name], spec, map_weights(layers, build_model(spec), path))


def convert_loaded(raw: Any, path: Path) -> Checkpoint:
    """Turn an object tree read by load_untrusted into our Checkpoint (weights only, like a stripped best.pt).

    Ultralytics' classes (`ultralytics.nn.tasks.*`) go to utils/convert_ultralytics.py, everything else
    is read as YOLOv5's.
    """
    model_node = find_model(raw, path)
    convert = ultralytics_model if is_ultralytics(model_node) else yolov5_model
    return weights_only_checkpoint(convert(model_node, path), raw, model_node, path)


def convert_checkpoint(path: Path | str) -> Checkpoint:
    """Read a YOLOv5 / Ultralytics .pt safely and return it as our Checkpoint; one-line ConfigError on failure."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return convert_loaded(load_untrusted(path), path)


def load_weights(path: Path | str) -> Checkpoint:
    """Load `--weights`: one of our checkpoints, or a YOLOv5 / Ultralytics file converted in memory.

    Our own format is tried first (weights-only torch.load). Only when that refuses the file is
    it read with the restricted unpickler; a file that names code-running globals stays refused
    (UnsafePickleError), and a file that is neither format gets our loader's original error.
    """
    path = Path(path)
    try:
        return load_checkpoint(path)
    except ConfigError as error:
        if not zipfile.is_zipfile(path):
            raise
        ours_error = error
    try:
        raw = load_untrusted(path)
        model = find_model(raw, path)
    except UnsafePickleError:
        raise
    except ConfigError:
        raise ours_error from None
    checkpoint = convert_loaded(raw, path)
    LOGGER.info(
        f"{path}: converted {model.source} to this project's format in memory "
        f"(python3 -m utils.convert {path} saves it once)"
    )
    return checkpoint


def main(argv: list[str] | None = None) -> Path:
    """Command line: convert SOURCE (a YOLOv5/Ultralytics .pt) into OUTPUT (default SOURCE-converted.pt)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("source", type=Path, help="YOLOv5 or Ultralytics checkpoint (.pt)")
    parser.add_argument("output", type=Path, nargs="?", help="where to write ours (default: SOURCE-converted.pt)")
    args = parser.parse_args(argv)
    output = args.output or args.source.with_name(f"{args.source.stem}-converted.pt")
    checkpoint = convert_checkpoint(args.source)
    save_checkpoint(checkpoint, output, DistContext())
    spec = spec_from_checkpoint(checkpoint, output)
    print(
        f"{args.source} -> {output}: {checkpoint['task']} model, {spec.num_classes} classes, "
        f"depth {spec.depth_multiple} width {spec.width_multiple}, {len(checkpoint['model'])} tensors"
    )
    return output


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(exit_on_user_error(main))
