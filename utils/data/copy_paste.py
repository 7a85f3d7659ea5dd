"""YOLOv5's segment copy-paste: mirrored objects pasted onto the mosaic canvas where they hide little."""

from __future__ import annotations

import numpy as np

from utils.data.augment import Instances, MosaicCanvas, flip_lr
from utils.data.masks import polygons_to_mask

COPY_PASTE_MAX_OVERLAP = 0.30  # a pasted copy may hide at most this share of any existing box (YOLOv5)
_EPS = 1e-9


def is_box_outline(corners: np.ndarray) -> np.ndarray:
    """Which 4-point polygons (n, 4, 2) are axis-aligned rectangles: (n,) bool.

    A box-only label reaches augmentation as its 4 box corners (utils/data/labels.py), so such a
    polygon says nothing about the object's shape; a real outline with exactly these 4 corners is
    indistinguishable and treated the same.
    """
    corners = np.asarray(corners).reshape(-1, 4, 2)
    low, high = corners.min(axis=1, keepdims=True), corners.max(axis=1, keepdims=True)
    return ((corners == low) | (corners == high)).all(axis=(1, 2))


def _outlined(segments: list[np.ndarray]) -> np.ndarray:
    """Indices of the instances whose polygon is a real outline (not a box-only label's 4 corners)."""
    lengths = np.array([len(segment) for segment in segments], np.int64)
    outlined = lengths >= 3
    four = np.flatnonzero(lengths == 4)
    if len(four):
        outlined[four] = ~is_box_outline(np.stack([segments[i] for i in four]))
    return np.flatnonzero(outlined)


def _intersection_over_area(box_xyxy: np.ndarray, boxes_xyxy: np.ndarray) -> np.ndarray:
    """(n,) share of each of `boxes_xyxy` (n, 4) that `box_xyxy` (4,) covers: intersection / that box's area."""
    low = np.maximum(box_xyxy[:2], boxes_xyxy[:, :2])
    high = np.minimum(box_xyxy[2:], boxes_xyxy[:, 2:])
    intersection = (high - low).clip(min=0).prod(axis=1)
    return intersection / ((boxes_xyxy[:, 2:] - boxes_xyxy[:, :2]).prod(axis=1) + _EPS)


def copy_paste(
    image: np.ndarray | MosaicCanvas, inst: Instances, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray | MosaicCanvas, Instances]:
    """YOLOv5's segment copy-paste: mirror some objects left-right and paste them where they hide little.

    Of the n instances with a real polygon outline (box-only labels are skipped: pasting their
    box would paste background), round(fraction * n) are drawn at random. Each is mirrored about
    the image's vertical centre line (x -> W - x) and kept only when its mirrored box covers less
    than COPY_PASTE_MAX_OVERLAP of every box already present, earlier pastes included. The image
    then takes the left-right flipped image's pixels inside the kept mirrored polygons (pixel
    centres inside, as utils/data/masks.py rasterises), and the mirrored instances are appended.
    YOLOv5 applies it to the mosaic canvas before random_perspective. image: (H, W, 3) uint8;
    `inst` in its pixels. Returns a new image, or the inputs themselves (no random numbers
    drawn) when `fraction` is 0 or there is nothing to pick. An undrawn MosaicCanvas is drawn
    only when something is pasted.
    """
    candidates = _outlined(inst.segments) if fraction > 0 else np.zeros(0, np.int64)
    count = min(round(fraction * len(candidates)), len(candidates))
    if count == 0:
        return image, inst
    if isinstance(image, MosaicCanvas):
        image = image.draw()
    flipped, mirrored = flip_lr(image, inst)
    boxes, kept = inst.boxes_xyxy, []
    for j in rng.choice(candidates, size=count, replace=False).tolist():
        box = mirrored.boxes_xyxy[j]
        if (_intersection_over_area(box, boxes) < COPY_PASTE_MAX_OVERLAP).all():
            boxes = np.concatenate([boxes, box[None]])
            kept.append(j)
    if not kept:
        return image, inst
    pasted = mirrored.select(np.array(kept, np.int64))
    inside = polygons_to_mask(pasted.segments, image.shape[0], image.shape[1]).astype(bool)
    out = image.copy()
    out[inside] = flipped[inside]
    return out, Instances.concat([inst, pasted])
