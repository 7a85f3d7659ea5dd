"""Tests for utils/data/masks.py and the dataset's masks: hand-drawn rasterisation, overlap masks, augmentation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import make_tiny_dataset
from utils.data.augment import AugmentParams
from utils.data.batch import collate_batch
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.masks import (
    covered_areas,
    mask_outlines,
    polygon_areas,
    polygons_to_mask,
    polygons_to_masks,
    polygons_to_overlap_mask,
)
from utils.data.polygons import clip_polygon
from utils.data.synthetic import SyntheticSpec
from utils.distributed import DistContext

CTX = DistContext()
TINY = SyntheticSpec(num_train=8, num_val=2, min_side=64, max_side=128, max_objects=5, min_object_frac=0.2)
GEOMETRY = {"mosaic": 1.0, "degrees": 10.0, "shear": 5.0, "scale": 0.3, "translate": 0.1, "fliplr": 0.0}


def _grid(rows: str) -> np.ndarray:
    """A hand-drawn mask: one string of 0/1 per row."""
    return np.array([[int(c) for c in row] for row in rows.split()], np.uint8)


# Pixel (row j, column i) is [i, i+1] x [j, j+1], centre (i + 0.5, j + 0.5). Right triangle with legs on
# x = 0.9 and y = 0.9 and hypotenuse x + y = 8.2: centre inside iff i >= 1, j >= 1 and i + j + 1 < 8.2.
TRIANGLE = np.array([[0.9, 0.9], [7.3, 0.9], [0.9, 7.3]], np.float32)
TRIANGLE_8X8 = """
    00000000
    01111110
    01111100
    01111000
    01110000
    01100000
    01000000
    00000000
"""
# A "U" upside down: a bar over rows 1-2 and two legs over columns 1-2 and 5-6 (two spans per row).
ARCH = np.array([[1, 1], [7, 1], [7, 7], [5, 7], [5, 3], [3, 3], [3, 7], [1, 7]], np.float32)
ARCH_8X8 = """
    00000000
    01111110
    01111110
    01100110
    01100110
    01100110
    01100110
    00000000
"""
# Ratio 2: mask pixel (j, i) has its centre at image (2i + 1, 2j + 1). Triangle: 2i + 2j + 2 < 8.2.
TRIANGLE_4X4 = """
    1111
    1110
    1100
    1000
"""
# Rectangle x in [2, 6], y in [2, 8]: centres x in {3, 5}, y in {3, 5, 7}.
RECTANGLE = np.array([[2, 2], [6, 2], [6, 8], [2, 8]], np.float32)
RECTANGLE_4X4 = """
    0000
    0110
    0110
    0110
