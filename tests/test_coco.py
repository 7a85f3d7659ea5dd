"""Tests for utils/eval/coco.py: annotation loading errors, id mapping, COCO result format, and COCOeval scores."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pycocotools import mask as mask_utils

from utils.data.data_config import load_data_config
from utils.data.image_files import unique_stems
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.eval.coco import (
    EVAL_FILE,
    PREDICTIONS_FILE,
    STAT_NAMES,
    category_mapping,
    coco_evaluate,
    load_annotations,
    output_stems,
    predictions_to_coco,
    stem_image_ids,
    unscorable_segmentations,
)
from utils.eval.evaluate import EvalResult, ImagePredictions
from utils.eval.metrics import DetectionMetrics

MAIN = DistContext()
TINY = SyntheticSpec(num_train=1, num_val=6, max_objects=4, min_object_frac=0.15, min_side=64, max_side=96)
# COCO's 80 category ids (1..90 with gaps), the list its 80 classes map to.
COCO_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-image val split with its COCO instances JSON (category id = class index + 1)."""
    root = tmp_path_factory.mktemp("coco") / "shapes"
    ensure_synthetic_dataset(root, TINY)
    return root


def write_yaml(folder: Path, dataset_root: Path, annotations: Path | None, **extra: Any) -> Path:
    """Write a dataset YAML for `dataset_root` naming `annotations` as the val annotations (if given)."""
    content: dict[str, Any] = {"path": str(dataset_root), "train": "images/train", "val": "images/val"}
    if annotations is not None:
        content["val_annotations"] = str(annotations)
    content.update(names=list(SHAPE_NAMES), **extra)
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


def gt_predictions(
    coco: dict[str, Any], image_dir: Path, class_of: dict[int, int], iou: float = 1.0, with_masks: bool = False
) -> list[ImagePredictions]:
    """Predictions that are the ground truth: one box per annotation, conf 1, class `class_of[category_id]`.

    With `iou` < 1 every box is shifted right by w (1 - iou) / (1 + iou), so it overlaps its own
    box with exactly that IoU. With `with_masks` each detection carries the RLE of its GT polygon.
    """
    predictions = []
    for image in coco["images"]:
        anns = [a for a in coco["annotations"] if a["image_id"] == image["id"]]
        rows, rles = [], []
        for ann in anns:
            x, y, w, h = ann["bbox"]
            x += w * (1 - iou) / (1 + iou)
            rows.append([x, y, x + w, y + h, 1.0, class_of[ann["category_id"]]])
            parts = mask_utils.frPyObjects(ann["segmentation"], image["height"], image["width"])
            rles.append(mask_utils.merge(parts))
        detections = np.array(rows, np.float64).reshape(-1, 6)
        path = str(image_dir / Path(image["file_name"]).name)
        hw = (image["height"], image["width"])
        predictions.append(ImagePredictions(path, hw, detections, rles if with_masks else None))
    return predictions


def fake_result(predictions: list[ImagePredictions], with_masks: bool = False) -> EvalResult:
    """An EvalResult with made-up internal metrics (mAP50 0.25, mAP50-95 0.125) carrying `predictions`."""
    zeros = np.zeros(len(SHAPE_NAMES))
    metrics = DetectionMetrics(0.5, 0.5, 0.25, 0.125, 0.1375, np.arange(len(SHAPE_NAMES)), zeros, zeros, zeros, zeros)
    speed = {"preprocess": 0.0, "inference": 0.0, "nms": 0.0}
    mask_metrics = metrics if with_masks else None
    return EvalResult(metrics, len(predictions), 0, None, speed, predictions=predictions, mask_metrics=mask_metrics)


def read_coco(shapes: Path) -> dict[str, Any]:
    return json.loads((shapes / "annotations" / "instances_val.json").read_text())


