"""Polygon geometry for augmentation: clipping polygons to the image rectangle and their tight boxes."""

from __future__ import annotations

import numpy as np


def box_corners(boxes_xyxy: np.ndarray) -> np.ndarray:
    """Corners (n, 4, 2) of boxes (n, 4), clockwise from top-left in image coordinates."""
    return boxes_xyxy[:, [0, 1, 2, 1, 2, 3, 0, 3]].reshape(-1, 4, 2)  # (x1, y1) (x2, y1) (x2, y2) (x1, y2)


def polygon_bounds(segments: list[np.ndarray]) -> np.ndarray:
    """Tight boxes (n, 4) xyxy of polygons; an empty polygon gets an all-zero box."""
    boxes = np.zeros((len(segments), 4), np.float32)
    lengths = np.array([len(s) for s in segments], np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        points = np.concatenate([s for s in segments if len(s)]).astype(np.float32)
        starts = np.concatenate([[0], np.cumsum(lengths[nonempty])[:-1]])
        boxes[nonempty, :2] = np.minimum.reduceat(points, starts, axis=0)
        boxes[nonempty, 2:] = np.maximum.reduceat(points, starts, axis=0)
    return boxes


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


def _clip_polygons(segments: list[np.ndarray], width: float, height: float) -> list[np.ndarray]:
    """Clip many polygons to [0, width] x [0, height] in 4 vectorised passes (no loop over polygons)."""
    count = len(segments)
    if count == 0:
        return []
    lengths = np.array([len(s) for s in segments], np.int64)
    points = np.concatenate([np.asarray(s, np.float32).reshape(-1, 2) for s in segments])
    owner = np.repeat(np.arange(count), lengths)
    # Fewer than 3 points is no polygon. From 3 up, a pass yields 0 or >= 3 (crossings come in pairs).
    is_polygon = (lengths >= 3)[owner]
    points, owner = points[is_polygon], owner[is_polygon]
    for axis, limit, keep_below in ((0, 0.0, False), (0, width, True), (1, 0.0, False), (1, height, True)):
        points, owner = _clip_half_plane(points, owner, count, axis, float(limit), keep_below)
    # Interpolated coordinates of a later pass can overshoot an earlier edge by one float ulp.
    points = np.clip(points, 0.0, np.array([width, height], np.float32)).astype(np.float32)
    parts = np.split(points, np.cumsum(np.bincount(owner, minlength=count))[:-1])
    return [part if len(part) >= 3 else np.zeros((0, 2), np.float32) for part in parts]


def clip_polygon(poly: np.ndarray, width: float, height: float) -> np.ndarray:
    """Clip a polygon (k, 2) pixels to the image rectangle [0, width] x [0, height] (Sutherland-Hodgman).

    Returns the clipped polygon (m, 2) float32, or an empty (0, 2) array when less than a
    triangle is left (fully outside or degenerate).
    """
    return _clip_polygons([poly], width, height)[0]


def clip_segments(
    segments: list[np.ndarray], width: int, height: int, bounds: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Clip polygons to the image; return (clipped polygons, their tight boxes (n, 4)); empty ones get zero boxes.

    `bounds`: the polygons' `polygon_bounds`, when the caller has them. Only polygons that cross
    the border (or have < 3 points) go through the clipper, and only their boxes are recomputed.
    """
    bounds = polygon_bounds(segments) if bounds is None else bounds
    inside = (bounds[:, :2] >= 0).all(axis=1) & (bounds[:, 2] <= width) & (bounds[:, 3] <= height)
    outside = np.flatnonzero(~inside | (np.array([len(s) for s in segments]) < 3))
    clipped, boxes = list(segments), bounds.astype(np.float32, copy=True)
    if len(outside):
        parts = _clip_polygons([segments[i] for i in outside], width, height)
        for i, part in zip(outside, parts, strict=True):
            clipped[i] = part
        boxes[outside] = polygon_bounds(parts)
    return clipped, boxes
