"""Tests for the built-in synthetic dataset generator (utils/data/synthetic.py)."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from pycocotools.coco import COCO

from tests.dist_helpers import PROCESS_TIMEOUT_S
from utils.data.synthetic import (
    MARKER_NAME,
    SHAPE_NAMES,
    SyntheticSpec,
    ensure_synthetic_dataset,
    image_name,
    render_image,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = SyntheticSpec(num_train=12, num_val=4)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny dataset shared by the read-only tests of this module."""
    return ensure_synthetic_dataset(tmp_path_factory.mktemp("tiny") / "synthetic", TINY)


def _read_label(path: Path) -> list[tuple[int, np.ndarray]]:
    """Parse a YOLO polygon label file into (class, polygon (k, 2) normalised) pairs."""
    rows = []
    for line in path.read_text().splitlines():
        values = line.split()
        assert len(values) >= 7 and len(values) % 2 == 1, f"bad column count in {path}: {line}"
        rows.append((int(values[0]), np.array(values[1:], np.float64).reshape(-1, 2)))
    return rows


def test_same_seed_identical_other_seed_different(tmp_path: Path, tiny_root: Path) -> None:
    again = ensure_synthetic_dataset(tmp_path / "again", TINY)
    other = ensure_synthetic_dataset(tmp_path / "other", SyntheticSpec(seed=1, num_train=12, num_val=4))
    labels = sorted(p.relative_to(tiny_root) for p in (tiny_root / "labels").rglob("*.txt"))
    assert len(labels) == 16
    differing = 0
    for rel in labels:
        assert (tiny_root / rel).read_bytes() == (again / rel).read_bytes()
        differing += (tiny_root / rel).read_bytes() != (other / rel).read_bytes()
    assert differing >= 14  # a different seed changes (almost) every image
    for rel in sorted(p.relative_to(tiny_root) for p in (tiny_root / "images").rglob("*.jpg")):
        first, second = cv2.imread(str(tiny_root / rel)), cv2.imread(str(again / rel))
        assert first is not None and np.array_equal(first, second)
    assert not np.array_equal(cv2.imread(str(tiny_root / rel)), cv2.imread(str(other / rel)))


def test_output_independent_of_worker_pool(tmp_path: Path) -> None:
    spec = SyntheticSpec(num_train=100, num_val=2)  # enough images for a 2-process pool
    root = ensure_synthetic_dataset(tmp_path / "pooled", spec)
    for index in (0, 57, 99):
        image, objects = render_image(spec, 0, index)  # rendered alone, in this process
        stored = cv2.imread(str(root / "images" / "train" / f"{image_name(index)}.jpg"))
        expected = cv2.imdecode(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1], cv2.IMREAD_COLOR)
        assert np.array_equal(stored, expected)
        assert len(_read_label(root / "labels" / "train" / f"{image_name(index)}.txt")) == len(objects)


def test_layout_counts_and_labels(tiny_root: Path) -> None:
    marker = json.loads((tiny_root / MARKER_NAME).read_text())
    assert marker["num_train"] == 12 and marker["class_names"] == list(SHAPE_NAMES)
    for split, count in (("train", 12), ("val", 4)):
        images = sorted((tiny_root / "images" / split).glob("*.jpg"))
        labels = sorted((tiny_root / "labels" / split).glob("*.txt"))
        assert len(images) == count and [p.stem for p in images] == [p.stem for p in labels]
        for image_path, label_path in zip(images, labels, strict=True):
            height, width = cv2.imread(str(image_path)).shape[:2]
            assert 256 <= height <= 480 and 256 <= width <= 480
            rows = _read_label(label_path)
            assert len(rows) <= TINY.max_objects
            for class_id, polygon in rows:
                assert 0 <= class_id < len(SHAPE_NAMES)
                assert polygon.min() >= 0.0 and polygon.max() <= 1.0
                assert len(polygon) >= 3


def test_coco_json_matches_labels(tiny_root: Path) -> None:
    coco = COCO(str(tiny_root / "annotations" / "instances_val.json"))
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(SHAPE_NAMES)
    assert coco.getCatIds() == list(range(1, len(SHAPE_NAMES) + 1))
    assert len(coco.getImgIds()) == 4
    total = 0
    for info in coco.loadImgs(coco.getImgIds()):
        label_path = tiny_root / "labels" / "val" / f"{Path(info['file_name']).stem}.txt"
        image = cv2.imread(str(tiny_root / "images" / "val" / info["file_name"]))
        assert image.shape[:2] == (info["height"], info["width"])
        rows = _read_label(label_path)
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[info["id"]]))
        assert len(anns) == len(rows)
        total += len(anns)
        for ann, (class_id, polygon_n) in zip(anns, rows, strict=True):
            polygon = polygon_n * [info["width"], info["height"]]
            x, y, w, h = ann["bbox"]
            bounds = [*polygon.min(0), *polygon.max(0)]
            assert np.allclose([x, y, x + w, y + h], bounds, atol=1.0)
            assert ann["category_id"] == class_id + 1 and ann["iscrowd"] == 0
            assert np.allclose(np.reshape(ann["segmentation"][0], (-1, 2)), polygon, atol=0.01)
            assert 0 < ann["area"] <= w * h
    assert total > 0
    assert sorted(coco.getAnnIds()) == list(range(1, total + 1))  # id 0 would break COCOeval matching


