"""Tests for YOLOv5's segment copy-paste: utils/data/augment.py copy_paste and its use in utils/data/dataset.py."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest

from utils.data.augment import AugmentParams, Instances
from utils.data.copy_paste import COPY_PASTE_MAX_OVERLAP, copy_paste, is_box_outline
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.masks import polygons_to_mask
from utils.distributed import DistContext

HEIGHT, WIDTH = 60, 100
TRIANGLE = np.array([[10, 10], [40, 12], [20, 45]], np.float32)  # left half; its mirror lies at x 60..90


def _noise(seed: int = 0) -> np.ndarray:
    """A (60, 100, 3) image whose every pixel differs from its mirror, so flipped pixels are recognisable."""
    return np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)


def _instances(*polygons: np.ndarray, classes: list[int] | None = None) -> Instances:
    segments = [np.asarray(p, np.float32) for p in polygons]
    boxes = np.array([[*s.min(0), *s.max(0)] for s in segments], np.float32).reshape(-1, 4)
    ids = np.array(classes if classes is not None else range(len(segments)), np.float32)
    return Instances.from_segments(ids, boxes, segments)


def _box_corners(x1: float, y1: float, x2: float, y2: float) -> np.ndarray:
    return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float32)  # how labels.py stores a box-only label


def _mirror(polygon: np.ndarray) -> np.ndarray:
    return np.column_stack([WIDTH - polygon[:, 0], polygon[:, 1]]).astype(np.float32)


def test_pasted_pixels_are_the_flipped_object_inside_its_mask() -> None:
    image, inst = _noise(), _instances(TRIANGLE, classes=[3])
    original = image.copy()
    out, pasted = copy_paste(image, inst, 1.0, np.random.default_rng(0))
    assert np.array_equal(image, original)  # the input is left alone
    assert len(pasted) == 2 and pasted.classes.tolist() == [3.0, 3.0]
    mirrored = _mirror(TRIANGLE)
    assert np.array_equal(pasted.segments[1], mirrored)
    assert pasted.boxes_xyxy[1].tolist() == [WIDTH - 40, 10, WIDTH - 10, 45]  # x -> W - x, sides swapped
    inside = polygons_to_mask([mirrored], HEIGHT, WIDTH).astype(bool)
    assert inside.sum() > 400  # the triangle's area is ~500 px
    assert np.array_equal(out[inside], cv2.flip(original, 1)[inside])
    assert np.array_equal(out[~inside], original[~inside])
    assert not np.array_equal(out[inside], original[inside])


def test_zero_fraction_is_identity_and_draws_nothing() -> None:
    image, inst = _noise(), _instances(TRIANGLE)
    rng = np.random.default_rng(1)
    state = rng.bit_generator.state
    out, same = copy_paste(image, inst, 0.0, rng)
    assert out is image and same is inst and rng.bit_generator.state == state


def test_box_only_labels_are_not_pasted() -> None:
    image, inst = _noise(), _instances(_box_corners(5, 5, 30, 40))
    out, same = copy_paste(image, inst, 1.0, np.random.default_rng(0))
    assert out is image and same is inst
    assert is_box_outline(np.stack([_box_corners(5, 5, 30, 40), TRIANGLE[[0, 1, 2, 0]]])).tolist() == [True, False]


@pytest.mark.parametrize(("covered", "is_pasted"), [(0.29, True), (0.31, False)])
def test_no_paste_where_it_would_hide_too_much_of_a_box(covered: float, is_pasted: bool) -> None:
    # The triangle's mirror box spans x 60..90 over rows 10..45. A box-only label 30 px wide over the same rows,
    # reaching `covered` x 30 px into it from the left, has exactly that share of its area covered.
    blocker = _box_corners(60 - 30 * (1 - covered), 10, 90 - 30 * (1 - covered), 45)
    image, inst = _noise(), _instances(TRIANGLE, blocker)
    out, result = copy_paste(image, inst, 1.0, np.random.default_rng(0))
    assert COPY_PASTE_MAX_OVERLAP == 0.30
    assert len(result) == (3 if is_pasted else 2)
    assert (out is not image) == is_pasted


def test_an_object_never_pastes_onto_itself_or_an_earlier_paste() -> None:
    centred = np.array([[40, 10], [60, 10], [50, 40]], np.float32)  # its mirror is itself
    image = _noise()
    assert copy_paste(image, _instances(centred), 1.0, np.random.default_rng(0))[0] is image
    twins = _instances(TRIANGLE, TRIANGLE + 1)  # mirrors in the same place: the second would hide the first
    out, result = copy_paste(image, twins, 1.0, np.random.default_rng(0))
    assert len(result) == 3


def test_fraction_picks_round_share_and_is_deterministic() -> None:
    # Four small objects on the left, mirrors free: fraction 0.5 pastes exactly two of them.
    polygons = [TRIANGLE * 0.3 + [5 + 10 * i, 5] for i in range(4)]
    image, inst = _noise(), _instances(*polygons)
    out_a, pasted_a = copy_paste(image, inst, 0.5, np.random.default_rng(7))
    out_b, pasted_b = copy_paste(image, inst, 0.5, np.random.default_rng(7))
    assert len(pasted_a) == 6 and np.array_equal(out_a, out_b)
    assert pasted_a.classes.tolist() == pasted_b.classes.tolist()
    picks = {tuple(copy_paste(image, inst, 0.5, np.random.default_rng(seed))[1].classes[4:]) for seed in range(20)}
    assert len(picks) > 1  # the rng decides which


# --- in the dataset --------------------------------------------------------------------------------------

FIXED_GEOMETRY = {"translate": 0.0, "scale": 0.0, "hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "fliplr": 0.0}


def _folder(root: Path, polygons: bool) -> Path:
    """Four 64 x 64 images with one small object each in the left half, as a triangle or a box label."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for i in range(4):
        cv2.imwrite(str(root / "images" / f"{i}.png"), _noise(i)[:64, :64])
        row = "0.1 0.1 0.4 0.15 0.2 0.45" if polygons else "0.25 0.25 0.3 0.3"
        (root / "labels" / f"{i}.txt").write_text(f"0 {row}\n")
    return root / "images"


