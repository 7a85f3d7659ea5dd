"""The metadata export.py writes into each exported model and the backends read back: keys, layouts, parsing."""

from __future__ import annotations

import ast
import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch

from utils.errors import read_yaml_mapping

# How `output0` is laid out in a file (the `layout` key). The eval model itself always returns ROWS.
ROWS = "rows"  # (B, N, no): [cx, cy, w, h (input pixels), objectness (YOLOv5 only), class probabilities, coeffs]
CHANNELS_FIRST = "channels_first"  # (B, no, N): the same columns, channels first (Ultralytics' layout)
END_TO_END = "end2end"  # (B, k, 6 + nm): an end-to-end head's k best rows [x1, y1, x2, y2, score, class, coeffs]
LAYOUTS = (ROWS, CHANNELS_FIRST, END_TO_END)

TORCHSCRIPT_METADATA_FILE = "config.txt"  # YOLOv5's name for the TorchScript extra file
OPENVINO_METADATA_FILE = "metadata.yaml"  # beside the IR in an OpenVINO model folder (Ultralytics' name)
PRECISIONS = ("fp32", "fp16", "int8")


class ExportMetadata(TypedDict):
    """What an exported model carries besides the graph.

    TorchScript: config.txt as JSON; ONNX: metadata_props; OpenVINO: metadata.yaml in the model folder;
    TensorRT: a JSON header before the engine (`write_engine_file`).
    """

    stride: int  # the largest model stride: input sides must be multiples of it
    names: dict[int, str]  # class id -> name
    task: str  # "detect" | "segment"
    imgsz: list[int]  # [height, width] the graph was traced at
    batch: int
    dynamic: bool  # ONNX only: batch, height and width are free (a TorchScript file runs any size either way)
    half: bool  # fp16 input (TorchScript / ONNX --half); OpenVINO and TensorRT always take fp32 input
    precision: str  # what computes inside, one of PRECISIONS: "fp16" for any --half export, "int8" for --int8
    end2end: bool  # output0 holds final detections (B, max_det, 6 [+ nm]), no NMS needed
    channels: int  # input channels
    family: str  # the model family (utils/families.py: "yolov5" | "anchor_free")
    layout: str  # output0's layout, one of LAYOUTS
    num_masks: int  # mask coefficients per row (0 for detection)
    description: str
    date: str  # ISO 8601, when the file was written


# The keys a backend needs; a file lacking any was not written by this export.py (or by an older one).
REQUIRED_KEYS = ("stride", "names", "task", "imgsz", "batch", "dynamic", "half", "family", "layout", "num_masks")


@contextlib.contextmanager
def without_torchscript_deprecation() -> Iterator[None]:
    """Silence torch's FutureWarnings that torch.jit is deprecated: TorchScript is the format asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


def onnx_metadata_value(value: Any) -> str:
    """How a metadata value is stored in ONNX metadata_props: str() of the Python value.

    YOLOv5's and Ultralytics' readers parse them back with eval / literal_eval, as `parse_onnx_metadata` does.
    """
    return str(value)


def parse_onnx_metadata(props: Mapping[str, str]) -> dict[str, Any]:
    """ONNX metadata_props (key -> str) back to Python values; plain words (task, family) stay strings."""
    return {key: _literal(value) for key, value in props.items()}


def parse_torchscript_metadata(text: str) -> dict[str, Any]:
    """A TorchScript file's config.txt (JSON) back to Python values, class ids as int keys ({} when empty)."""
    if not text:
        return {}
    return json.loads(text, object_hook=_int_class_ids)


def read_metadata(path: Path | str) -> ExportMetadata:
    """Read the metadata of an export (class ids as int keys).

    Any file val.py and detect.py take: `.torchscript`, `.onnx`, `.engine` (suffixes in any case), an
    OpenVINO folder or the `.xml` in it.

    Reads ONNX with the `onnx` package (the graph, not its weights' external data); a file without
    our metadata gives whatever keys it has, possibly none.
    """
    path = Path(path)
    suffix = path.suffix.lower()  # as val.py and detect.py take the file (BEST.ONNX)
    if path.is_dir() or suffix == ".xml":  # an OpenVINO folder, or the .xml in it
        return read_openvino_metadata(path if path.is_dir() else path.parent)  # type: ignore[return-value]
    if suffix == ".engine":
        return read_engine_metadata(path)  # type: ignore[return-value]
    if suffix == ".onnx":
        import onnx

        props = {prop.key: prop.value for prop in onnx.load(str(path), load_external_data=False).metadata_props}
        return parse_onnx_metadata(props)  # type: ignore[return-value]
    extra_files = {TORCHSCRIPT_METADATA_FILE: ""}
    with without_torchscript_deprecation():
        torch.jit.load(str(path), _extra_files=extra_files, map_location="cpu")
    return parse_torchscript_metadata(extra_files[TORCHSCRIPT_METADATA_FILE])  # type: ignore[return-value]


def _literal(text: str) -> Any:
    """Parse a Python literal written by str(); plain words (the task name) stay strings."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def read_openvino_metadata(folder: Path) -> dict[str, Any]:
    """An OpenVINO model folder's metadata.yaml ({} when the folder has none: another tool's export)."""
    path = folder / OPENVINO_METADATA_FILE
    if not path.is_file():
        return {}
    return read_yaml_mapping(path)  # a truncated or hand-broken file: one line naming it


def write_engine_file(path: Path, metadata: Mapping[str, Any], plan: bytes) -> None:
    """Write a TensorRT plan with our metadata before it: 4-byte little-endian length, UTF-8 JSON, the plan.

    The same layout as Ultralytics' `.engine` files, so either project's reader finds the metadata.
    """
    header = json.dumps(dict(metadata)).encode()
    with open(path, "wb") as file:
        file.write(len(header).to_bytes(4, byteorder="little"))
        file.write(header)
        file.write(plan)


def read_engine_metadata(path: Path) -> dict[str, Any]:
    """The metadata `write_engine_file` put before a plan ({} when the file starts with a bare plan)."""
    return split_engine_file(path)[0]


def split_engine_file(path: Path) -> tuple[dict[str, Any], bytes]:
    """(metadata, plan bytes) of an `.engine` file; a file without our JSON header is ({}, the whole file)."""
    data = Path(path).read_bytes()
    length = int.from_bytes(data[:4], byteorder="little")
    if 2 <= length <= len(data) - 4:
        try:
            metadata = json.loads(data[4 : 4 + length].decode(), object_hook=_int_class_ids)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}, data
        if isinstance(metadata, dict):
            return metadata, data[4 + length :]
    return {}, data


def _int_class_ids(mapping: dict[str, Any]) -> dict[Any, Any]:
    """JSON object keys are strings; class ids go back to int, as YOLOv5's loader does."""
    return {int(key) if key.isdigit() else key: value for key, value in mapping.items()}
