"""A tiny COCO-JSON dataset for tests: boxes, multi-part polygons, RLE, crowd, a background and every bad entry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from pycocotools import mask as mask_utils

CATEGORIES = [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}, {"id": 9, "name": "cow"}]  # ids not 0..2
NAMES = ("cat", "dog", "cow")  # ascending id order: class i <-> CATEGORIES[i]
SIZES_WH = {1: (96, 72), 2: (72, 96), 3: (96, 96), 4: (80, 64), 5: (64, 80), 6: (96, 64), 7: (64, 64), 8: (72, 72)}
MISSING_FILE_ID = 8  # listed in the JSON, no file on disk
BACKGROUND_ID = 7  # a file with no annotation
# Annotation ids of the bad entries, each warned once and counted.
CLIPPED_ID, OUTSIDE_ID, ZERO_AREA_ID, UNKNOWN_CATEGORY_ID, UNKNOWN_IMAGE_ID, CROWD_ID = 101, 102, 103, 104, 105, 106


def _rle(height: int, width: int, box_xyxy: tuple[int, int, int, int]) -> dict[str, Any]:
    """A compressed RLE (string counts) of a filled rectangle with a notch cut out."""
    mask = np.zeros((height, width), np.uint8)
    x1, y1, x2, y2 = box_xyxy
    mask[y1:y2, x1:x2] = 1
    mask[y1 : (y1 + y2) // 2, x1 : (x1 + x2) // 2] = 0  # an L shape, so the traced polygon has 6 corners
    rle = mask_utils.encode(np.asfortranarray(mask))
    return {"size": [height, width], "counts": rle["counts"].decode("ascii")}


def _shape(rng: np.random.Generator, width: int, height: int) -> tuple[list[float], list[float]]:
    """A random convex polygon (flat pixels) well inside the image, and its bbox."""
    cx, cy = rng.uniform(0.35, 0.65) * width, rng.uniform(0.35, 0.65) * height
    radius = rng.uniform(0.15, 0.3) * min(width, height)
    angles = np.sort(rng.uniform(0, 2 * np.pi, 7))
    points = np.round(np.stack([cx + radius * np.cos(angles), cy + radius * np.sin(angles)], 1), 2)
    low, high = points.min(0), points.max(0)
    return points.reshape(-1).tolist(), [*low.round(2).tolist(), *(high - low).round(2).tolist()]


def coco_annotations() -> list[dict[str, Any]]:
    """Good annotations of images 1-6 (polygons, a box-only one, two parts, RLE) and one of each bad kind."""
    rng = np.random.default_rng(0)
    annotations = []
    for image_id in range(1, 7):
        width, height = SIZES_WH[image_id]
        for k in range(2):
            polygon, bbox = _shape(rng, width, height)
            category = CATEGORIES[(image_id + k) % 3]["id"]
            entry = {"image_id": image_id, "category_id": category, "bbox": bbox, "iscrowd": 0}
            if (image_id, k) != (1, 1):  # one box-only annotation
                entry["segmentation"] = [polygon]
            annotations.append(entry)
    width, height = SIZES_WH[2]
    two_parts = [[4, 4, 20, 4, 20, 20, 4, 20], [40, 60, 60, 60, 60, 80, 40, 80]]
    annotations.append({"image_id": 2, "category_id": 7, "bbox": [4, 4, 56, 76], "segmentation": two_parts})
    width, height = SIZES_WH[3]
    annotations.append(
        {
            "image_id": 3,
            "category_id": 9,
            "bbox": [20, 30, 40, 30],
            "segmentation": _rle(height, width, (20, 30, 60, 60)),
        }
    )
    for entry in annotations:
        entry.setdefault("iscrowd", 0)
    annotations = [{"id": i + 1, **entry} for i, entry in enumerate(annotations)]
    bad = [
        {"id": CLIPPED_ID, "image_id": 4, "category_id": 3, "bbox": [60, 40, 40, 40]},  # overhangs 80x64
        {"id": OUTSIDE_ID, "image_id": 4, "category_id": 3, "bbox": [90, 70, 5, 5]},
        {"id": ZERO_AREA_ID, "image_id": 4, "category_id": 3, "bbox": [10, 10, 0, 5]},
        {"id": UNKNOWN_CATEGORY_ID, "image_id": 4, "category_id": 42, "bbox": [10, 10, 5, 5]},
        {"id": UNKNOWN_IMAGE_ID, "image_id": 99, "category_id": 3, "bbox": [10, 10, 5, 5]},
        {"id": CROWD_ID, "image_id": 5, "category_id": 3, "bbox": [0, 0, 64, 80], "iscrowd": 1,
         "segmentation": _rle(80, 64, (0, 0, 64, 80))},
        {"id": 107, "image_id": MISSING_FILE_ID, "category_id": 3, "bbox": [10, 10, 20, 20]},
    ]  # fmt: skip
    return annotations + [{"iscrowd": 0, **entry} for entry in bad]


def write_coco_dataset(root: Path, names_in_yaml: bool = False) -> Path:
    """Write images under root/images/train, the JSON under root/annotations and a YAML using it for train and val.

    Returns the YAML. Image 8's file is missing, image 7 is a background, and images lists
    image 2's id twice (the second entry, a file that does not exist, is left out).
    """
    images_dir = root / "images" / "train"
    images_dir.mkdir(parents=True)
    (root / "annotations").mkdir()
    rng = np.random.default_rng(1)
    images = []
    for image_id, (width, height) in SIZES_WH.items():
        name = f"{image_id:012d}.jpg"
        if image_id != MISSING_FILE_ID:
            cv2.imwrite(str(images_dir / name), rng.integers(0, 255, (height, width, 3), np.uint8))
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
    images.append({"id": 2, "file_name": "duplicate.jpg", "width": 10, "height": 10})
    content = {"info": {"description": "test"}, "images": images, "annotations": coco_annotations()}
    content["categories"] = CATEGORIES
    json_path = root / "annotations" / "instances_train.json"
    json_path.write_text(json.dumps(content, indent=1))  # indented: many lines, as exporters write
    lines = [f"path: {root}", "train: images/train", "val: images/train"]
    lines += [
        "train_annotations: annotations/instances_train.json",
        "val_annotations: annotations/instances_train.json",
    ]
    if names_in_yaml:
        lines.append(f"names: {list(NAMES)}")
    yaml_path = root / "coco.yaml"
    yaml_path.write_text("\n".join(lines) + "\n")
    return yaml_path