"""


def _inside_reference(polygon: np.ndarray, height: int, width: int, ratio: int) -> np.ndarray:
    """Brute-force even-odd ray casting at every mask pixel centre (no ties expected)."""
    ys, xs = np.mgrid[0 : height // ratio, 0 : width // ratio]
    px, py = (xs + 0.5) * ratio, (ys + 0.5) * ratio
    inside = np.zeros(px.shape, bool)
    for (x0, y0), (x1, y1) in zip(polygon, np.roll(polygon, -1, axis=0), strict=True):
        spans_row = (y0 > py) != (y1 > py)
        x_cross = x0 + (py - y0) * (x1 - x0) / np.where(y1 == y0, 1, y1 - y0)
        inside ^= spans_row & (px < x_cross)
    return inside.astype(np.uint8)


def test_rasterisation_matches_hand_drawn_grids() -> None:
    np.testing.assert_array_equal(polygons_to_mask([TRIANGLE], 8, 8), _grid(TRIANGLE_8X8))
    np.testing.assert_array_equal(polygons_to_mask([ARCH], 8, 8), _grid(ARCH_8X8))
    np.testing.assert_array_equal(polygons_to_mask([TRIANGLE], 8, 8, ratio=2), _grid(TRIANGLE_4X4))
    np.testing.assert_array_equal(polygons_to_mask([RECTANGLE], 8, 8, ratio=2), _grid(RECTANGLE_4X4))
    masks = polygons_to_masks([TRIANGLE, ARCH, RECTANGLE], 8, 8)
    assert masks.dtype == np.uint8 and masks.shape == (3, 8, 8)
    np.testing.assert_array_equal(masks[1], _grid(ARCH_8X8))
    # The union of several polygons in one mask.
    np.testing.assert_array_equal(polygons_to_mask([TRIANGLE, ARCH], 8, 8), masks[0] | masks[1])


def test_edges_through_pixel_centres_follow_the_top_left_rule() -> None:
    # Two 3 x 4 rectangles sharing the edge x = 3.5, whose edges all pass through pixel centres.
    left = np.array([[0.5, 0.5], [3.5, 0.5], [3.5, 4.5], [0.5, 4.5]], np.float32)
    right = left + np.array([3.0, 0.0], np.float32)
    masks = polygons_to_masks([left, right], 8, 8)
    assert not (masks[0] & masks[1]).any()  # the shared edge's pixels belong to one rectangle only
    assert masks[0].sum() == masks[1].sum() == 12  # exactly their area
    assert masks[0][:4, :3].all() and masks[1][:4, 3:6].all()


def test_parts_outside_the_image_are_cut_and_odd_sizes_round_down() -> None:
    sticking_out = np.array([[-3, -3], [2.2, -3], [2.2, 9], [-3, 9]], np.float32)
    mask = polygons_to_mask([sticking_out], 8, 8)
    assert mask[:, :2].all() and mask.sum() == 16
    np.testing.assert_array_equal(mask, polygons_to_mask([clip_polygon(sticking_out, 8, 8)], 8, 8))
    assert polygons_to_masks([TRIANGLE], 9, 10, ratio=4).shape == (1, 2, 2)
    empty = polygons_to_masks([TRIANGLE[:2], np.zeros((0, 2), np.float32)], 8, 8, ratio=2)
    assert empty.shape == (2, 4, 4) and not empty.any()  # fewer than 3 points: an all-zero row
    assert polygons_to_masks([], 8, 12, ratio=4).shape == (0, 2, 3)
    with pytest.raises(ValueError, match="ratio"):
        polygons_to_mask([TRIANGLE], 8, 8, ratio=0)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_random_polygons_match_brute_force_point_in_polygon(ratio: int) -> None:
    rng = np.random.default_rng(ratio)
    for _ in range(30):
        height, width = (int(v) for v in rng.integers(8, 48, 2))
        angles = np.sort(rng.uniform(0, 2 * np.pi, 9))  # star-shaped around the centre: often concave
        radii = rng.uniform(1, 20, 9)
        centre = rng.uniform(-4, [width + 4, height + 4])
        polygon = (centre + np.stack([np.cos(angles), np.sin(angles)], 1) * radii[:, None]).astype(np.float32)
        expected = _inside_reference(polygon.astype(np.float64), height, width, ratio)
        np.testing.assert_array_equal(polygons_to_masks([polygon], height, width, ratio)[0], expected)


def test_overlap_mask_smaller_polygon_wins_and_values_are_index_plus_one() -> None:
    big = np.array([[0, 0], [6, 0], [6, 6], [0, 6]], np.float32)
    small = np.array([[4, 4], [8, 4], [8, 8], [4, 8]], np.float32)
    overlap = polygons_to_overlap_mask([big, small], 8, 8)
    assert overlap.dtype == np.int16 and overlap.shape == (1, 8, 8)
    expected = np.zeros((8, 8), np.int16)
    expected[:6, :6] = 1
    expected[4:, 4:] = 2  # the overlap [4, 6]^2 goes to the smaller square
    np.testing.assert_array_equal(overlap[0], expected)
    swapped = polygons_to_overlap_mask([small, big], 8, 8)[0]  # order changes the values, not the winner
    np.testing.assert_array_equal(swapped, np.where(expected == 0, 0, 3 - expected))
    at_ratio_2 = polygons_to_overlap_mask([big, small], 8, 8, ratio=2)
    np.testing.assert_array_equal(at_ratio_2[0], [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 2, 2], [0, 0, 2, 2]])
    assert polygons_to_overlap_mask([], 8, 8, ratio=4).tolist() == [[[0, 0], [0, 0]]]
    np.testing.assert_allclose(polygon_areas([big, small, TRIANGLE, big[:2]]), [36, 16, 6.4**2 / 2, 0], rtol=1e-6)


# ---- masks served by the dataset --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mask_data")
    make_tiny_dataset(root, TINY)
    return root / "shapes" / "images" / "train"


def _dataset(folder: Path, *, aug: dict[str, float] | None = None, **changes: Any) -> LoadImagesAndLabels:
    options: dict[str, Any] = {"img_size": 96, "num_classes": 6, "workers": 2, "batch_size": 2, "with_masks": True}
    if aug is not None:
        options |= {"augment": True, "aug": AugmentParams(hsv_h=0, hsv_s=0, hsv_v=0, **aug)}
    return LoadImagesAndLabels(folder, DatasetOptions(**(options | changes)), CTX)


def _mask_boxes(masks: np.ndarray) -> np.ndarray:
    """Bounding boxes (n, 4) xyxy of masks (n, h, w) in pixel-edge coordinates; NaN rows for empty masks."""
    boxes = np.full((len(masks), 4), np.nan)
    for i, mask in enumerate(masks):
        rows, columns = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        if len(rows):
            boxes[i] = columns[0], rows[0], columns[-1] + 1, rows[-1] + 1
    return boxes


def _label_boxes(labels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Label rows (n, 6) [i, cls, cx, cy, w, h] normalised -> (n, 4) xyxy pixels."""
    centre, size = labels[:, 2:4], labels[:, 4:6]
    return np.concatenate([centre - size / 2, centre + size / 2], 1) * np.array([width, height] * 2)