# ---------------------------------------------------------------- loading and errors


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "annotations file not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a COCO JSON object"),
        ('{"images": [], "annotations": []}', "no 'categories' list"),
        ('{"images": [], "annotations": [], "categories": []}', "the 'categories' list is empty"),
        ('{"images": {}, "annotations": [], "categories": []}', "no 'images' list"),
        ('{"images": [{"id": 1}], "annotations": [], "categories": []}', r"images\[0\] has no 'id' or 'file_name'"),
        ('{"images": [{"file_name": "a.jpg"}], "annotations": [], "categories": []}', "has no 'id' or 'file_name'"),
        (
            '{"images": [{"id": 1, "file_name": "x/a.jpg"}, {"id": 2, "file_name": "y/a.jpg"}], '
            '"annotations": [], "categories": []}',
            "two images are named 'a.jpg'",
        ),
        (
            '{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 1, "image_id": 1, '
            '"category_id": 1}], "categories": [{"id": 1}]}',
            r"annotations\[0\] has no 'bbox'",
        ),
    ],
)
def test_bad_annotations_file_is_one_line_error_naming_it(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "instances_bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=needle) as error:
        load_annotations(path)
    assert "instances_bad.json" in str(error.value) and "\n" not in str(error.value)


def test_images_indexed_by_basename_and_defaults_filled(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    content = {
        "images": [{"id": 70, "file_name": "val2017/000001.jpg"}, {"id": "b", "file_name": "sub\\dir\\cat.png"}],
        "annotations": [{"id": 5, "image_id": 70, "category_id": 3, "bbox": [1, 2, 4, 2.5]}],
        "categories": [{"id": 3, "name": "x"}],
    }
    path.write_text(json.dumps(content))
    annotations = load_annotations(path)
    assert annotations.image_ids == {"000001.jpg": 70, "cat.png": "b"}
    ann = annotations.dataset["annotations"][0]
    assert ann["area"] == 10.0 and ann["iscrowd"] == 0


# ---------------------------------------------------------------- category mapping


def test_default_mapping_follows_ascending_category_ids() -> None:
    categories = [{"id": 90, "name": "p"}, {"id": 3, "name": "q"}, {"id": 40, "name": "r"}]
    assert category_mapping(("a", "b", "c"), categories, None, Path("f.json")) == (3, 40, 90)


def test_coco_80_classes_map_to_its_91_ids() -> None:
    categories = [{"id": cid, "name": f"cat{cid}"} for cid in reversed(COCO_IDS)]
    mapping = category_mapping(tuple(f"class{i}" for i in range(80)), categories, None, Path("f.json"))
    assert mapping[0] == 1 and mapping[11] == 13 and mapping[79] == 90 and mapping == tuple(COCO_IDS)


def test_equal_names_map_by_name_in_any_order() -> None:
    categories = [{"id": 7, "name": "dog"}, {"id": 2, "name": "cat"}, {"id": 5, "name": "cow"}]
    assert category_mapping(("cat", "cow", "dog"), categories, None, Path("f.json")) == (2, 5, 7)


def test_names_partly_swapped_or_misspelt_are_refused_rather_than_mapped_by_id() -> None:
    # Class 0 'triangle' would take category 1 'circle' by ascending ids while the file has 'triangle' (id 2):
    # it would train on circles. Names that share none with the categories still map by id order.
    categories = [{"id": 1, "name": "circle"}, {"id": 2, "name": "triangle"}, {"id": 3, "name": "crescent"}]
    message = "f.json: class 0 'triangle' would take category 1 'circle' (ascending ids), but the file's category"
    with pytest.raises(ConfigError, match=re.escape(message)):
        category_mapping(("triangle", "circle", "moon"), categories, None, Path("f.json"))
    assert category_mapping(("circle", "triangle", "moon"), categories, None, Path("f.json")) == (1, 2, 3)
    assert category_mapping(("kreis", "dreieck", "mond"), categories, None, Path("f.json")) == (1, 2, 3)


def test_explicit_mapping_overrides_names_and_is_checked() -> None:
    categories = [{"id": 7, "name": "dog"}, {"id": 2, "name": "cat"}]
    assert category_mapping(("cat", "dog"), categories, (7, 2), Path("f.json")) == (7, 2)
    with pytest.raises(ConfigError, match="f.json: category_ids lists category 9"):
        category_mapping(("cat", "dog"), categories, (7, 9), Path("f.json"))


def test_count_mismatch_without_mapping_is_one_line_error() -> None:
    with pytest.raises(ConfigError, match="f.json: 2 categories but the dataset has 3 classes; set 'category_ids:'"):
        category_mapping(("a", "b", "c"), [{"id": 1, "name": "x"}, {"id": 2, "name": "y"}], None, Path("f.json"))


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("[1, 2]", "'category_ids' has 2 entries but 'names' has 6 classes"),
        ("[1, 2, 3, 4, 5, x]", "must be a list of integers"),
        ("[1, 2, 3, 4, 5, true]", "must be a list of integers"),
        ("7", "must be a list of integers"),
        ("[1, 2, 3, 4, 5, 1]", "lists category 1 more than once"),
    ],
)
def test_bad_category_ids_in_yaml_is_one_line_error(shapes: Path, tmp_path: Path, value: str, needle: str) -> None:
    yaml_file = write_yaml(tmp_path, shapes, None)
    yaml_file.write_text(yaml_file.read_text() + f"category_ids: {value}\n")
    with pytest.raises(ConfigError, match=needle) as error:
        load_data_config(yaml_file, MAIN)
    assert "data.yaml" in str(error.value)


