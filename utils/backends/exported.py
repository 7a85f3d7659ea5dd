"""What every exported-file backend shares: its metadata checked against the request, fixed batches, rows back.

A runtime (TorchScript, onnxruntime, OpenVINO, TensorRT) is one ExportedBackend subclass that
opens its file, hands its metadata to `exported_info` and runs images in `run_file`; the checks,
the fixed-batch handling and the layout conversion here are the same for all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.backends.base import BackendInfo, BackendRequest, InferenceBackend
from utils.backends.metadata import CHANNELS_FIRST, END_TO_END, LAYOUTS, REQUIRED_KEYS
from utils.boxes import xyxy_to_xywh
from utils.checkpoint import ENTRY_SCRIPTS
from utils.errors import ConfigError
from utils.families import family_named

LOGGER = logging.getLogger(__name__)

# A runner takes images and returns an exported file's outputs (output0 [, output1]) as numpy arrays: what
# export's parity check compares and what the TensorRT backend wraps.
Runner = Callable[[torch.Tensor], list[np.ndarray]]


def exported_info(path: Path, metadata: Mapping[str, Any], file_format: str) -> BackendInfo:
    """The BackendInfo of an exported file from the metadata export.py wrote into it.

    A file without our keys (another tool's export, or one written before export.py recorded the
    family and layout) is a one-line ConfigError naming the file and the fix.
    """
    missing = [key for key in REQUIRED_KEYS if key not in metadata]
    if missing:
        what = "no metadata" if len(missing) == len(REQUIRED_KEYS) else f"no {', '.join(missing)} in its metadata"
        raise ConfigError(f"{path}: {what} from this project's export.py; export the .pt with export.py")
    if metadata["layout"] not in LAYOUTS:
        raise ConfigError(f"{path}: unknown output layout {metadata['layout']!r} (known: {', '.join(LAYOUTS)})")
    family_named(metadata["family"], path)  # an unknown family is a one-line error naming the file
    _check_field_types(path, metadata)
    names = metadata["names"]
    height, width = metadata["imgsz"]
    # A TorchScript trace builds its grids from the input's size, so it runs any batch and size; a TensorRT
    # engine is always built for one shape (export.py refuses --dynamic for it).
    is_static = file_format == "engine" or (file_format in ("onnx", "openvino") and not metadata["dynamic"])
    return BackendInfo(
        path=path,
        file_format=file_format,
        task=metadata["task"],
        family=metadata["family"],
        layout=metadata["layout"],
        names=tuple(str(names[key]) for key in sorted(names)) if isinstance(names, dict) else tuple(map(str, names)),
        imgsz=(int(height), int(width)),
        fixed_shape=is_static,
        batch=int(metadata["batch"]) if is_static else None,
        dtype=torch.float16 if metadata["half"] else torch.float32,
        stride=int(metadata["stride"]),
        num_masks=int(metadata["num_masks"]),
        end_to_end=metadata["layout"] == END_TO_END,
        precision=str(metadata.get("precision", "fp16" if metadata["half"] else "fp32")),  # older files lack the key
    )


def _check_field_types(path: Path, metadata: Mapping[str, Any]) -> None:
    """A one-line ConfigError naming the file and the key when a field export.py writes has the wrong kind of value."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    imgsz = metadata["imgsz"]
    checks = {
        "imgsz": (isinstance(imgsz, list | tuple) and len(imgsz) == 2 and all(whole(s) and s > 0 for s in imgsz),
                  "[height, width]"),
        "names": (isinstance(metadata["names"], dict | list | tuple) and len(metadata["names"]) > 0,
                  "class names (a mapping or a list)"),
        "batch": (whole(metadata["batch"]) and metadata["batch"] > 0, "a positive whole number"),
        "stride": (whole(metadata["stride"]) and metadata["stride"] > 0, "a positive whole number"),
        "num_masks": (whole(metadata["num_masks"]) and metadata["num_masks"] >= 0, "a whole number"),
        "half": (isinstance(metadata["half"], bool), "true or false"),
        "dynamic": (isinstance(metadata["dynamic"], bool), "true or false"),
    }  # fmt: skip
    for key, (valid, expected) in checks.items():
        if not valid:
            value = metadata[key]
            raise ConfigError(f"{path}: its metadata's {key} is {value!r}, not {expected}; export the .pt again")


FP32_INPUT_FORMATS = ("openvino", "engine")  # their precision is chosen at export; their input stays FP32


