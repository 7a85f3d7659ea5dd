"""Polygon geometry for augmentation: clipping polygons to the image rectangle and their tight boxes."""

from __future__ import annotations

import numpy as np


def box_corners(boxes_xyxy: np.ndarray) -> np.ndarray:
    """Corners (n, 4, 2) of boxes (n, 4), clockwise from top-left in image coordinates."""
    return boxes_xyxy[:, [0, 1, 2, 1, 2, 3, 0, 3]].reshape(-1, 4, 2)  # (x1, y1) (x2, y1) (x2, y2) (x1, y2)


def packed_bounds(points: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Tight boxes (n, 4) xyxy of packed polygons (`counts[i]` vertices each, one after another); empty: zeros."""
    boxes = np.zeros((len(counts), 4), np.float32)
    nonempty = counts > 0
    if nonempty.any():
        points = points.astype(np.float32, copy=False)
        starts = np.concatenate([[0], np.cumsum(counts[nonempty])[:-1]])
        boxes[nonempty, :2] = np.minimum.reduceat(points, starts, axis=0)
        boxes[nonempty, 2:] = np.maximum.reduceat(points, starts, axis=0)
    return boxes


def pack(segments: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(points (P, 2) float32, counts (n,) int64) of a list of polygons."""
    counts = np.array([len(s) for s in segments], np.int64)
    if not counts.sum():
        return np.zeros((0, 2), np.float32), counts
    return np.concatenate([np.asarray(s, np.float32).reshape(-1, 2) for s in segments]), counts


def unpack(points: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """The polygons of packed (points, counts) as a list of views."""
    return np.split(points, np.cumsum(counts)[:-1]) if len(counts) else []


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges starts[i] .. starts[i] + counts[i] - 1: the rows of runs of packed rows."""
    return np.repeat(starts, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))


def gather(points: np.ndarray, counts: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed polygons `index` (any order, repeats allowed) of packed (points, counts)."""
    starts = np.cumsum(counts) - counts
    picked = counts[index]
    return points[ranges(starts[index], picked)], picked


def replace(
    points: np.ndarray, counts: np.ndarray, index: np.ndarray, new_points: np.ndarray, new_counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Packed polygons with polygons `index` (ascending) replaced by packed (new_points, new_counts), in that order."""
    replaced = np.zeros(len(counts), bool)
    replaced[index] = True
    owner = np.repeat(np.arange(len(counts)), counts)
    kept = ~replaced[owner]
    # The kept vertices, then the new ones; a stable sort by owner puts every polygon back in its place.
    order = np.argsort(np.concatenate([owner[kept], np.repeat(index, new_counts)]), kind="stable")
    counts = counts.copy()
    counts[index] = new_counts
    return np.concatenate([points[kept], new_points]).astype(np.float32, copy=False)[order], counts


def _previous_vertex(owner: np.ndarray, count: int) -> np.ndarray:
    """Index of each vertex's predecessor in packed polygons (vertices grouped by `owner`, cyclic per polygon)."""
    lengths = np.bincount(owner, minlength=count)
    ends = np.cumsum(lengths)
    previous = np.arange(len(owner)) - 1
    nonempty = lengths > 0
    previous[(ends - lengths)[nonempty]] = ends[nonempty] - 1  # a polygon's first vertex follows its last
    return previous


def _clip_half_plane(
    points: np.ndarray, owner: np.ndarray, count: int, axis: int, limit: float, keep_below: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One Sutherland-Hodgman pass over packed polygons: keep coordinate `axis` <= (or >=) `limit`.

    points: (N, 2) vertices of `count` polygons stored one after another; owner: (N,) polygon id.
    """
    coord = points[:, axis]
    inside = coord <= limit if keep_below else coord >= limit
    if inside.all():
        return points, owner
    previous = _previous_vertex(owner, count)
    prev_points = points[previous]
    crossing = inside != inside[previous]  # the edge previous -> current crosses the line
    delta = coord - prev_points[:, axis]
    t = np.divide(limit - prev_points[:, axis], delta, out=np.zeros_like(delta), where=crossing)
    hits = prev_points + t[:, None] * (points - prev_points)
    hits[:, axis] = limit  # exact, so clipped points never stray outside by rounding
    # Each edge emits [its crossing point if it crosses, its end vertex if inside], in that order.
    emit = np.stack([crossing, inside], axis=1).reshape(-1)
    return np.stack([hits, points], axis=1).reshape(-1, 2)[emit], np.repeat(owner, 2)[emit]


def _clip_owned(
    points: np.ndarray, owner: np.ndarray, count: int, width: float, height: float
) -> tuple[np.ndarray, np.ndarray]:
    """Clip the packed polygons `owner` names to [0, width] x [0, height] in 4 vectorised passes; (points, owner).

    A polygon of fewer than 3 points is dropped; from 3 up a pass yields 0 or >= 3 (crossings come in pairs).
    """
    lengths = np.bincount(owner, minlength=count)
    is_polygon = (lengths >= 3)[owner]
    points, owner = points[is_polygon].astype(np.float32), owner[is_polygon]
    for axis, limit, keep_below in ((0, 0.0, False), (0, width, True), (1, 0.0, False), (1, height, True)):
        points, owner = _clip_half_plane(points, owner, count, axis, float(limit), keep_below)
    # Interpolated coordinates of a later pass can overshoot an earlier edge by one float ulp.
    points = np.clip(points, 0.0, np.array([width, height], np.float32)).astype(np.float32)
    remaining = np.bincount(owner, minlength=count)
    keep = (remaining >= 3)[owner]
    return points[keep], owner[keep]


def clip_packed(
    points: np.ndarray, counts: np.ndarray, width: float, height: float, bounds: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clip packed polygons to the image: (points, counts, tight boxes (n, 4)); emptied ones get count 0, box 0.

    `bounds`: their `packed_bounds`, when the caller has them. Only polygons that cross the border
    (or have < 3 points) go through the clipper, and only their boxes are recomputed.
    """
    bounds = packed_bounds(points, counts) if bounds is None else bounds
    inside = (bounds[:, :2] >= 0).all(axis=1) & (bounds[:, 2] <= width) & (bounds[:, 3] <= height) & (counts >= 3)
    boxes = bounds.astype(np.float32, copy=True)
    if inside.all():
        return points, counts, boxes
    # Polygons wholly beyond one edge (most of a mosaic's after the warp) are emptied without clipping.
    beyond = (bounds[:, 2] < 0) | (bounds[:, 0] > width) | (bounds[:, 3] < 0) | (bounds[:, 1] > height)
    cut = ~inside & ~beyond
    owner = np.repeat(np.arange(len(counts)), counts)
    crossing = cut[owner]
    clipped, clipped_owner = _clip_owned(points[crossing], owner[crossing], len(counts), width, height)
    outside = np.flatnonzero(~inside)
    clipped_counts = np.bincount(clipped_owner, minlength=len(counts))[outside]
    boxes[outside] = packed_bounds(clipped, clipped_counts)
    return (*replace(points, counts, outside, clipped, clipped_counts), boxes)


def clip_polygon(poly: np.ndarray, width: float, height: float) -> np.ndarray:
    """Clip a polygon (k, 2) pixels to the image rectangle [0, width] x [0, height] (Sutherland-Hodgman).

    Returns the clipped polygon (m, 2) float32, or an empty (0, 2) array when less than a
    triangle is left (fully outside or degenerate).
    """
    points, _, _ = clip_packed(*pack([poly]), width, height)
    return points if len(points) >= 3 else np.zeros((0, 2), np.float32)