def test_category_ids_parsed_from_yaml(shapes: Path, tmp_path: Path) -> None:
    data = load_data_config(write_yaml(tmp_path, shapes, None, category_ids=[9, 8, 7, 6, 5, 4]), MAIN)
    assert data.category_ids == (9, 8, 7, 6, 5, 4)
    assert load_data_config(write_yaml(tmp_path, shapes, None), MAIN).category_ids is None


# ---------------------------------------------------------------- COCO result format


def test_predictions_to_coco_format_rounding_and_masks() -> None:
    rle = mask_utils.encode(np.asfortranarray(np.eye(4, dtype=np.uint8)))  # counts as bytes
    detections = np.array([[10.12345, 20.5, 30.0, 60.25, 0.1234567, 2], [0, 0, 1, 1, 0.5, 0]], np.float32)
    items = [ImagePredictions("/d/images/000012.jpg", (4, 4), detections, [rle, rle])]
    results = predictions_to_coco(items, {"000012.jpg": 12}, (1, 3, 90))
    first = results[0]
    assert first["image_id"] == 12 and first["category_id"] == 90
    assert first["bbox"] == [10.123, 20.5, 19.877, 39.75] and first["score"] == 0.12346
    assert first["segmentation"] == {"size": [4, 4], "counts": rle["counts"].decode()}
    assert results[1]["category_id"] == 1 and results[1]["bbox"] == [0.0, 0.0, 1.0, 1.0]
    json.dumps(results)  # JSON-serialisable as is


def test_images_missing_from_annotations_are_reported_not_dropped_silently(caplog: pytest.LogCaptureFixture) -> None:
    one = np.array([[0, 0, 2, 2, 0.9, 0]], np.float32)
    items = [ImagePredictions(f"/d/{name}", (4, 4), one) for name in ("a.jpg", "zz1.jpg", "b.jpg", "zz2.jpg")]
    with caplog.at_level(logging.WARNING):
        results = predictions_to_coco(items, {"a.jpg": 1, "b.jpg": 2}, (5,))
    assert [r["image_id"] for r in results] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 evaluated images" in warnings[0] and "zz1.jpg" in warnings[0]


