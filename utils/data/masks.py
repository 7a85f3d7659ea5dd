"""Rasterise instance polygons (image pixels) into per-instance or overlap-index masks at image size / ratio.

Convention (exact, tested against hand-drawn grids): coordinates are continuous pixel-edge
coordinates, the image spans [0, W] x [0, H] and pixel (row j, column i) is the square
[i, i + 1] x [j, j + 1] with its centre at (i + 0.5, j + 0.5); this is how utils/data/augment.py and
utils/data/synthetic.py place polygons. At `ratio` r, mask pixel (j, i) is the image square
[r*i, r*(i + 1)] x [r*j, r*(j + 1)], and it is set exactly when its centre lies inside the polygon
(even-odd rule). A centre lying exactly on an edge counts as inside on a left or top edge and
outside on a right or bottom edge (the "top-left" rule), so two polygons that share an edge never
claim the same pixel and a w x h axis-aligned rectangle on pixel boundaries covers exactly w x h
pixels. The result is drawn directly at the low resolution (no full-size intermediate).

Why not cv2.fillPoly: it also draws the polygon's outline with Bresenham lines and rounds vertex
rows to whole pixels, so a 3 x 2 pixel rectangle comes out 4 x 3 (every object about one mask
pixel too large, 20% of the area of a 40 px object at ratio 4).
"""

from __future__ import annotations

import cv2
import numpy as np


def _mask_hw(height: int, width: int, ratio: int) -> tuple[int, int]:
    """Mask size (height // ratio, width // ratio); raises ValueError for a ratio below 1."""
    if ratio < 1:
        raise ValueError(f"mask ratio must be a positive integer, got {ratio}")
    return height // ratio, width // ratio