def _dataset(root: Path, copy_paste_share: float, polygons: bool = True, **options: object) -> LoadImagesAndLabels:
    aug = AugmentParams(copy_paste=copy_paste_share, **FIXED_GEOMETRY)
    settings = {"img_size": 64, "num_classes": 1, "workers": 1, "augment": True, "aug": aug, **options}
    return LoadImagesAndLabels(_folder(root, polygons), DatasetOptions(**settings), DistContext())


def test_dataset_mosaics_gain_the_pasted_objects(tmp_path: Path) -> None:
    plain = _dataset(tmp_path / "a", 0.0)
    pasted = _dataset(tmp_path / "b", 1.0)
    # With no random geometry the warp ignores the draws copy-paste adds, so items differ only by the pastes.
    gained = 0
    for key in range(4):
        before, after = plain[(key, 0)]["labels"], pasted[(key, 0)]["labels"]
        assert len(after) >= len(before) and after[: len(before)].equal(before)  # copies are appended
        gained += len(after) - len(before)
    assert gained > 0


def test_idle_copy_paste_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _dataset(tmp_path / "boxes", 0.5, polygons=False)
    [record] = caplog.records
    assert "copy_paste 0.5 has no effect" in record.getMessage() and "no polygons" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _dataset(tmp_path / "rect", 0.5, rect=True)
    assert ["mosaic is off" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _dataset(tmp_path / "polygons", 0.5)
        _dataset(tmp_path / "off", 0.0, polygons=False)
    assert not caplog.records


def test_a_segmentation_train_set_of_boxes_only_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _dataset(tmp_path / "boxes", 0.0, polygons=False, with_masks=True)
    assert [r.getMessage().endswith("no training label has a polygon, so every mask is its box's rectangle; "
                                    "is --data a segmentation dataset?") for r in caplog.records] == [True]  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _dataset(tmp_path / "outlines", 0.0, with_masks=True)  # polygons: nothing to say
        _dataset(tmp_path / "detect", 0.0, polygons=False)  # boxes for a detector: nothing to say
    assert not caplog.records
