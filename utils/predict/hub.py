"""In-memory inference for Python users (what hubconf.py returns): images in, detections out as data.

    model = torch.hub.load("path/to/repo", "custom", path="best.pt", source="local")
    results = model(["a.jpg", cv2.imread("b.jpg")[..., ::-1], PIL.Image.open("c.jpg")])
    results[0].boxes, results[0].scores, results[0].names   # numpy, original pixels
    results[0].to_dicts()  /  .txt_lines()  /  .coco_rows(image_id)

The same pipeline as detect.py (`FramePredictor`: rectangular letterbox, forward, single-label
NMS or an end-to-end head's top scores, boxes and masks back in the original pixels), so a
checkpoint, or a .torchscript / .onnx file export.py wrote (`path="best.onnx"`), gives the
detections detect.py writes for the same image and settings.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ImageOps
from torch import nn

from utils.backends import (
    AugmentedBackend,
    BackendRequest,
    InferenceBackend,
    as_backend,
    load_backend,
    resolve_imgsz,
)
from utils.config import stride_multiples
from utils.distributed import select_device
from utils.errors import ConfigError
from utils.eval.coco import predictions_to_coco
from utils.eval.evaluate import ImagePredictions
from utils.families import build_model, segmentation_spec, spec_from_cfg
from utils.predict.config import PredictConfig
from utils.predict.outputs import txt_lines
from utils.predict.prediction import Prediction, class_name
from utils.predict.predictor import FramePredictor
from utils.predict.sources import UnreadableInputError, read_image
from utils.tasks import Task

LOGGER = logging.getLogger(__name__)


@dataclass
class ImageResult:
    """One image's detections, highest score first, in the original image's pixels."""

    source: str  # the path, or "image<i>" for an array / PIL image
    shape: tuple[int, int]  # original (height, width)
    boxes: np.ndarray  # (n, 4) float32 x1 y1 x2 y2
    scores: np.ndarray  # (n,) float32
    classes: np.ndarray  # (n,) int64
    names: tuple[str, ...]  # the model's class names (index = class id)
    masks: np.ndarray | None = None  # segmentation: (n, height, width) bool

    def __len__(self) -> int:
        return len(self.scores)

    def to_dicts(self) -> list[dict[str, Any]]:
        """Plain data: [{"box": [x1, y1, x2, y2], "score", "class", "name"}, ...] (+ "mask": (H, W) bool array)."""
        rows = []
        for index in range(len(self)):
            cls = int(self.classes[index])
            row = {"box": [float(v) for v in self.boxes[index]], "score": float(self.scores[index]), "class": cls,
                   "name": class_name(self.names, cls)}  # fmt: skip
            if self.masks is not None:
                row["mask"] = self.masks[index]
            rows.append(row)
        return rows

    def txt_lines(self, save_conf: bool = False) -> list[str]:
        """The YOLO-format lines `detect.py --save-txt [--save-conf]` writes for this image (polygons for masks)."""
        return txt_lines(self._prediction(), self.shape, save_conf)

    def coco_rows(self, image_id: int | str, category_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """COCO result rows as `val.py --save-json` writes them: image_id, category_id, bbox [x, y, w, h], score.

        `category_ids[class]` maps class indices to the dataset's category ids (default: the index);
        segmentation rows carry the mask as a COCO RLE.
        """
        detections = np.concatenate([self.boxes, self.scores[:, None], self.classes[:, None].astype(np.float32)], 1)
        rles = None
        if self.masks is not None:
            from pycocotools import mask as mask_utils

            rles = [mask_utils.encode(np.asfortranarray(mask.astype(np.uint8))) for mask in self.masks]
        item = ImagePredictions(self.source, self.shape, detections.reshape(-1, 6), rles)
        ids = list(category_ids) if category_ids is not None else list(range(len(self.names)))
        return predictions_to_coco([item], {Path(self.source).name: image_id}, ids)

    def _prediction(self) -> Prediction:
        return Prediction(self.boxes, self.scores, self.classes, self.masks)


class Detector(nn.Module):
    """A loaded checkpoint or exported file for in-memory inference: call it on images, get a list of `ImageResult`.

    Settings are attributes, as YOLOv5's hub models have them: `conf` (0.25), `iou` (0.45),
    `classes` (None: all), `agnostic` (False), `max_det` (1000), `size` (the long side: the size a
    loaded checkpoint was trained at or a file exported at, as detect.py uses it; 640 for a model
    built from a size name). Left at that, a file exported at a non-square size runs at its own
    (height, width), as detect.py runs it; another `size` is one side or an (h, w) pair, rounded up to
    multiples of 32. `model` is the inference backend (utils/backends) that runs it.
    """

    def __init__(self, model: InferenceBackend | nn.Module, task: Task, names: Sequence[str], size: int = 640) -> None:
        super().__init__()
        self.model = as_backend(model)
        self.task = task
        self.names = tuple(names)
        self._size, self._size_set = size, False  # until `size` is set, the file's own (h, w) (`_imgsz`)
        self.conf, self.iou, self.max_det = 0.25, 0.45, 1000
        self.classes: int | Sequence[int] | None = None  # one class id or several, as YOLOv5's hub models take
        self.agnostic = False

    @property
    def size(self) -> int | Sequence[int]:
        """The size to run at when a call gives none: one side or an (h, w) pair (see `_imgsz`)."""
        return self._size

    @size.setter
    def size(self, value: int | Sequence[int]) -> None:
        self._size, self._size_set = value, True

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, tasks: Mapping[str, Task], device: str = "", nms: bool = False
    ) -> Detector:
        """Load a checkpoint, or a .torchscript / .onnx file export.py wrote, for inference on `device`.

        Loaded through utils/backends, as detect.py loads it: a YOLOv5 / Ultralytics .pt is converted
        in memory. `tasks` maps a file's task to its Task (hubconf.py passes DETECT and SEGMENT). `size` starts at
        the size the checkpoint was trained at or the file was exported at.
        """
        backend = load_backend(
            Path(path), BackendRequest(task=None, script="hub", device=select_device(device), nms=nms)
        )
        if backend.info.task not in tasks:
            raise ConfigError(f"{path}: unknown task {backend.info.task!r}")
        return cls(backend, tasks[backend.info.task], backend.info.names, size=max(backend.info.imgsz))

    def forward(self, images: Any, size: int | Sequence[int] | None = None, augment: bool = False) -> list[ImageResult]:
        """Detect in a path, a list of paths, (H, W, 3) uint8 RGB numpy arrays or PIL images (or a list of them).

        Pass BGR arrays (OpenCV's) as `image[..., ::-1]`. An unreadable path raises ConfigError naming it.
        `augment`: test-time augmentation, as val.py's --augment (detection models only).
        """
        items = images if isinstance(images, list | tuple) else [images]
        imgsz = resolve_imgsz(self.model.info, self._imgsz(size))  # a fixed-size export refuses another size
        classes = None if self.classes is None else tuple(int(c) for c in np.atleast_1d(self.classes))
        if classes is not None and not all(0 <= c < len(self.names) for c in classes):
            raise ConfigError(f"classes {list(classes)}: the model has {len(self.names)} (0-{len(self.names) - 1})")
        config = PredictConfig(
            weights=Path(), source="", imgsz=imgsz, conf_thres=self.conf, iou_thres=self.iou,
            max_det=self.max_det, classes=classes, agnostic_nms=self.agnostic,
        )  # fmt: skip
        predictor = FramePredictor(AugmentedBackend(self.model) if augment else self.model, self.task, config)
        results = []
        for index, item in enumerate(items):
            source, bgr = _as_bgr(item, index)
            prediction, _, _ = predictor(bgr)
            results.append(
                ImageResult(source, bgr.shape[:2], *dataclasses.astuple(prediction)[:3], self.names, prediction.masks)
            )
        return results

    def _imgsz(self, size: int | Sequence[int] | None) -> tuple[int, int]:
        """The (h, w) to run at: `size` (one side or an (h, w) pair), else `self.size`.

        Until `self.size` is set, that means the file's own (h, w), as detect.py runs it without --imgsz.
        Sides are rounded up to multiples of the largest stride (64 for P6) with a warning, as YOLOv5's
        hub models round them; anything but one or two positive integers is a ConfigError.
        """
        if size is None and not self._size_set:
            return tuple(self.model.info.imgsz)  # type: ignore[return-value]
        value = self.size if size is None else size
        try:
            pair = value if isinstance(value, Sequence) else [value, value]
            sides = [operator.index(side) for side in pair]  # ints and numpy ints; not 1.5 or "640"
        except TypeError:
            sides = []
        if len(sides) != 2 or min(sides) < 1:
            raise ConfigError(f"size {value!r}: give a side in pixels, or an (h, w) pair of them")
        height, width = stride_multiples(sides, "size", self.model.info.stride)
        return height, width


def _as_bgr(item: Any, index: int) -> tuple[str, np.ndarray]:
    """(name, contiguous (H, W, 3) uint8 BGR array) of one input; the predictor works in OpenCV's order."""
    if isinstance(item, str | Path):
        try:
            return str(item), read_image(str(item))
        except UnreadableInputError as error:
            raise ConfigError(str(error)) from error
    if hasattr(item, "convert") and hasattr(item, "size"):  # a PIL image
        # Upright as its EXIF orientation says, as a path to the same file is decoded (cv2 applies it):
        # a phone photo opened with PIL is stored sideways and would otherwise get other boxes.
        item = _pil_rgb(ImageOps.exif_transpose(item), index)
    if isinstance(item, torch.Tensor):
        raise ConfigError("pass images as paths, numpy (H, W, 3) uint8 RGB arrays or PIL images, not tensors")
    array = np.asarray(item)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ConfigError(f"image {index}: expected an (H, W, 3) uint8 RGB array, got {array.shape} {array.dtype}")
    return f"image{index}", np.ascontiguousarray(array[..., ::-1])


def _pil_rgb(image: Any, index: int) -> np.ndarray:
    """A PIL image as (H, W, 3) uint8 RGB. 16-bit grey (modes I;16*, and I, as PIL opens such PNGs) keeps its
    high byte, as OpenCV decodes a 16-bit file from its path: PIL's convert("RGB") clips it to 255 (all white)."""
    if image.mode.startswith("I"):
        grey = (np.asarray(image).astype(np.int64).clip(0, 65535) >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if image.mode == "F":
        raise ConfigError(f"image {index}: a PIL image of 32-bit floats (mode F); convert it to 8 or 16 bits")
    return np.asarray(image.convert("RGB"))


def scratch_detector(name: str, task: Task, num_classes: int = 80, device: str = "") -> Detector:
    """A `task` model of size `name` (yolov5n, yolo11s, yolo26m-seg, ...) with random weights; nothing is downloaded."""
    spec = spec_from_cfg(name, num_classes)
    if task.with_masks and not spec.num_masks:
        spec = segmentation_spec(spec)
    model = build_model(spec).fuse().eval().to(select_device(device))
    return Detector(model, task, [f"class{i}" for i in range(num_classes)])