def test_objects_drawn_exactly_and_overlaps_limited() -> None:
    spec = SyntheticSpec()
    checked = 0
    for index in range(20):
        image, objects = render_image(spec, 1, index)
        height, width = image.shape[:2]
        boxes = np.array([[*p.min(0), *p.max(0)] for _, p in objects]).reshape(-1, 4)
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
        for i in range(len(boxes)):
            for j in range(i):
                inter = np.prod(
                    np.clip(np.minimum(boxes[i, 2:], boxes[j, 2:]) - np.maximum(boxes[i, :2], boxes[j, :2]), 0, None)
                )
                union = np.prod(boxes[i, 2:] - boxes[i, :2]) + np.prod(boxes[j, 2:] - boxes[j, :2]) - inter
                assert inter / union <= 0.3 + 1e-6
        if not objects or boxes[-1, 2] - boxes[-1, 0] < 20:
            continue
        # The last object is drawn on top: its label must cover a flat patch that stands out from its surroundings.
        mask = np.zeros((height, width), np.uint8)
        cv2.fillPoly(mask, [np.round((objects[-1][1] - 0.5) * 16).astype(np.int32)], 1, cv2.LINE_8, 4)
        inside = cv2.erode(mask, np.ones((5, 5), np.uint8)).astype(bool)
        ring = (cv2.dilate(mask, np.ones((7, 7), np.uint8)) - cv2.dilate(mask, np.ones((3, 3), np.uint8))).astype(bool)
        colour = image[inside].astype(np.float64).mean(0)
        assert image[inside].astype(np.float64).std(0).max() < 10
        near = np.linalg.norm(image[ring].astype(np.float64) - colour, axis=1) < 30
        assert near.mean() < 0.2
        checked += 1
    assert checked >= 5


def test_spec_mismatch_and_foreign_folder_raise(tmp_path: Path, tiny_root: Path) -> None:
    with pytest.raises(ValueError, match=str(tiny_root)):
        ensure_synthetic_dataset(tiny_root, SyntheticSpec(seed=3, num_train=12, num_val=4))
    foreign = tmp_path / "synthetic"
    (foreign / "images").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a complete synthetic dataset"):
        ensure_synthetic_dataset(foreign, TINY)
    with pytest.raises(ValueError, match="class_names"):
        SyntheticSpec(class_names=("circle", "blob"))


def test_stale_temp_folder_is_ignored_and_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".synthetic.tmp-999999"
    (stale / "images").mkdir(parents=True)
    (stale / MARKER_NAME).write_text("{}")  # a crashed generator's leftovers are never used
    root = ensure_synthetic_dataset(tmp_path / "synthetic", TINY)
    assert not stale.exists()
    assert json.loads((root / MARKER_NAME).read_text())["num_val"] == 4


_CHILD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from utils.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
ensure_synthetic_dataset(Path(sys.argv[1]), SyntheticSpec(num_train=12, num_val=4))
"""


@pytest.mark.distributed  # two generator subprocesses
def test_concurrent_processes_generate_once(tmp_path: Path) -> None:
    root = tmp_path / "synthetic"
    logs = [tmp_path / f"child{i}.log" for i in range(2)]
    # Hold the lock ourselves until both children are queued on it, so they really race for it.
    with open(tmp_path / ".synthetic.lock", "a") as lock, logs[0].open("w") as err0, logs[1].open("w") as err1:
        fcntl.flock(lock, fcntl.LOCK_EX)
        children = [
            subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], cwd=REPO_ROOT, stderr=err)
            for err in (err0, err1)
        ]
        # Both must be waiting before the lock is let go, however long a loaded machine takes to start them.
        deadline = time.monotonic() + 300
        while not all("Waiting" in log.read_text() for log in logs):
            if time.monotonic() > deadline or any(child.poll() is not None for child in children):
                for child in children:
                    child.kill()
                texts = "\n".join(log.read_text() for log in logs)
                pytest.fail(f"the generators did not both queue on the lock:\n{texts}")
            time.sleep(0.05)
        fcntl.flock(lock, fcntl.LOCK_UN)
        assert [child.wait(timeout=PROCESS_TIMEOUT_S) for child in children] == [0, 0]
    texts = [log.read_text() for log in logs]
    assert all("Waiting" in text for text in texts)
    assert sum(text.count("Generating synthetic dataset") for text in texts) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".synthetic.lock", "synthetic", *(p.name for p in logs)]
    )
    assert len(list((root / "images" / "train").glob("*.jpg"))) == 12
    assert json.loads((root / MARKER_NAME).read_text())["num_train"] == 12


def test_yaml_names_match_default_spec() -> None:
    config = yaml.safe_load((REPO_ROOT / "data" / "synthetic.yaml").read_text())
    assert config["names"] == list(SyntheticSpec().class_names)
    assert config["builtin"] == "synthetic" and config["path"] == "../datasets/synthetic"
    assert (config["train"], config["val"]) == ("images/train", "images/val")
    assert config["val_annotations"] == "annotations/instances_val.json"