def check_request(info: BackendInfo, request: BackendRequest) -> None:
    """Refuse, in one line naming the file, what an exported file cannot do for `request`.

    A file of another task points at the entry point that takes it; --half needs a file exported in
    FP16 (an FP32 graph is not converted here); an FP16 file needs CUDA; --nms needs the NMS layout,
    which an end-to-end file does not hold.
    """
    path = info.path
    if request.task is not None and info.task != request.task:
        entry = ENTRY_SCRIPTS[request.script][info.task == "segment"]
        raise ConfigError(f"{path} is a {info.task} export, not a {request.task} one; use {entry}")
    if request.half and info.file_format in FP32_INPUT_FORMATS:
        raise ConfigError(f"{path} takes FP32 input ({info.precision} inside, fixed at export); run it without --half")
    if request.half and info.dtype != torch.float16:
        raise ConfigError(f"{path} was exported in FP32; for --half export it with export.py --half (on CUDA)")
    if info.dtype == torch.float16 and request.device.type != "cuda":
        raise ConfigError(f"{path} was exported in FP16, which runs on CUDA only; use --device 0 or an FP32 export")
    if request.nms and info.end_to_end:
        raise ConfigError(f"{path} holds an end-to-end head's final detections; for --nms export it with --nms")


class ExportedBackend(InferenceBackend):
    """An exported file run by its runtime; subclasses open the file and implement `run_file`.

    forward() returns the eval model's rows (see InferenceBackend) whatever layout the file stores, so
    selection is the same code as for a checkpoint. A file with a fixed batch runs any batch: larger
    ones in chunks of its batch, a short chunk padded with blank images whose outputs are dropped.
    """

    def __init__(self, info: BackendInfo, device: torch.device) -> None:
        super().__init__(info)
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def run_file(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The file's outputs for `images` (output0 [, output1]) as tensors on `device`."""
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(rows (B, N, no), None) for detection, (rows, (None, protos)) for segmentation."""
        if self.info.fixed_shape and tuple(images.shape[2:]) != self.info.imgsz:
            shape, fixed = tuple(images.shape), self.info.imgsz
            raise ValueError(f"{self.info.path}: input {shape} does not match its fixed size {fixed}")
        outputs = self._run_in_batches(images)
        check_outputs(self.info, outputs)
        rows = rows_from_output(outputs[0].float(), self.info)
        return (rows, (None, outputs[1])) if self.info.num_masks else (rows, None)

    def _run_in_batches(self, images: torch.Tensor) -> list[torch.Tensor]:
        """run_file on `images`, in chunks of a fixed batch (the last padded) when the file has one."""
        blank = lambda shape, like: like.new_zeros(shape)  # noqa: E731  (on the images' device)
        return run_in_chunks(self.run_file, images, self.info.batch, torch.cat, blank)


class HostRuntimeBackend(ExportedBackend):
    """An exported file run by a runtime that takes host arrays and has its own CPU threads (onnxruntime, OpenVINO).

    Subclasses implement `run_array` on numpy arrays. The batch becomes one host array, cut into the
    file's batch, padded and run in numpy, and goes back to torch once: a torch operation between two
    runtime calls wakes torch's OpenMP threads, whose spin-wait then takes the cores the runtime's
    threads need (measured on 2 cores: an OpenVINO yolov8n call went from 2.7 to 4.6 ms).
    """

    def run_array(self, array: np.ndarray) -> list[np.ndarray]:
        """The file's outputs (output0 [, output1]) for the host array `array` at the file's batch."""
        raise NotImplementedError

    def input_array(self, images: torch.Tensor) -> np.ndarray:
        """`images` as the C-contiguous host array the runtime takes (the dtype the file was exported in)."""
        return np.ascontiguousarray(images.detach().cpu().numpy())

    def _run_in_batches(self, images: torch.Tensor) -> list[torch.Tensor]:
        blank = lambda shape, like: np.zeros(shape, like.dtype)  # noqa: E731
        outputs = run_in_chunks(self.run_array, self.input_array(images), self.info.batch, np.concatenate, blank)
        return [torch.from_numpy(output).to(self.device) for output in outputs]


def check_outputs(info: BackendInfo, outputs: list[torch.Tensor]) -> None:
    """A one-line ConfigError naming the file when its outputs do not have the widths its metadata describes.

    The metadata travels beside the graph (ONNX props, an OpenVINO folder's yaml, a TensorRT header):
    edited, or taken from another export, it would make the selector read mask coefficients as class
    scores, or a class as another, without a word. Shapes only: no copy, no host synchronisation.
    """
    num_classes, num_masks = len(info.names), info.num_masks
    if info.layout == END_TO_END:
        expected, meaning = 6 + num_masks, f"box, score, class + {num_masks} mask coefficients"
    else:
        objectness = family_named(info.family, info.path).objectness
        expected = 4 + int(objectness) + num_classes + num_masks
        meaning = f"box{' + objectness' if objectness else ''} + {num_classes} classes + {num_masks} mask coefficients"
    shape = tuple(outputs[0].shape)
    width = (shape[1] if info.layout == CHANNELS_FIRST else shape[2]) if len(shape) == 3 else None
    problem = ""
    if width != expected:
        problem = f"output0 {shape} has {width} values per row, its metadata says {expected} ({meaning})"
    elif num_masks and (len(outputs) < 2 or outputs[1].ndim != 4 or outputs[1].shape[1] != num_masks):
        protos = tuple(outputs[1].shape) if len(outputs) > 1 else "none"
        problem = f"its prototype masks {protos} are not the {num_masks} its metadata says"
    if problem:
        raise ConfigError(f"{info.path}: {problem}; the metadata is not this graph's: export the .pt again")


def run_in_chunks(run: Callable, items: Any, batch: int | None, concat: Callable, blank: Callable) -> list[Any]:
    """`run(items)`, or with a fixed `batch` run on chunks of it (the last padded with blanks) and joined.

    One loop for tensors and numpy arrays: `concat` joins a sequence of them, `blank(shape, like)` makes
    zeros of that shape with `like`'s dtype (and device). The padded rows' outputs are dropped.
    """
    if batch is None or len(items) == batch:
        return run(items)
    pieces = []
    for start in range(0, len(items), batch):
        chunk = items[start : start + batch]
        count = len(chunk)
        if count < batch:
            chunk = concat((chunk, blank((batch - count, *chunk.shape[1:]), chunk)))
        pieces.append([output[:count] for output in run(chunk)])
    return [concat(parts) for parts in zip(*pieces, strict=True)]


def leave_cores_to_runtime(backend: InferenceBackend) -> None:
    """Run torch on one thread while a host runtime does the inference on the CPU; entry points only.

    The runtime computes on its own threads; torch is left the light work around each call (pre-process,
    NMS). With more than one thread every such torch operation wakes torch's OpenMP pool, whose spin-wait
    takes the runtime's cores at its next call: measured on 2 cores, an OpenVINO INT8 yolov8n predicting
    image by image spent 2.7 ms per call, and 1.4 ms with torch on one thread (the IR alone: 1.3 ms).
    val and detect call this after loading; their run restores the thread count (utils/cli/entry.py).
    torch.hub does not: the caller's process keeps its own settings.
    """
    runs_on_host = any(isinstance(module, HostRuntimeBackend) for module in backend.modules())  # --augment wraps it
    if runs_on_host and backend.device.type == "cpu" and torch.get_num_threads() > 1:
        LOGGER.info(f"{backend.info.path.name}: torch on 1 thread beside {backend.info.file_format}'s own threads")
        torch.set_num_threads(1)


def rows_from_output(output0: torch.Tensor, info: BackendInfo) -> torch.Tensor:
    """A file's `output0` in the eval model's ROWS layout (B, N, no), what the family's selector reads."""
    if info.layout == CHANNELS_FIRST:
        return output0.transpose(1, 2)
    if info.layout == END_TO_END:
        return rows_from_detections(output0, len(info.names), info.num_masks)
    return output0


def _occurrence(keys: torch.Tensor) -> torch.Tensor:
    """For each element of `keys` (n,), how many earlier elements have the same key: 0, 1, ..."""
    order = torch.argsort(keys, stable=True)
    ranked = keys[order]
    position = torch.arange(len(keys), device=keys.device)
    starts = torch.ones_like(ranked, dtype=torch.bool)
    starts[1:] = ranked[1:] != ranked[:-1]
    first = torch.cummax(torch.where(starts, position, 0), 0).values  # where each key's run begins
    counts = torch.empty_like(position)
    counts[order] = position - first
    return counts


def rows_from_detections(detections: torch.Tensor, num_classes: int, num_masks: int) -> torch.Tensor:
    """An end-to-end file's final detections back as decoded rows, for the same top-score selector as a checkpoint.

    detections: (B, k, 6 + nm) [x1, y1, x2, y2, score, class, coeffs], the k best (point, class) scores.
    Returns (B, M, 4 + nc + nm) [cx, cy, w, h, class scores, coeffs]: one row per point, the scores of
    its classes among the k and 0 for the others; images with fewer points are padded with zero rows
    (score 0 never passes a threshold). Rows of one point are copies of one decoded row, so equal
    boxes and coefficients identify the point, and as a point has each class once, the n-th row of a
    (box, class) pair belongs to the n-th point with that box: two points can share a box (an fp16
    file rounds near ones together), and would otherwise become one, with one of their scores.
    The selector then gives the checkpoint's detections whenever they lie within the file's k
    scores: always with multi-label selection and --max-det <= k.
    """
    batch = len(detections)
    per_image = []
    for rows in detections:
        point_columns = torch.cat((rows[:, :4], rows[:, 6:]), 1)
        classes = rows[:, 5].long()
        _, same_box = torch.unique(point_columns, dim=0, return_inverse=True)
        nth = _occurrence(same_box * num_classes + classes)  # the n-th row of its (box, class) pair
        _, point_of_row = torch.unique(same_box * len(rows) + nth, return_inverse=True)
        points = point_columns.new_empty((int(point_of_row.max()) + 1 if len(rows) else 0, point_columns.shape[1]))
        points[point_of_row] = point_columns
        scores = rows.new_zeros((len(points), num_classes))
        scores[point_of_row, classes] = rows[:, 4]
        per_image.append(torch.cat((xyxy_to_xywh(points[:, :4]), scores, points[:, 4:]), 1))
    width = 4 + num_classes + num_masks
    out = detections.new_zeros((batch, max((len(rows) for rows in per_image), default=0), width))
    for index, rows in enumerate(per_image):
        out[index, : len(rows)] = rows
    return out
