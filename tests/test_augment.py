"""Tests for utils/data/augment.py: geometry of every augmentation, pixel/box agreement and determinism."""

from __future__ import annotations

from collections.abc import Callable

import cv2
import numpy as np
import pytest

from utils.data.augment import (
    AugmentParams,
    Instances,
    bgr_to_rgb_chw,
    flip_lr,
    flip_ud,
    instances_to_labels,
    letterbox,
    mixup,
    mosaic4,
    random_perspective,
    transform_instances,
)
from utils.data.colour import apply_hsv, draw_hsv_gains
from utils.data.polygons import clip_packed, clip_polygon, pack, unpack

GREY = 114
# Corners of the RGB cube: far from the grey background and from every grey/colour blend of another.
PALETTE = np.array(
    [[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [255, 0, 255], [0, 255, 255], [0, 0, 0], [255, 255, 255]],
    np.uint8,
)


def _area(poly: np.ndarray) -> float:
    x, y = poly[:, 0].astype(np.float64), poly[:, 1].astype(np.float64)
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


def _cells(height: int, width: int, count: int) -> list[tuple[int, int, int, int]]:
    """Non-overlapping grid cells (x0, y0, x1, y1) so shapes never occlude each other."""
    cols = int(np.ceil(np.sqrt(count)))
    rows = int(np.ceil(count / cols))
    cell_w, cell_h = width // cols, height // rows
    return [(c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h) for r in range(rows) for c in range(cols)][
        :count
    ]


def _scene(
    rng: np.random.Generator, height: int, width: int, class_ids: list[int], polygons: bool
) -> tuple[np.ndarray, Instances]:
    """Grey image with one filled shape per class id (colour PALETTE[id]); rectangles or convex polygons."""
    image = np.full((height, width, 3), GREY, np.uint8)
    boxes, segments = [], []
    for class_id, (x0, y0, x1, y1) in zip(class_ids, _cells(height, width, len(class_ids)), strict=True):
        margin_x, margin_y = (x1 - x0) // 8 + 1, (y1 - y0) // 8 + 1
        if polygons:
            points = rng.uniform([x0 + margin_x, y0 + margin_y], [x1 - margin_x, y1 - margin_y], (8, 2))
            poly = cv2.convexHull(np.round(points).astype(np.int32)).reshape(-1, 2)
            cv2.fillPoly(image, [poly], PALETTE[class_id].tolist())
            poly = poly.astype(np.float32)
        else:
            bx0, by0 = rng.integers([x0 + 1, y0 + 1], [x0 + margin_x + 1, y0 + margin_y + 1])
            bx1, by1 = rng.integers([x1 - margin_x, y1 - margin_y], [x1, y1])
            image[by0:by1, bx0:bx1] = PALETTE[class_id]  # pixels [bx0, bx1) cover the box [bx0, bx1] exactly
            poly = np.array([[bx0, by0], [bx1, by0], [bx1, by1], [bx0, by1]], np.float32)
        segments.append(poly)
        boxes.append([*poly.min(0), *poly.max(0)])
    inst = Instances.from_segments(
        np.array(class_ids, np.float32), np.array(boxes, np.float32).reshape(-1, 4), segments
    )
    return image, inst


def _colour_index(image: np.ndarray) -> np.ndarray:
    """Per pixel, the nearest palette index (or -1 for grey): the 50% crossing marks a shape's edge."""
    palette = np.concatenate([PALETTE, [[GREY, GREY, GREY]]]).astype(np.int32)
    distance = ((image[:, :, None, :].astype(np.int32) - palette) ** 2).sum(-1)
    nearest = distance.argmin(-1)
    return np.where(nearest == len(PALETTE), -1, nearest)


def _assert_consistent(image: np.ndarray, inst: Instances) -> None:
    """Boxes inside the image, tight around their (clipped) polygons, all three arrays aligned."""
    height, width = image.shape[:2]
    assert image.dtype == np.uint8 and image.ndim == 3
    assert inst.classes.dtype == np.float32 and inst.boxes_xyxy.dtype == np.float32
    assert len(inst.classes) == len(inst.boxes_xyxy) == len(inst.segments)
    boxes = inst.boxes_xyxy
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
    assert (boxes[:, 2:] > boxes[:, :2]).all()
    for box, poly in zip(boxes, inst.segments, strict=True):
        assert poly.ndim == 2 and poly.shape[1] == 2 and len(poly) >= 3
        assert (poly >= 0).all() and (poly[:, 0] <= width).all() and (poly[:, 1] <= height).all()
        np.testing.assert_allclose(box, [*poly.min(0), *poly.max(0)], atol=1.0)


def _assert_pixels_follow_boxes(image: np.ndarray, inst: Instances, atol: float = 2.0) -> None:
    """Each box matches the bounding box of the pixels of its class colour, and its centre has that colour."""
    index = _colour_index(image)
    assert len(inst) > 0
    for class_id, box in zip(inst.classes.astype(int), inst.boxes_xyxy, strict=True):
        ys, xs = np.nonzero(index == class_id)
        assert len(xs) > 0, f"class {class_id} has a box but no pixels"
        np.testing.assert_allclose(box, [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], atol=atol)


def _assert_centres_coloured(image: np.ndarray, inst: Instances) -> None:
    """The centroid of each (convex, clipped) polygon lies on pixels of that instance's colour."""
    index = _colour_index(image)
    for class_id, box, poly in zip(inst.classes.astype(int), inst.boxes_xyxy, inst.segments, strict=True):
        if (box[2:] - box[:2]).min() < 8:
            continue  # too thin for a robust centre probe
        cx, cy = poly.mean(0).astype(int)
        patch = index[max(cy - 1, 0) : cy + 2, max(cx - 1, 0) : cx + 2]
        assert (patch == class_id).mean() > 0.5, f"class {class_id} centre shows {np.unique(patch)}"


# ---------------------------------------------------------------- letterbox / transform / clip


@pytest.mark.parametrize(
    ("hw", "new_shape", "scaleup", "ratio", "pad", "out_hw"),
    [
        ((100, 200), 64, True, 0.32, (0.0, 16.0), (64, 64)),  # landscape: pad top/bottom
        ((200, 100), 64, True, 0.32, (16.0, 0.0), (64, 64)),  # portrait: pad left/right
        ((20, 40), 64, False, 1.0, (12.0, 22.0), (64, 64)),  # no upscaling: centred, padded
        ((20, 40), 64, True, 1.6, (0.0, 16.0), (64, 64)),
        ((100, 150), 64, True, 64 / 150, (0.0, 10.5), (64, 64)),  # odd padding: 10 top, 11 bottom
        ((100, 200), (48, 64), True, 0.32, (0.0, 8.0), (48, 64)),  # tuple is (h, w)
    ],
)
def test_letterbox_geometry(
    hw: tuple[int, int],
    new_shape: int | tuple[int, int],
    scaleup: bool,
    ratio: float,
    pad: tuple[float, float],
    out_hw: tuple[int, int],
) -> None:
    image = np.zeros((*hw, 3), np.uint8)
    out, (ratio_w, ratio_h), (pad_w, pad_h) = letterbox(image, new_shape, scaleup=scaleup)
    assert out.shape == (*out_hw, 3) and out.dtype == np.uint8
    assert ratio_w == pytest.approx(ratio, abs=0.01) and ratio_h == pytest.approx(ratio, abs=0.01)
    assert (pad_w, pad_h) == pad
    top, left = round(pad_h - 0.1), round(pad_w - 0.1)
    content_h, content_w = round(hw[0] * ratio_h), round(hw[1] * ratio_w)
    content = np.zeros(out.shape[:2], bool)
    content[top : top + content_h, left : left + content_w] = True
    assert (out[content] == 0).all()
    assert (out[~content] == GREY).all()
    assert content_w + 2 * pad_w == out_hw[1] and content_h + 2 * pad_h == out_hw[0]


def test_letterbox_auto_pads_to_stride_and_returns_new_array() -> None:
    image = np.zeros((100, 200, 3), np.uint8)
    out, _, pad = letterbox(image, 64, auto=True, stride=32)
    assert out.shape == (32, 64, 3) and pad == (0.0, 0.0)
    same, ratio, pad = letterbox(np.zeros((64, 64, 3), np.uint8), 64)
    assert ratio == (1.0, 1.0) and pad == (0.0, 0.0)
    assert not np.shares_memory(same, image)


def test_transform_instances_scales_and_shifts_everything() -> None:
    inst = Instances.from_segments(
        np.array([3.0], np.float32),
        np.array([[10, 20, 30, 40]], np.float32),
        [np.array([[10, 20], [30, 40], [10, 40]], np.float32)],
    )
    out = transform_instances(inst, (0.5, 2.0), (4.0, 1.0))
    np.testing.assert_allclose(out.boxes_xyxy, [[9, 41, 19, 81]])
    np.testing.assert_allclose(out.segments[0], [[9, 41], [19, 81], [9, 81]])
    assert out.classes.tolist() == [3.0]
    np.testing.assert_allclose(inst.boxes_xyxy, [[10, 20, 30, 40]])  # input untouched


def test_clip_polygon_hand_cases() -> None:
    inside = np.array([[1, 1], [5, 1], [5, 5], [1, 5]], np.float32)
    np.testing.assert_allclose(clip_polygon(inside, 10, 10), inside)

    left_out = np.array([[-5, 2], [5, 2], [5, 8], [-5, 8]], np.float32)
    clipped = clip_polygon(left_out, 10, 10)
    assert _area(clipped) == pytest.approx(30.0)
    np.testing.assert_allclose([*clipped.min(0), *clipped.max(0)], [0, 2, 5, 8])

    # Triangle poking out at the bottom-right corner: the 4x4 square [6, 10]^2 minus the tip beyond x + y = 18.
    triangle = np.array([[6, 6], [12, 6], [6, 12]], np.float32)
    clipped = clip_polygon(triangle, 10, 10)
    assert _area(clipped) == pytest.approx(16.0 - 2.0)
    assert len(clipped) == 5 and (clipped <= 10).all() and (clipped >= 6).all()
    assert {(10.0, 8.0), (8.0, 10.0)} <= {tuple(p) for p in clipped.tolist()}

    cover = np.array([[-5, -5], [20, -5], [20, 20], [-5, 20]], np.float32)
    assert _area(clip_polygon(cover, 10, 8)) == pytest.approx(80.0)

    outside = np.array([[11, 1], [15, 1], [15, 5]], np.float32)
    assert clip_polygon(outside, 10, 10).shape == (0, 2)
    assert clip_polygon(np.array([[-3, -3], [-1, -3], [-1, 12]], np.float32), 10, 10).shape == (0, 2)


def test_clip_polygon_matches_convex_intersection() -> None:
    rng = np.random.default_rng(0)
    rect = np.array([[0, 0], [40, 0], [40, 30], [0, 30]], np.float32)
    for _ in range(200):
        hull = cv2.convexHull(rng.uniform(-30, 70, (rng.integers(3, 9), 2)).astype(np.float32)).reshape(-1, 2)
        expected, _ = cv2.intersectConvexConvex(hull, rect)
        clipped = clip_polygon(hull, 40, 30)
        assert (_area(clipped) if len(clipped) else 0.0) == pytest.approx(max(expected, 0.0), abs=1e-2)
        assert (clipped >= 0).all() and (clipped[:, 0] <= 40).all() and (clipped[:, 1] <= 30).all()
    assert clip_polygon(np.array([[1, 1], [5, 5]], np.float32), 10, 10).shape == (0, 2)  # a line is no polygon


def test_clip_packed_mixed_polygons_match_convex_intersection_each() -> None:
    # Inside, crossing and wholly-beyond polygons clipped in one pack, each against cv2's intersection.
    rng = np.random.default_rng(1)
    rect = np.array([[0, 0], [40, 0], [40, 30], [0, 30]], np.float32)
    hulls = [
        cv2.convexHull(rng.uniform(-60, 100, (rng.integers(3, 9), 2)).astype(np.float32)).reshape(-1, 2) * 0.5
        + rng.uniform(-40, 70, 2).astype(np.float32)
        for _ in range(60)
    ]
    points, counts, boxes = clip_packed(*pack(hulls), 40, 30)
    assert len(counts) == len(hulls) and 0 < (counts == 0).sum() < len(hulls)  # some emptied, some kept
    for hull, clipped, box in zip(hulls, unpack(points, counts), boxes, strict=True):
        expected, _ = cv2.intersectConvexConvex(hull, rect)
        assert (_area(clipped) if len(clipped) else 0.0) == pytest.approx(max(expected, 0.0), abs=1e-2)
        if len(clipped):
            np.testing.assert_allclose(box, [*clipped.min(0), *clipped.max(0)])
        else:
            assert not box.any()


def test_from_labels_and_back() -> None:
    labels = np.array([[1, 0.5, 0.5, 0.2, 0.4], [2, 0.25, 0.75, 0.5, 0.5]], np.float32)
    polygon = np.array([[0.0, 0.5], [0.5, 0.5], [0.25, 1.0]], np.float32)
    inst = Instances.from_labels(labels, *pack([np.zeros((0, 2), np.float32), polygon]), width=200, height=100)
    np.testing.assert_allclose(inst.boxes_xyxy, [[80, 30, 120, 70], [0, 50, 100, 100]])
    np.testing.assert_allclose(inst.segments[0], [[80, 30], [120, 30], [120, 70], [80, 70]])  # box corners
    np.testing.assert_allclose(inst.segments[1], [[0, 50], [100, 50], [50, 100]])
    np.testing.assert_allclose(instances_to_labels(inst, 200, 100), labels, atol=1e-6)
    box_only = Instances.from_labels(labels, *pack([]), 200, 100)
    assert [len(s) for s in box_only.segments] == [4, 4]
    assert len(Instances.from_labels(np.zeros((0, 5)), *pack([]), 10, 10)) == 0
    assert instances_to_labels(Instances.empty(), 10, 10).shape == (0, 5)


def test_instances_select_and_concat() -> None:
    rng = np.random.default_rng(0)
    _, inst = _scene(rng, 64, 64, [0, 1, 2], polygons=True)
    picked = inst.select(np.array([True, False, True]))
    assert picked.classes.tolist() == [0.0, 2.0] and np.array_equal(picked.segments[1], inst.segments[2])
    assert inst.select(np.array([2])).classes.tolist() == [2.0]
    joined = Instances.concat([picked, Instances.empty(), inst])
    assert joined.classes.tolist() == [0, 2, 0, 1, 2] and joined.boxes_xyxy.shape == (5, 4)
    with pytest.raises(ValueError, match="misaligned"):
        Instances.from_segments(np.zeros(2, np.float32), np.zeros((1, 4), np.float32), [])
    with pytest.raises(ValueError, match="misaligned"):  # counts that do not add up to the points
        Instances(np.zeros(1, np.float32), np.zeros((1, 4), np.float32), np.zeros((3, 2), np.float32), np.array([4]))


# ---------------------------------------------------------------- geometric augmentations


def _mosaic_inputs(rng: np.random.Generator, size: int, polygons: bool) -> tuple[list[np.ndarray], list[Instances]]:
    shapes = [(size, size), (size, size * 3 // 4), (size * 5 // 8, size), (size, size // 2)]
    scenes = [_scene(rng, h, w, [2 * i, 2 * i + 1], polygons) for i, (h, w) in enumerate(shapes)]
    return [image for image, _ in scenes], [inst for _, inst in scenes]


@pytest.mark.parametrize("seed", range(4))
def test_mosaic4_moves_pixels_with_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    images, instances = _mosaic_inputs(rng, 96, polygons=False)
    canvas, inst = mosaic4(images, instances, 96, rng)
    image = canvas.draw()
    assert image.shape == (192, 192, 3)
    _assert_consistent(image, inst)
    _assert_pixels_follow_boxes(image, inst, atol=0.0)  # pure translation and crop: exact
    visible = set(np.unique(_colour_index(image))) - {-1}
    assert visible == set(inst.classes.astype(int).tolist())  # nothing visible lost its label


def test_random_perspective_crop_keeps_and_drops_exactly() -> None:
    image = np.random.default_rng(0).integers(0, 255, (100, 100, 3), dtype=np.uint8)
    boxes = np.array([[0, 0, 30, 30], [20, 20, 40, 40], [60, 30, 61, 40], [30, 30, 40, 40]], np.float32)
    corners = [np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float32) for x0, y0, x1, y1 in boxes]
    from_boxes = Instances.from_segments(np.arange(4, dtype=np.float32), boxes, corners)
    out, inst = random_perspective(
        image, from_boxes, np.random.default_rng(1), translate=0.0, scale=0.0, border=(-25, -25)
    )
    np.testing.assert_array_equal(out, image[25:75, 25:75])
    assert inst.classes.tolist() == [1.0, 3.0]  # 0 keeps < 10% of its area, 2 is 1 px wide
    np.testing.assert_allclose(inst.boxes_xyxy, [[0, 0, 15, 15], [5, 5, 15, 15]], atol=1e-4)


@pytest.mark.parametrize("perspective", [0.0, 0.001])
@pytest.mark.parametrize("seed", range(5))
def test_random_perspective_moves_pixels_with_boxes(seed: int, perspective: float) -> None:
    rng = np.random.default_rng(seed)
    image, inst = _scene(rng, 120, 160, list(range(8)), polygons=False)
    out, moved = random_perspective(
        image, inst, rng, degrees=30, translate=0.1, scale=0.4, shear=8, perspective=perspective
    )
    assert out.shape == image.shape
    _assert_consistent(out, moved)
    _assert_pixels_follow_boxes(out, moved, atol=2.0)


@pytest.mark.parametrize("seed", range(6))
def test_mosaic_then_perspective_on_random_polygons(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    images, instances = _mosaic_inputs(rng, 96, polygons=True)
    canvas, inst = mosaic4(images, instances, 96, rng)
    _assert_consistent(canvas.draw(), inst)
    out, moved = random_perspective(
        canvas, inst, rng, degrees=20, translate=0.1, scale=0.5, shear=5, perspective=0.0008, border=(-48, -48)
    )
    assert out.shape == (96, 96, 3)
    _assert_consistent(out, moved)
    _assert_centres_coloured(out, moved)
    assert set(moved.classes.tolist()) <= set(inst.classes.tolist())


@pytest.mark.parametrize("seed", range(12))
def test_an_undrawn_mosaic_warps_as_the_drawn_canvas_does(seed: int) -> None:
    """random_perspective draws only the window of the canvas its affine warp reads; the pixels are the same."""
    images, instances = _mosaic_inputs(np.random.default_rng(seed), 96, polygons=True)
    canvas, inst = mosaic4(images, instances, 96, np.random.default_rng(seed))
    # Strong zoom and translation (seed-dependent) move the window anywhere, partly off the canvas too.
    params = {"degrees": 30, "translate": 0.4, "scale": 0.9, "shear": 10, "border": (-48, -48)}
    windowed, windowed_inst = random_perspective(canvas, inst, np.random.default_rng(seed), **params)
    whole, whole_inst = random_perspective(canvas.draw(), inst, np.random.default_rng(seed), **params)
    np.testing.assert_array_equal(windowed, whole)
    np.testing.assert_array_equal(windowed_inst.boxes_xyxy, whole_inst.boxes_xyxy)


def test_a_mosaic_window_is_that_part_of_the_whole_canvas() -> None:
    images, instances = _mosaic_inputs(np.random.default_rng(3), 96, polygons=False)
    canvas, _ = mosaic4(images, instances, 96, np.random.default_rng(3))
    whole = canvas.draw()
    for window in [(0, 0, 192, 192), (10, 50, 150, 60), (100, 0, 192, 30), (5, 5, 6, 6)]:
        top, left, bottom, right = window
        np.testing.assert_array_equal(canvas.draw(window), whole[top:bottom, left:right])


def test_random_perspective_with_no_instances() -> None:
    image = np.full((32, 48, 3), 7, np.uint8)
    out, inst = random_perspective(image, Instances.empty(), np.random.default_rng(0), degrees=10, border=(-8, -8))
    assert out.shape == (16, 32, 3) and len(inst) == 0 and inst.boxes_xyxy.shape == (0, 4)


@pytest.mark.parametrize("mirror", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("geometry", [{"degrees": 10, "shear": 3, "scale": 0.3}, {"translate": 0.0, "scale": 0.0}])
def test_mirror_in_the_warp_equals_flipping_after_it(mirror: tuple[bool, bool], geometry: dict) -> None:
    image = cv2.GaussianBlur(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8), (5, 5), 2)
    polygons = [np.array([[10, 10], [60, 12], [40, 70]], np.float32), np.array([[70, 20], [127, 20], [110, 95]])]
    inst = Instances.from_segments(np.array([0, 1], np.float32), np.zeros((2, 4), np.float32), polygons)
    warped, moved = random_perspective(image, inst, np.random.default_rng(5), mirror=mirror, **geometry)
    expected, expected_inst = random_perspective(image, inst, np.random.default_rng(5), **geometry)
    if mirror[0]:
        expected, expected_inst = flip_lr(expected, expected_inst)
    if mirror[1]:
        expected, expected_inst = flip_ud(expected, expected_inst)
    # The same sampling points; OpenCV's 1/32 px fixed-point coordinates may round a level apart.
    assert np.abs(warped.astype(int) - expected).max() <= 1
    assert len(moved) == len(expected_inst) == 2
    np.testing.assert_allclose(moved.boxes_xyxy, expected_inst.boxes_xyxy, atol=1e-4)
    np.testing.assert_allclose(moved.points, expected_inst.points, atol=1e-4)


@pytest.mark.parametrize("flip", [flip_lr, flip_ud])
def test_flips_move_pixels_with_boxes_and_invert(flip: Callable[..., tuple[np.ndarray, Instances]]) -> None:
    rng = np.random.default_rng(3)
    image, inst = _scene(rng, 60, 90, [0, 1, 2, 3, 4], polygons=False)
    out, flipped = flip(image, inst)
    _assert_consistent(out, flipped)
    _assert_pixels_follow_boxes(out, flipped, atol=0.0)
    assert not np.array_equal(out, image)
    back, restored = flip(out, flipped)
    np.testing.assert_array_equal(back, image)
    np.testing.assert_allclose(restored.boxes_xyxy, inst.boxes_xyxy)
    for a, b in zip(restored.segments, inst.segments, strict=True):
        np.testing.assert_allclose(a, b)


def test_mixup_blends_and_concatenates() -> None:
    rng = np.random.default_rng(0)
    image1, inst1 = _scene(rng, 64, 64, [0, 1], polygons=True)
    image2, inst2 = _scene(rng, 64, 64, [2, 3, 4], polygons=True)
    out, inst = mixup(np.full_like(image1, 200), inst1, np.zeros_like(image2), inst2, rng)
    assert out.shape == image1.shape and out.dtype == np.uint8
    assert len(np.unique(out)) == 1 and 70 <= out[0, 0, 0] <= 130  # beta(32, 32) is about 0.5
    assert inst.classes.tolist() == [0, 1, 2, 3, 4]
    _assert_consistent(out, inst)
    with pytest.raises(ValueError, match="shapes differ"):
        mixup(image1, inst1, image2[:32], inst2, rng)


# ---------------------------------------------------------------- determinism and defaults


def _pipeline(seed: int) -> tuple[np.ndarray, Instances]:
    rng = np.random.default_rng(seed)
    images, instances = _mosaic_inputs(np.random.default_rng(0), 64, polygons=True)
    image, inst = mosaic4(images, instances, 64, rng)
    image, inst = random_perspective(image, inst, rng, 10, 0.1, 0.5, 5, 0.0005, border=(-32, -32))
    image, inst = mixup(image, inst, *flip_lr(image, inst), rng)
    return apply_hsv(image, draw_hsv_gains(rng, 0.015, 0.7, 0.4)), inst


def test_same_seed_same_output() -> None:
    (image_a, inst_a), (image_b, inst_b), (image_c, _) = _pipeline(7), _pipeline(7), _pipeline(8)
    np.testing.assert_array_equal(image_a, image_b)
    np.testing.assert_array_equal(inst_a.classes, inst_b.classes)
    np.testing.assert_array_equal(inst_a.boxes_xyxy, inst_b.boxes_xyxy)
    for a, b in zip(inst_a.segments, inst_b.segments, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(image_a, image_c)


def test_augment_params_defaults_are_yolov5() -> None:
    params = AugmentParams()
    assert (params.hsv_h, params.hsv_s, params.hsv_v) == (0.015, 0.7, 0.4)
    assert (params.translate, params.scale, params.fliplr, params.mosaic, params.mixup) == (0.1, 0.5, 0.5, 1.0, 0.0)
    with pytest.raises(AttributeError):
        params.scale = 0.9  # type: ignore[misc]


@pytest.mark.parametrize("shape", [(640, 640), (37, 91), (1, 1)])
def test_bgr_to_rgb_chw_matches_the_numpy_transpose(shape: tuple[int, int]) -> None:
    image = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    expected = np.ascontiguousarray(image[:, :, ::-1].transpose(2, 0, 1))
    for source in (image, np.pad(image, ((2, 2), (3, 3), (0, 0)))[2:-2, 3:-3]):  # contiguous, and a strided view
        out = bgr_to_rgb_chw(source)
        assert out.flags.c_contiguous and not np.shares_memory(out, source)
        np.testing.assert_array_equal(out, expected)