BLUNT_CLASSES = (0, 2, 4)  # circle, square, cross: no corner sharper than 90 degrees


def _check_alignment(masks: np.ndarray, labels: np.ndarray, height: int, width: int, ratio: int) -> np.ndarray:
    """Assert every mask lies inside its label box; return (n,) bool: mask box within 1 mask pixel of the label box.

    Strict part: a mask pixel is set only when its centre is inside the polygon, which lies inside the label
    box, so the mask box can exceed the label box by at most half a mask pixel on any side. It can fall short
    by more where a sharp tip (star, triangle, crescent horn) is too thin to cover a pixel centre.
    """
    boxes = _label_boxes(labels, height, width) / ratio
    mask_boxes = _mask_boxes(masks)
    drawn = ~np.isnan(mask_boxes[:, 0])
    outside = np.concatenate([boxes[drawn, :2] - mask_boxes[drawn, :2], mask_boxes[drawn, 2:] - boxes[drawn, 2:]], 1)
    assert (outside <= 0.5 + 1e-3).all(), f"mask beyond its box by {outside.max():.2f} px"
    tight = np.zeros(len(masks), bool)
    tight[drawn] = (np.abs(mask_boxes[drawn] - boxes[drawn]) <= 1.0).all(1)
    return tight


def _assert_mostly_tight(tight: np.ndarray, classes: np.ndarray, blunt_share: float, share: float) -> None:
    """Most mask boxes equal their label boxes within 1 mask pixel; nearly all for shapes without sharp tips."""
    blunt = np.isin(classes, BLUNT_CLASSES)
    assert blunt.sum() >= 5 and (~blunt).sum() >= 5
    assert tight[blunt].mean() >= blunt_share and tight.mean() >= share, (tight[blunt].mean(), tight.mean())


