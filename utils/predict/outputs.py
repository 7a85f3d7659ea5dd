"""What a prediction run writes: annotated images and videos, YOLO-format labels/*.txt, crops/<class>/*.jpg."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from utils.boxes import xyxy_to_xywhn
from utils.data.cache import opencv_can_name
from utils.data.masks import mask_outlines
from utils.predict.config import SaveOptions
from utils.predict.prediction import Prediction, class_name

CROP_GAIN, CROP_PAD = 1.02, 10  # crops are the box grown by 2% and 10 px a side (YOLOv5's save_one_box)


def mask_polygon(mask: np.ndarray) -> np.ndarray:
    """Return the outline of the largest region of a (H, W) bool mask as (k, 2) float32 pixel x, y; (0, 2) if empty.

    Along the pixels' outer edges (utils/data/masks.py: mask_outlines), so a saved label drawn again
    covers the mask's pixels. Largest by area: with simplified contours a square region has 4 points
    and a small round blob dozens, so the point count would pick the blob.
    """
    contours = mask_outlines(mask)
    if not contours:
        return np.zeros((0, 2), np.float32)
    largest = max(contours, key=lambda contour: (cv2.contourArea(contour), len(contour)))  # ties: the longer
    return largest.astype(np.float32)


def txt_lines(prediction: Prediction, image_hw: tuple[int, int], with_conf: bool) -> list[str]:
    """YOLO-format lines of one image's detections, coordinates normalised to [0, 1] by the image size.

    Detection: `class cx cy w h [conf]`. Segmentation (masks present): `class x1 y1 x2 y2 ... [conf]`,
    the outline of the mask's largest region; a mask with fewer than 3 outline points (empty
    after thresholding) falls back to the box's four corners, so every line stays a polygon.
    """
    height, width = image_hw
    lines = []
    for index in range(len(prediction)):
        box = prediction.boxes_xyxy[index]
        if prediction.masks is None:
            coords = xyxy_to_xywhn(box[None].astype(np.float64), width, height, clip=True)[0]
        else:
            polygon = mask_polygon(prediction.masks[index])
            if len(polygon) < 3:
                polygon = np.array([[box[0], box[1]], [box[2], box[1]], [box[2], box[3]], [box[0], box[3]]])
            coords = (polygon / np.array([width, height])).clip(0, 1).reshape(-1)
        fields = [str(int(prediction.class_ids[index])), *(f"{value:.6f}" for value in coords)]
        if with_conf:
            fields.append(f"{float(prediction.scores[index]):.5f}")
        lines.append(" ".join(fields))
    return lines


def crop_box(image: np.ndarray, box_xyxy: np.ndarray) -> np.ndarray:
    """Return a copy of the image region of one box, grown by CROP_GAIN and CROP_PAD and clipped to the image."""
    height, width = image.shape[:2]
    cx, cy = (box_xyxy[0] + box_xyxy[2]) / 2, (box_xyxy[1] + box_xyxy[3]) / 2
    half_w = (box_xyxy[2] - box_xyxy[0]) * CROP_GAIN / 2 + CROP_PAD
    half_h = (box_xyxy[3] - box_xyxy[1]) * CROP_GAIN / 2 + CROP_PAD
    x1, x2 = int(max(cx - half_w, 0)), int(min(cx + half_w, width))
    y1, y2 = int(max(cy - half_h, 0)), int(min(cy + half_h, height))
    return image[y1:y2, x1:x2].copy()


# Suffixes an annotated image keeps: 8-bit formats OpenCV writes. Others (.mpo, .dng: no encoder; .pfm: float) -> .jpg.
KEPT_OUTPUT_SUFFIXES = frozenset({".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp"})


def annotated_suffix(input_suffix: str) -> str:
    """The suffix of an input image's annotated copy: the input's own when OpenCV writes it as 8-bit, else .jpg."""
    return input_suffix if input_suffix.lower() in KEPT_OUTPUT_SUFFIXES else ".jpg"


def write_image(path: Path, image: np.ndarray) -> None:
    """Write a BGR image, encoded by OpenCV (format from the suffix); raise OSError when it cannot be written.

    OpenCV encodes and Python writes the bytes: cv2.imwrite takes the name as UTF-8, and a name that
    is not (an input's, held with surrogate escapes) crashes the process inside it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        encoded, data = cv2.imencode(path.suffix or ".jpg", image)
    except cv2.error:
        encoded = False
    if not encoded:
        raise OSError(f"{path}: could not encode the image (a suffix OpenCV cannot encode?)")
    path.write_bytes(data.tobytes())


class RunWriter:
    """Writes one rank's outputs into the shared run folder; file names are per input, so ranks never collide.

    Every rank writes the inputs it predicted (shards are disjoint). Folders are created on first
    use with exist_ok, which is safe when ranks race to create the same crops/<class>/ folder.
    """

    def __init__(self, save_dir: Path, names: Sequence[str], options: SaveOptions) -> None:
        self.save_dir = save_dir
        self.names = names
        self.options = options
        self.labels_written = 0

    def save_labels(self, stem: str, prediction: Prediction, image_hw: tuple[int, int]) -> None:
        """With --save-txt, write labels/<stem>.txt (an empty file for an image without detections)."""
        if not self.options.save_txt:
            return
        lines = txt_lines(prediction, image_hw, self.options.save_conf)
        path = self.save_dir / "labels" / f"{stem}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{line}\n" for line in lines))
        self.labels_written += 1

    def save_crops(self, stem: str, image: np.ndarray, prediction: Prediction) -> None:
        """With --save-crop, write each detection's region of the unannotated image to crops/<class>/<stem>_<k>.jpg."""
        if not self.options.save_crop:
            return
        for index in range(len(prediction)):
            name = class_name(self.names, int(prediction.class_ids[index]))
            crop = crop_box(image, prediction.boxes_xyxy[index])
            if crop.size:
                write_image(self.save_dir / "crops" / name / f"{stem}_{index}.jpg", crop)


class VideoSink:
    """An mp4v video file opened on its first frame (whose size it takes); a context manager that closes it."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path = path
        self.fps = fps
        self.writer: cv2.VideoWriter | None = None
        self.frames = 0

    def write(self, frame: np.ndarray) -> None:
        """Append one (H, W, 3) uint8 BGR frame; the first frame fixes the video's size."""
        if self.writer is None:
            if not opencv_can_name(self.path):
                raise OSError(f"{self.path}: OpenCV cannot write a video under a name that is not valid UTF-8")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            height, width = frame.shape[:2]
            self.writer = cv2.VideoWriter(str(self.path), cv2.VideoWriter_fourcc(*"mp4v"), self.fps, (width, height))
            if not self.writer.isOpened():
                raise OSError(f"{self.path}: OpenCV cannot write an mp4v video here")
        self.writer.write(frame)
        self.frames += 1

    def __enter__(self) -> VideoSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.writer is not None:
            self.writer.release()