def test_stem_image_ids_are_ints_when_numeric_and_unique_per_image() -> None:
    assert stem_image_ids(output_stems(["/x/000012.jpg", "/x/cat_3.png"], MAIN, "ids")) == {
        "/x/000012.jpg": 12,
        "/x/cat_3.png": "cat_3",
    }
    # One stem in two folders, or with two suffixes: an id each (one id would merge their detections).
    paths = ("/b/x.jpg", "/a/x.jpg", "/a/x.png")
    items = [ImagePredictions(p, (10, 10), np.array([[1.0, 1.0, 5.0, 5.0, 0.9, 0]])) for p in paths]
    ids = stem_image_ids(output_stems(paths, MAIN, "ids"))
    assert ids == {"/a/x.jpg": "x", "/a/x.png": "x-2", "/b/x.jpg": "x-3"}
    assert sorted(r["image_id"] for r in predictions_to_coco(items, ids, (1,))) == ["x", "x-2", "x-3"]
    # Two stems of one number (1 and 001) keep their names; a digit that is not ASCII is a name too.
    paths = ("/a/1.jpg", "/b/001.jpg", "/b/0002.jpg", "/b/\u00b2.jpg")
    assert stem_image_ids(output_stems(paths, MAIN, "ids")) == {
        "/a/1.jpg": "1", "/b/001.jpg": "001", "/b/0002.jpg": 2, "/b/\u00b2.jpg": "\u00b2"
    }  # fmt: skip


def test_unique_stems_number_past_real_names_in_one_pass() -> None:
    files = ["/a/x-2.jpg", "/a/x.jpg", "/a/x.png", "/b/x.jpg"]
    assert unique_stems(files) == (
        ["x-2", "x", "x-3", "x-4"],  # a real x-2 is not given to another file
        ["/a/x.png -> x-3", "/b/x.jpg -> x-4"],
    )
    many = [f"/{i}/image.jpg" for i in range(20000)]  # the <id>/image.jpg layout: was quadratic
    stems, renamed = unique_stems(many)
    assert len(set(stems)) == 20000 and stems[-1] == "image-20000" and len(renamed) == 19999


# ---------------------------------------------------------------- COCOeval scores


def test_perfect_predictions_score_one_for_boxes_and_masks(shapes: Path, tmp_path: Path) -> None:
    coco = read_coco(shapes)
    data = load_data_config(write_yaml(tmp_path, shapes, shapes / "annotations" / "instances_val.json"), MAIN)
    predictions = gt_predictions(coco, shapes / "images" / "val", {i + 1: i for i in range(6)}, with_masks=True)
    result = coco_evaluate(fake_result(predictions, with_masks=True), data, "val", tmp_path / "run", MAIN)
    assert result.metric_source == "pycocotools"
    for metrics in (result.metrics, result.mask_metrics):
        # COCOeval's precision is tp / (tp + fp + eps), so "1" may be 1 - 2e-16.
        assert metrics.map50 == pytest.approx(1.0, abs=1e-12) and metrics.map50_95 == pytest.approx(1.0, abs=1e-12)
        assert metrics.fitness == pytest.approx(1.0, abs=1e-12)
        present = sorted({a["category_id"] - 1 for a in coco["annotations"]})
        assert metrics.ap[present] == pytest.approx(1.0, abs=1e-12) and metrics.ap50[present] == pytest.approx(1.0)
    assert result.metrics.precision == 0.5  # P and R stay the internal ones
    saved = json.loads((tmp_path / "run" / EVAL_FILE).read_text())
    assert set(saved["bbox"]) == set(STAT_NAMES) and saved["bbox"]["AP"] > 1 - 1e-12 and saved["segm"]["AP"] > 1 - 1e-12
    assert saved["images"] == TINY.num_val
    written = json.loads((tmp_path / "run" / PREDICTIONS_FILE).read_text())
    assert len(written) == len(coco["annotations"]) and all("segmentation" in r for r in written)


