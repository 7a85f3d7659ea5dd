"""COCO segmentations as one polygon per object: multi-part polygons joined, RLE masks traced."""

from __future__ import annotations

from typing import Any

import numpy as np

from utils.data.masks import mask_outlines


def join_parts(parts: list[np.ndarray]) -> np.ndarray:
    """Join the parts of one object (each (k, 2), k >= 3) into a single polygon (m, 2), as YOLOv5's converter does.

    A YOLO polygon row holds one outline, while COCO splits an occluded object into several
    parts. Consecutive parts are linked at their closest pair of vertices; the outline walks
    forward through part 0 (all of it), part 1 from where it is entered to where it leaves for
    part 2, ..., all of the last part, then back through the middle parts' other halves. Every
    vertex is kept and each link is crossed once each way, so the connecting lines have no area:
    the rasterised mask is the union of the parts (plus hairline links).
    """
    if len(parts) == 1:
        return parts[0]
    links = [_closest_vertices(first, second) for first, second in zip(parts[:-1], parts[1:], strict=True)]
    forward: list[np.ndarray] = []
    backward: list[np.ndarray] = []
    last = len(parts) - 1
    for i, part in enumerate(parts):
        enter = links[i - 1][1] if i > 0 else links[0][0]  # part 0 starts and ends where it leaves for part 1
        ring = np.concatenate([part[enter:], part[:enter]])  # the vertices from the one where the walk enters
        if i in (0, last):
            forward += [ring, ring[:1]]  # all the way round, back to the entry vertex
            continue
        split = (links[i][0] - enter) % len(part)  # where the walk leaves for part i + 1
        forward.append(ring[: split + 1])
        backward.append(np.concatenate([ring[split:], ring[:1]]))
    return np.concatenate(forward + backward[::-1])


def object_outline(parts: list[np.ndarray]) -> np.ndarray:
    """One polygon (m, 2) for the parts of one COCO object: `join_parts` when they are disjoint.

    Parts that overlap cannot be joined: the single outline covers their shared area twice, and the
    even-odd fill of a polygon leaves it empty, a hole where COCO (pycocotools, the union) has the
    object. Those are drawn as pycocotools draws them, on a canvas around the parts, and the union's
    outlines (along pixel edges, masks.mask_outlines) are joined instead.
    """
    if len(parts) < 2:
        return join_parts(parts)
    from pycocotools import mask as mask_utils

    points = np.concatenate(parts)
    corner = np.floor(points.min(axis=0)) - 1
    width, height = (np.ceil(points.max(axis=0)) - corner + 2).astype(int)
    rles = mask_utils.frPyObjects([(part - corner).reshape(-1).tolist() for part in parts], int(height), int(width))
    union = mask_utils.merge(rles)
    if mask_utils.area(union) >= mask_utils.area(rles).sum():
        return join_parts(parts)
    outlines = [outline + corner for outline in mask_outlines(mask_utils.decode(union)) if len(outline) >= 3]
    return join_parts(outlines)


def _closest_vertices(first: np.ndarray, second: np.ndarray) -> tuple[int, int]:
    """Indices (i, j) of the closest pair of vertices first[i], second[j]."""
    dx = first[:, 0, None] - second[None, :, 0]
    dy = first[:, 1, None] - second[None, :, 1]
    best = int(np.argmin(dx * dx + dy * dy))
    return best // len(second), best % len(second)


def polygon_parts(segmentation: list[Any]) -> list[np.ndarray]:
    """The parts (k, 2) float64 of a COCO polygon segmentation ([[x1, y1, x2, y2, ...], ...] in pixels).

    Parts with fewer than 3 points are left out. Raises ValueError when a part is not a flat
    list of numbers of even length.
    """
    parts = []
    for part in segmentation:
        try:
            points = np.asarray(part, np.float64)
        except (TypeError, ValueError) as error:
            raise ValueError("a polygon holds a value that is not a number") from error
        if points.ndim != 1 or len(points) % 2:
            raise ValueError("a polygon is not a flat list of x, y numbers")
        if len(points) >= 6:
            parts.append(points.reshape(-1, 2))
    return parts


def rle_to_polygon(rle: dict[str, Any]) -> np.ndarray:
    """Trace an RLE mask ({"size": [h, w], "counts": list or str}) into one polygon (k, 2) float64 pixels.

    The outer outlines of the mask's regions along their pixels' edges (masks.mask_outlines: the
    polygon drawn again gives back the RLE's pixels) are joined with join_parts; an empty mask gives
    (0, 2). Done once, when the JSON is read.
    Raises ValueError for a malformed RLE.
    """
    from pycocotools import mask as mask_utils

    size = rle.get("size")
    counts = rle.get("counts")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise ValueError("RLE 'size' is not [height, width]")
    if not isinstance(counts, list | str):
        raise ValueError("RLE 'counts' is neither a list nor a string")
    height, width = size
    try:
        if isinstance(counts, list):
            encoded = mask_utils.frPyObjects({"size": size, "counts": counts}, height, width)
        else:
            encoded = {"size": size, "counts": counts.encode("ascii")}
        mask = np.ascontiguousarray(mask_utils.decode(encoded))
    except Exception as error:  # pycocotools raises assorted types for bad counts
        raise ValueError(f"RLE cannot be decoded ({type(error).__name__})") from error
    parts = [outline.astype(np.float64) for outline in mask_outlines(mask) if len(outline) >= 3]
    return join_parts(parts) if parts else np.zeros((0, 2), np.float64)