def _edge_crossings(polygons: list[np.ndarray], ratio: int, mask_h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each polygon edge crosses each mask row's centre line, for all polygons at once.

    Returns (owner, row, x) for every crossing: the polygon index, the mask row and the crossing's
    x in mask pixels. An edge counts row j when y0 <= j + 0.5 < y1 (its lower end excluded), so a
    vertex on a centre line is crossed once and horizontal edges never. Polygons with fewer than 3
    points contribute nothing.
    """
    kept = [(i, np.asarray(p, np.float64).reshape(-1, 2)) for i, p in enumerate(polygons) if len(p) >= 3]
    if not kept:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.float64)
    starts = np.concatenate([p for _, p in kept]) / ratio
    ends = np.concatenate([np.roll(p, -1, axis=0) for _, p in kept]) / ratio
    edge_owner = np.repeat([i for i, _ in kept], [len(p) for _, p in kept])
    low = np.minimum(starts[:, 1], ends[:, 1])
    high = np.maximum(starts[:, 1], ends[:, 1])
    first_row = np.clip(np.ceil(low - 0.5), 0, mask_h).astype(np.int64)
    stop_row = np.clip(np.ceil(high - 0.5), 0, mask_h).astype(np.int64)
    num_rows = np.maximum(stop_row - first_row, 0)
    edge = np.repeat(np.arange(len(starts)), num_rows)
    row = first_row[edge] + np.arange(len(edge)) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    p0, p1 = starts[edge], ends[edge]
    # num_rows > 0 implies p1.y != p0.y, so the division is safe.
    x = p0[:, 0] + (row + 0.5 - p0[:, 1]) * (p1[:, 0] - p0[:, 0]) / (p1[:, 1] - p0[:, 1])
    return edge_owner[edge], row, x


def _covered_pixels(polygons: list[np.ndarray], mask_h: int, mask_w: int, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """Every mask pixel each polygon covers: (owner (m,) polygon index, pixel (m,) flat index into (mask_h, mask_w)).

    Sorted along each row, a polygon's crossings pair up into inside spans (even-odd rule); a
    pixel is in a span when its centre is at or right of the entering crossing and left of the
    leaving one, i.e. its column is in [ceil(x_in - 0.5), ceil(x_out - 0.5)). Only covered pixels
    are listed, so the cost follows the objects' area, not the mask's.
    """
    owner, row, x = _edge_crossings(polygons, ratio, mask_h)
    column = np.clip(np.ceil(x - 0.5), 0, mask_w).astype(np.int64)
    order = np.lexsort((column, row, owner))
    # Every (polygon, row) has an even number of crossings, so global pairs never straddle two rows.
    enter, leave = order[0::2], order[1::2]
    lengths = column[leave] - column[enter]
    first = row[enter] * mask_w + column[enter]
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pixel = np.repeat(first, lengths) + np.arange(int(lengths.sum())) - offsets
    return np.repeat(owner[enter], lengths), pixel


def polygons_to_mask(polygons: list[np.ndarray], height: int, width: int, ratio: int = 1) -> np.ndarray:
    """Rasterise the union of `polygons` into one mask, uint8 0/1 (height // ratio, width // ratio).

    polygons: (k, 2) arrays of pixel (x, y) in an image of `height` x `width` (pixel-edge
    coordinates, see the module docstring); parts outside the image are cut off, polygons with
    fewer than 3 points are ignored.
    """
    mask_h, mask_w = _mask_hw(height, width, ratio)
    mask = np.zeros((mask_h, mask_w), np.uint8)
    mask.reshape(-1)[_covered_pixels(polygons, mask_h, mask_w, ratio)[1]] = 1
    return mask


def polygons_to_masks(polygons: list[np.ndarray], height: int, width: int, ratio: int = 1) -> np.ndarray:
    """Rasterise one mask per polygon: uint8 0/1 (n, height // ratio, width // ratio), row i from polygons[i].

    Coordinates as in `polygons_to_mask`; a polygon with fewer than 3 points, or entirely outside
    the image, gives an all-zero row (rows stay aligned with the input).
    """
    mask_h, mask_w = _mask_hw(height, width, ratio)
    masks = np.zeros((len(polygons), mask_h, mask_w), np.uint8)
    owner, pixel = _covered_pixels(polygons, mask_h, mask_w, ratio)
    masks.reshape(len(polygons), mask_h * mask_w)[owner, pixel] = 1
    return masks


def polygon_areas(polygons: list[np.ndarray]) -> np.ndarray:
    """Return the area of each polygon (n,) float64 by the shoelace formula (0 for fewer than 3 points)."""
    areas = np.zeros(len(polygons), np.float64)
    for i, polygon in enumerate(polygons):
        points = np.asarray(polygon, np.float64).reshape(-1, 2)
        if len(points) >= 3:
            x, y = points[:, 0], points[:, 1]
            areas[i] = abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2
    return areas


def covered_areas(points: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """An area (n,) float64 of each packed polygon (points (P, 2), polygon i the next counts[i] rows) that is 0
    only when it covers nothing: the absolute areas of the triangles fanned out from its first vertex, summed.

    The shoelace area of a self-intersecting polygon (a figure 8) cancels to 0 while the rasteriser
    and pycocotools fill both loops; this one does not. It is >= the true area (concave polygons
    count some triangles twice), which is what a test for degenerate, pixel-less polygons needs.
    """
    counts = np.asarray(counts, np.int64)
    areas = np.zeros(len(counts), np.float64)
    used = np.flatnonzero(counts > 0)
    if not len(used):
        return areas
    xy = np.asarray(points, np.float64).reshape(-1, 2)
    starts = np.cumsum(counts) - counts
    first = np.repeat(starts, counts)
    spoke = xy - xy[first]  # each vertex from its polygon's first one
    following = np.arange(len(xy)) + 1
    following[(starts + counts - 1)[used]] = starts[used]  # the last vertex's triangle closes on the first
    cross = np.abs(spoke[:, 0] * spoke[following, 1] - spoke[:, 1] * spoke[following, 0])
    areas[used] = np.add.reduceat(cross, starts[used]) / 2
    return areas


def polygons_to_overlap_mask(polygons: list[np.ndarray], height: int, width: int, ratio: int = 1) -> np.ndarray:
    """Rasterise all polygons into one index mask: int16 (1, height // ratio, width // ratio).

    A pixel holds i + 1 where polygon i covers it and 0 for background. Where polygons overlap,
    the one with the smaller polygon area (shoelace) wins, so a small object on top of a large
    one stays visible; on equal areas the lower index wins. No per-instance masks are built.
    Raises ValueError for more than 32767 polygons.
    """
    if len(polygons) > np.iinfo(np.int16).max:
        raise ValueError(f"overlap mask: {len(polygons)} instances do not fit int16 indices")
    mask_h, mask_w = _mask_hw(height, width, ratio)
    owner, pixel = _covered_pixels(polygons, mask_h, mask_w, ratio)
    smallest_first = np.argsort(polygon_areas(polygons), kind="stable")
    rank = np.empty(len(polygons), np.int64)
    rank[smallest_first] = np.arange(len(polygons))
    # For each pixel the lowest rank (smallest polygon) covering it; len(polygons) means none.
    best = np.full(mask_h * mask_w, len(polygons), np.int64)
    np.minimum.at(best, pixel, rank[owner])
    overlap = np.zeros(mask_h * mask_w, np.int16)
    covered = best < len(polygons)
    overlap[covered] = smallest_first[best[covered]] + 1
    return overlap.reshape(1, mask_h, mask_w)


def mask_outlines(mask: np.ndarray) -> list[np.ndarray]:
    """The outer outlines of a (H, W) mask's regions in pixel-edge coordinates: a list of (k, 2) int32 x, y.

    The inverse of the rasterising above: a region's outline runs along its pixels' outer edges, so
    pixel columns 30..39 give x from 30 to 40, and drawing the outline again gives back exactly the
    region's pixels (its holes filled; regions touching only at a corner share one outline, as
    8-connected pixels). cv2.findContours alone puts each boundary pixel at its index, which in these
    coordinates is its top-left corner: right and bottom edges come out a whole pixel short. So it
    traces the mask at twice the size, where pixel c is cells 2c and 2c + 1: a boundary cell u lies on
    edge (u + 1) // 2, the left or top edge of its pixel for an even u, the right or bottom one for an
    odd u, and the trace's steps between a pixel's two cells collapse onto one corner.
    """
    doubled = np.repeat(np.repeat(mask.astype(np.uint8) != 0, 2, axis=0), 2, axis=1).astype(np.uint8)
    contours, _ = cv2.findContours(doubled, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    return [_turns((contour.reshape(-1, 2) + 1) // 2) for contour in contours]


def _turns(points: np.ndarray) -> np.ndarray:
    """A closed outline's corners: repeated points and points inside a straight run left out, (k, 2) int32."""
    points = points[(points != np.roll(points, 1, axis=0)).any(axis=1)]
    if len(points) < 3:
        return points.astype(np.int32)
    incoming = np.sign(points - np.roll(points, 1, axis=0))
    outgoing = np.sign(np.roll(points, -1, axis=0) - points)
    return points[(incoming != outgoing).any(axis=1)].astype(np.int32)