def test_shifted_boxes_score_only_the_iou_thresholds_they_pass(shapes: Path, tmp_path: Path) -> None:
    # IoU 0.62 with its own box: a true positive at thresholds 0.50, 0.55, 0.60 and missed at 0.65..0.95.
    coco = read_coco(shapes)
    data = load_data_config(write_yaml(tmp_path, shapes, shapes / "annotations" / "instances_val.json"), MAIN)
    predictions = gt_predictions(coco, shapes / "images" / "val", {i + 1: i for i in range(6)}, iou=0.62)
    result = coco_evaluate(fake_result(predictions), data, "val", tmp_path / "run", MAIN)
    assert result.metrics.map50 == pytest.approx(1.0, abs=1e-12)
    assert result.metrics.map50_95 == pytest.approx(0.3, abs=1e-12)
    assert result.metrics.fitness == pytest.approx(0.1 * 1.0 + 0.9 * 0.3)
    saved = json.loads((tmp_path / "run" / EVAL_FILE).read_text())
    assert saved["bbox"]["AP75"] == 0.0


def _remapped_annotations(shapes: Path, folder: Path, new_ids: list[int]) -> tuple[Path, dict[str, Any]]:
    """Copy the val annotations with image ids that are not stems, file names under a folder, and category
    `c` renumbered to `new_ids[c - 1]` (renamed, so names cannot be matched)."""
    coco = read_coco(shapes)
    new_image_id = {image["id"]: 1000 + 7 * image["id"] for image in coco["images"]}
    for image in coco["images"]:
        image["id"] = new_image_id[image["id"]]
        image["file_name"] = f"val2017/{image['file_name']}"
    for ann in coco["annotations"]:
        ann["image_id"] = new_image_id[ann["image_id"]]
        ann["category_id"] = new_ids[ann["category_id"] - 1]
    coco["categories"] = [{"id": cid, "name": f"category{cid}"} for cid in new_ids]
    path = folder / "remapped.json"
    path.write_text(json.dumps(coco))
    return path, coco


@pytest.mark.parametrize("explicit", [False, True])
def test_ids_mapped_by_file_name_and_category_order(shapes: Path, tmp_path: Path, explicit: bool) -> None:
    # Without a mapping class c -> the c-th smallest id; an explicit category_ids list reverses that here.
    new_ids = [90, 77, 40, 12, 7, 3] if explicit else [3, 7, 12, 40, 77, 90]
    path, coco = _remapped_annotations(shapes, tmp_path, new_ids)
    extra = {"category_ids": new_ids} if explicit else {}
    data = load_data_config(write_yaml(tmp_path, shapes, path, **extra), MAIN)
    class_of = {cid: index for index, cid in enumerate(new_ids)}
    predictions = gt_predictions(coco, shapes / "images" / "val", class_of)
    result = coco_evaluate(fake_result(predictions), data, "val", tmp_path / "run", MAIN)
    assert result.metrics.map50_95 == pytest.approx(1.0, abs=1e-12)
    written = json.loads((tmp_path / "run" / PREDICTIONS_FILE).read_text())
    assert {r["image_id"] for r in written} <= {1000 + 7 * (i + 1) for i in range(TINY.num_val)}
    first = coco["annotations"][0]
    assert first["category_id"] in {r["category_id"] for r in written if r["image_id"] == first["image_id"]}


def test_zero_predictions_give_zero_and_a_warning(shapes: Path, tmp_path: Path, caplog) -> None:
    data = load_data_config(write_yaml(tmp_path, shapes, shapes / "annotations" / "instances_val.json"), MAIN)
    empty = [ImagePredictions(str(p), (64, 64), np.zeros((0, 6))) for p in (shapes / "images" / "val").glob("*.jpg")]
    with caplog.at_level(logging.WARNING):
        result = coco_evaluate(fake_result(empty), data, "val", tmp_path / "run", MAIN)
    assert result.metrics.map50 == 0.0 and result.metrics.map50_95 == 0.0 and result.metric_source == "pycocotools"
    assert any("No detections" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "run" / PREDICTIONS_FILE).read_text()) == []