def _aligned(dataset: LoadImagesAndLabels, keys: list[Any], mirror: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Check every item's masks against its labels; return (tight (N,) bool, classes (N,)) over all instances.

    `mirror` = "lr"/"ud" flips the masks before checking, to show the check notices unflipped masks.
    """
    tight, classes = [], []
    ratio = dataset.options.mask_ratio
    for key in keys:
        item = dataset[key]
        masks, labels = item["masks"].numpy(), item["labels"].numpy()
        height, width = item["image"].shape[:2]
        assert masks.dtype == np.uint8 and set(np.unique(masks)) <= {0, 1}
        assert masks.shape == (len(labels), height // ratio, width // ratio)
        masks = masks[:, :, ::-1] if mirror == "lr" else masks[:, ::-1] if mirror == "ud" else masks
        tight.append(_check_alignment(masks, labels, height, width, ratio))
        classes.append(labels[:, 1])
    return np.concatenate(tight), np.concatenate(classes)


KEYS = [(i, epoch) for i in range(8) for epoch in range(4)]  # 2 epochs left too few blunt shapes for a stable share
CASES = {
    "mosaic_affine": {"aug": GEOMETRY},
    "mosaic_affine_fliplr": {"aug": GEOMETRY | {"fliplr": 1.0}},
    "mosaic_affine_flipud": {"aug": GEOMETRY | {"flipud": 1.0}},
    "mosaic_mixup": {"aug": GEOMETRY | {"mixup": 1.0, "fliplr": 0.5}},
    "affine_no_mosaic": {"aug": GEOMETRY | {"mosaic": 0.0, "fliplr": 0.5, "flipud": 0.5}},
    "rect_train": {"aug": GEOMETRY | {"fliplr": 0.5}, "rect": True},
    "val_letterbox": {},
    "val_rect": {"rect": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_masks_follow_every_augmentation_at_full_resolution(images_folder: Path, case: str) -> None:
    dataset = _dataset(images_folder, mask_ratio=1, **CASES[case])
    keys = KEYS if dataset.options.augment else list(range(8))
    tight, classes = _aligned(dataset, keys)
    _assert_mostly_tight(tight, classes, blunt_share=0.95, share=0.75)


@pytest.mark.parametrize("mirror", ["lr", "ud"])
def test_alignment_check_notices_masks_that_were_not_flipped(images_folder: Path, mirror: str) -> None:
    dataset = _dataset(images_folder, mask_ratio=1, aug=GEOMETRY)
    with pytest.raises(AssertionError, match="beyond its box"):
        _aligned(dataset, KEYS[:6], mirror=mirror)


@pytest.mark.parametrize("case", ["mosaic_mixup", "rect_train", "val_rect"])
def test_masks_at_ratio_4_are_quarter_size_and_aligned(images_folder: Path, case: str) -> None:
    dataset = _dataset(images_folder, **CASES[case])
    assert dataset.options.mask_ratio == 4
    keys = KEYS if dataset.options.augment else list(range(8))
    tight, classes = _aligned(dataset, keys)  # checks shapes (n, H/4, W/4) with n == labels rows
    _assert_mostly_tight(tight, classes, blunt_share=0.9, share=0.7)


def test_overlap_masks_agree_with_per_instance_masks(images_folder: Path) -> None:
    aug = GEOMETRY | {"mixup": 0.5, "fliplr": 0.5}
    per_instance = _dataset(images_folder, aug=aug)
    overlap = _dataset(images_folder, aug=aug, overlap_mask=True)
    shown = 0
    for key in KEYS:
        masks, index_mask = per_instance[key]["masks"].numpy(), overlap[key]["masks"].numpy()
        height, width = overlap[key]["image"].shape[:2]
        assert index_mask.dtype == np.int16 and index_mask.shape == (1, height // 4, width // 4)
        assert index_mask.max() <= len(masks)
        np.testing.assert_array_equal(index_mask[0] > 0, masks.any(0))  # same foreground
        for i in np.unique(index_mask[index_mask > 0]) - 1:
            assert masks[i][index_mask[0] == i + 1].all()  # a pixel only names an instance that covers it
        shown += len(np.unique(index_mask[index_mask > 0]))
    assert shown > len(KEYS)


def test_collated_masks_follow_targets_and_mixed_sizes_are_padded(images_folder: Path) -> None:
    dataset = _dataset(images_folder, aug=GEOMETRY | {"fliplr": 0.5}, rect=True)
    items = [dataset[(i, 0)] for i in range(8)]
    assert len({tuple(item["image"].shape) for item in items}) > 1  # rect training: own sizes
    batch = collate_batch(items)
    height, width = batch["images"].shape[1:3]
    masks, targets = batch["masks"], batch["targets"]
    assert masks.shape == (len(targets), height // 4, width // 4) and masks.dtype == torch.uint8
    for position, item in enumerate(items):
        rows = (targets[:, 0] == position).numpy()
        own_h, own_w = item["masks"].shape[1:]
        assert torch.equal(masks[rows][:, :own_h, :own_w], item["masks"])  # padded right/bottom only
        assert not masks[rows][:, own_h:].any() and not masks[rows][:, :, own_w:].any()
    tight = _check_alignment(masks.numpy(), targets.numpy(), height, width, 4)
    _assert_mostly_tight(tight, targets[:, 1].numpy(), blunt_share=0.9, share=0.7)
    overlap = _dataset(images_folder, aug=GEOMETRY | {"fliplr": 0.5}, rect=True, overlap_mask=True)
    index_masks = collate_batch([overlap[(i, 0)] for i in range(8)])["masks"]
    assert index_masks.shape == (8, height // 4, width // 4) and index_masks.dtype == torch.int16


def test_mask_outlines_drawn_again_give_back_every_region_with_its_holes_filled() -> None:
    # Random masks: staircases of every orientation, one-pixel gaps and notches, regions touching at a corner.
    # The outlines drawn again must give back exactly the pixels whose region they enclose (holes filled), not
    # the half-pixel triangles a diagonal takes in nor a gap or notch bridged between pixels.
    import cv2

    rng = np.random.default_rng(0)
    for _ in range(300):
        height, width = (int(v) for v in rng.integers(3, 16, 2))
        mask = (rng.random((height, width)) < rng.uniform(0.2, 0.8)).astype(np.uint8)
        background = np.pad(1 - mask, 1, constant_values=1)
        cv2.floodFill(background, None, (0, 0), 2)  # background 4-connected to the border: outside every region
        inside = background[1:-1, 1:-1] != 2
        drawn = np.zeros((height, width), bool)
        for outline in mask_outlines(mask):
            drawn |= polygons_to_mask([outline.astype(np.float64)], height, width).astype(bool)
        np.testing.assert_array_equal(drawn, inside)


def test_covered_area_is_zero_only_for_polygons_that_cover_nothing() -> None:
    # Packed as the COCO label index stores them: a square, a figure 8, a collinear row, a point, no points.
    square = [[0, 0], [2, 0], [2, 2], [0, 2]]
    figure8 = [[8, 8], [32, 32], [32, 8], [8, 32]]  # two triangles of 144 px: the shoelace sum cancels to 0
    line, point = [[0, 0], [1, 1], [3, 3]], [[5, 5]]
    areas = covered_areas(np.array(square + figure8 + line + point, np.float64), [4, 4, 3, 1, 0])
    assert areas[0] == 4.0 and areas[1] >= 288.0 and areas[2:].tolist() == [0.0, 0.0, 0.0]  # never below the true area
    assert polygon_areas([np.array(figure8, np.float64)])[0] == 0.0  # why the shoelace area cannot judge it
    assert polygons_to_mask([np.array(figure8, np.float64)], 40, 40).sum() == 288  # what the rasteriser fills