def test_without_annotations_internal_metric_and_stem_ids(shapes: Path, tmp_path: Path) -> None:
    data = load_data_config(write_yaml(tmp_path, shapes, None), MAIN)
    predictions = gt_predictions(read_coco(shapes), shapes / "images" / "val", {i + 1: i for i in range(6)})
    original = fake_result(predictions)
    result = coco_evaluate(original, data, "val", tmp_path / "run", MAIN)
    assert result is original and result.metric_source == "internal"
    written = json.loads((tmp_path / "run" / PREDICTIONS_FILE).read_text())
    assert {r["image_id"] for r in written} <= set(range(1, TINY.num_val + 1))
    assert {r["category_id"] for r in written} <= set(range(6))
    assert not (tmp_path / "run" / EVAL_FILE).exists()


def test_evaluated_images_absent_from_annotations_is_an_error(shapes: Path, tmp_path: Path) -> None:
    data = load_data_config(write_yaml(tmp_path, shapes, shapes / "annotations" / "instances_val.json"), MAIN)
    strangers = [ImagePredictions("/x/unknown.jpg", (8, 8), np.zeros((0, 6)))]
    with pytest.raises(ConfigError, match="none of the 1 evaluated images is in this annotations file"):
        coco_evaluate(fake_result(strangers), data, "val", tmp_path / "run", MAIN)


def test_single_cls_ignores_categories(shapes: Path, tmp_path: Path) -> None:
    # Every box predicted as class 0 ("item"): with categories ignored they are all correct.
    coco = read_coco(shapes)
    data = load_data_config(write_yaml(tmp_path, shapes, shapes / "annotations" / "instances_val.json"), MAIN)
    predictions = gt_predictions(coco, shapes / "images" / "val", {i + 1: 0 for i in range(6)})
    result = coco_evaluate(fake_result(predictions), data, "val", tmp_path / "run", MAIN, single_cls=True)
    assert result.metrics.map50_95 == pytest.approx(1.0, abs=1e-12)


def test_segmentations_cocoeval_cannot_rasterise_are_named() -> None:
    polygon = [[1.0, 1.0, 9.0, 1.0, 9.0, 9.0]]
    dataset = {
        "images": [{"id": 1, "height": 20, "width": 30}, {"id": 2, "height": 20, "width": 30}, {"id": 3}],
        "annotations": [
            {"id": 10, "image_id": 1, "segmentation": polygon},
            {"id": 11, "image_id": 1, "segmentation": {"size": [20, 30], "counts": "abc"}},
            {"id": 12, "image_id": 1, "segmentation": {"size": [30, 20], "counts": "abc"}},  # transposed
            {"id": 13, "image_id": 1, "segmentation": []},
            {"id": 14, "image_id": 1, "segmentation": [[1.0, 1.0, 9.0, 9.0]]},  # pycocotools: a box
            {"id": 15, "image_id": 1, "segmentation": [[1.0, 1.0, 9.0, 1.0, 9.0]]},  # odd: pycocotools rasterises it
            {"id": 19, "image_id": 1, "segmentation": [polygon[0], [1.0, 2.0]]},  # a short later part: also
            {"id": 20, "image_id": 1, "segmentation": [[1.0, 2.0], polygon[0]]},  # a short first part: fails
            {"id": 16, "image_id": 1},
            {"id": 17, "image_id": 2, "segmentation": []},  # an image not evaluated
            {"id": 18, "image_id": 3, "segmentation": polygon},  # its image has no size
        ],
    }
    assert unscorable_segmentations(dataset, {1, 3}) == [12, 13, 14, 20, 16, 18]
    assert unscorable_segmentations(dataset, {2}) == [17]
