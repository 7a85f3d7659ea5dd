"""Tests for a COCO-JSON split (utils/data/coco_labels.py, coco_node.py): summary, cache, ranks, classes."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import utils.data.coco_labels as coco_labels_module
import utils.data.coco_node as coco_node
from tests.coco_fakes import CATEGORIES, CLIPPED_ID, NAMES, write_coco_dataset
from tests.dist_helpers import run_distributed
from utils.data.coco_labels import OTHER_CATEGORY, scan_coco_labels
from utils.data.coco_reader import CROWD, OUTSIDE
from utils.data.data_config import load_data_config
from utils.data.labels import LabelIndex
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.eval.coco import _coco_api, _score, load_coco_target, predictions_to_coco, run_cocoeval
from utils.eval.evaluate import ImagePredictions

INDEX_ARRAYS = ("shapes", "labels", "label_offsets", "seg_points", "seg_offsets")


@pytest.fixture
def coco_yaml(tmp_path: Path) -> Path:
    return write_coco_dataset(tmp_path / "coco")


def test_names_come_from_the_categories_and_bad_entries_are_counted_in_the_summary(
    coco_yaml: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = load_data_config(coco_yaml, DistContext())
    assert data.names == NAMES and data.annotations["train"] == data.annotations["val"]
    with caplog.at_level(logging.INFO):
        index = scan_coco_labels(data.coco_source("train"), False, DistContext())
    summary = [r.getMessage() for r in caplog.records if "found," in r.getMessage()][-1]
    assert "6 found, 1 missing (background), 0 empty, 1 corrupt" in summary
    for reason in (f"1 {CROWD}", f"1 {OUTSIDE}", "1 image files not found", "1 image entries left out"):
        assert reason in summary
    assert index.counts == {"found": 6, "missing": 1, "empty": 0, "corrupt": 1}
    assert len(index) == 7 and sum(f"annotation {CLIPPED_ID}:" in m for m in index.messages) == 1


def test_second_scan_maps_the_cache_without_reading_the_json(coco_yaml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = load_data_config(coco_yaml, DistContext()).coco_source("train")
    first = scan_coco_labels(source, True, DistContext())

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("read again although the caches are current")

    monkeypatch.setattr(coco_node, "read_coco_json", refuse)
    monkeypatch.setattr(coco_labels_module, "scan_in_rounds", refuse)
    again = scan_coco_labels(source, True, DistContext())
    for name in INDEX_ARRAYS:
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not again.labels.flags.writeable  # a read-only map of the cache file, shared by the node's ranks
    assert again.messages == first.messages and again.problems == first.problems


def test_an_image_folder_whose_name_is_not_utf8_is_scanned_and_cached(tmp_path: Path) -> None:
    import os

    import cv2

    from utils.data.coco_labels import CocoSource

    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))  # Latin-1 byte: not valid UTF-8
    root.mkdir()
    (root / "a.jpg").write_bytes(cv2.imencode(".jpg", np.full((32, 32, 3), 90, np.uint8))[1].tobytes())
    document = {"images": [{"id": 1, "file_name": "a.jpg", "width": 32, "height": 32}],
                "annotations": [{"id": 5, "image_id": 1, "category_id": 1, "bbox": [4, 4, 10, 10], "iscrowd": 0}],
                "categories": [{"id": 1, "name": "thing"}]}  # fmt: skip
    (tmp_path / "instances.json").write_text(json.dumps(document))
    source = CocoSource(tmp_path / "instances.json", root, ("thing",))
    for _ in range(2):  # scanned, then read from its cache
        index = scan_coco_labels(source, False, DistContext())
        assert len(index) == 1 and index.labels_of(0).tolist() == [[0.0, 0.28125, 0.28125, 0.3125, 0.3125]]


def test_class_mapping_by_name_and_by_explicit_category_ids(coco_yaml: Path) -> None:
    text = coco_yaml.read_text()
    coco_yaml.write_text(text + "names: [cow, cat, dog]\n")  # another order: classes follow the names
    data = load_data_config(coco_yaml, DistContext())
    by_name = scan_coco_labels(data.coco_source("train"), False, DistContext())
    coco_yaml.write_text(text + "names: [dog, cat]\ncategory_ids: [7, 3]\n")  # a subset: cows are left out
    data = load_data_config(coco_yaml, DistContext())
    subset = scan_coco_labels(data.coco_source("train"), False, DistContext())
    assert subset.problems[OTHER_CATEGORY] > 0
    cow = 0  # class 0 is 'cow' (id 9) in the first YAML; 'dog' is class 1 there, 0 in the second
    kept = by_name.labels[by_name.labels[:, 0] != cow]
    assert len(subset.labels) == len(kept)
    np.testing.assert_array_equal(subset.labels[:, 0], np.where(kept[:, 0] == 2, 0, 1))
    coco_yaml.write_text(text + "names: [a, b]\n")
    data = load_data_config(coco_yaml, DistContext())
    with pytest.raises(ConfigError, match="3 categories but the dataset has 2 classes"):
        scan_coco_labels(data.coco_source("train"), False, DistContext())


def test_annotations_need_one_image_folder(coco_yaml: Path) -> None:
    coco_yaml.write_text(coco_yaml.read_text().replace("train: images/train", "train: [images/train, images/train]"))
    with pytest.raises(ConfigError, match="'train_annotations' needs 'train' to be one image folder"):
        load_data_config(coco_yaml, DistContext())


def _scan_on_rank(ctx: DistContext, yaml_path: Path) -> dict[str, Any]:
    """Load the YAML (names from the JSON) and scan the split on this rank; count the JSON reads."""
    reads = []
    original = coco_node.read_coco_json

    def counting(path: Path) -> Any:
        reads.append(str(path))
        return original(path)

    coco_node.read_coco_json = counting
    data = load_data_config(yaml_path, ctx)
    index = scan_coco_labels(data.coco_source("train"), True, ctx)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(getattr(index, n)).tobytes() for n in INDEX_ARRAYS))
    return {"reads": len(reads), "names": data.names, "files": index.im_files, "digest": digest.hexdigest()}


@pytest.mark.distributed
def test_two_ranks_of_a_node_read_the_json_once_and_see_the_same_labels(coco_yaml: Path, tmp_path: Path) -> None:
    results = run_distributed(_scan_on_rank, 2, tmp_path / "dist", coco_yaml)
    assert [r["reads"] for r in results] == [1, 0]  # the node's local main rank only
    assert results[0]["names"] == results[1]["names"] == NAMES
    assert results[0]["files"] == results[1]["files"] and results[0]["digest"] == results[1]["digest"]
    single = _scan_on_rank(DistContext(), coco_yaml)  # caches current now: nothing is read again
    assert single["reads"] == 0 and single["digest"] == results[0]["digest"]


def test_labels_written_back_as_predictions_carry_the_original_category_ids(coco_yaml: Path) -> None:
    """Class indices -> --save-json category ids -> pycocotools: every kept ground truth is found again."""
    data = load_data_config(coco_yaml, DistContext())
    index = scan_coco_labels(data.coco_source("val"), False, DistContext())
    target = load_coco_target(data, "val")
    assert target is not None and target.category_ids == (3, 7, 9)  # sorted ids, as the labels were mapped
    predictions = _labels_as_predictions(index)
    results = predictions_to_coco(predictions, target.annotations.image_ids, target.category_ids)
    sizes: dict[int, tuple[int, int]] = {}
    for image in target.annotations.dataset["images"]:  # the first entry of an id counts (the reader's rule)
        sizes.setdefault(image["id"], (image["width"], image["height"]))
    for result in results:  # each prediction is one ground-truth box (clipped to the image) of the same category
        width, height = sizes[result["image_id"]]
        matches = [
            a
            for a in target.annotations.dataset["annotations"]
            if a["image_id"] == result["image_id"]
            and np.allclose(_clipped(a["bbox"], width, height), result["bbox"], atol=1e-3)
        ]
        assert len(matches) == 1 and matches[0]["category_id"] == result["category_id"], result
    evaluator = run_cocoeval(
        _coco_api(target.scored_dataset()), results, "bbox", sorted({r["image_id"] for r in results})
    )
    # AP50: 14 of the 17 ground truths of known categories; the clipped box and the boxes left out
    # (outside the image, zero area) are missed. A wrong class -> category mapping would score near 0.
    assert 0.8 < evaluator.stats[1] < 0.9


def _labels_as_predictions(index: LabelIndex) -> list[ImagePredictions]:
    """Every label of `index` as a detection of score 1, in original pixels."""
    predictions = []
    for i, path in enumerate(index.im_files):
        width, height = index.shapes[i].tolist()
        labels = index.labels_of(i).astype(np.float64)
        xyxy = np.concatenate([labels[:, 1:3] - labels[:, 3:] / 2, labels[:, 1:3] + labels[:, 3:] / 2], 1)
        detections = np.concatenate(
            [xyxy * [width, height, width, height], np.ones((len(labels), 1)), labels[:, :1]], 1
        )
        predictions.append(ImagePredictions(path, (height, width), detections, None))
    return predictions


@pytest.mark.parametrize("single_cls", [False, True])
def test_categories_the_dataset_leaves_out_are_not_scored(coco_yaml: Path, tmp_path: Path, single_cls: bool) -> None:
    """A file with more categories than classes (`category_ids:` picks the classes) scores as one without them."""
    data = load_data_config(coco_yaml, DistContext())
    predictions = _labels_as_predictions(scan_coco_labels(data.coco_source("val"), False, DistContext()))
    if single_cls:  # one class: every detection is class 0
        for prediction in predictions:
            prediction.detections[:, 5] = 0
    class_ids = {"bbox": np.arange(1 if single_cls else len(NAMES))}
    (tmp_path / "plain").mkdir()
    (tmp_path / "more").mkdir()
    plain = load_coco_target(data, "val", single_cls)
    assert plain is not None
    expected = _score(predictions, plain, class_ids, tmp_path / "plain")["bbox"]
    # Another category with a ground truth in every image: scoring it would add misses (and, with
    # categories, a class of AP 0 to the mean).
    content = plain.annotations.dataset
    extra = [
        {"id": 10_000 + image["id"], "image_id": image["id"], "category_id": 11, "bbox": [1, 1, 4, 4], "area": 16.0}
        for image in content["images"]
    ]
    file = tmp_path / "more_categories.json"
    file.write_text(
        json.dumps(
            {
                **content,
                "categories": [*CATEGORIES, {"id": 11, "name": "other"}],
                "annotations": content["annotations"] + extra,
            }
        )  # fmt: skip
    )
    yaml_text = coco_yaml.read_text().replace("annotations/instances_train.json", str(file))
    yaml_path = tmp_path / "more_categories.yaml"
    yaml_path.write_text(yaml_text + f"names: {list(NAMES)}\ncategory_ids: [3, 7, 9]\n")
    target = load_coco_target(load_data_config(yaml_path, DistContext()), "val", single_cls)
    assert target is not None
    scored = _score(predictions, target, class_ids, tmp_path / "more")["bbox"]
    assert scored["stats"]["AP"] == pytest.approx(expected["stats"]["AP"]) and 0.5 < expected["stats"]["AP"] < 1
    assert scored["ap"] == pytest.approx(expected["ap"])


def test_single_cls_scores_every_category_when_the_names_do_not_map_to_them(coco_yaml: Path, tmp_path: Path) -> None:
    yaml_path = tmp_path / "one_name.yaml"
    yaml_path.write_text(coco_yaml.read_text() + "names: [item]\n")
    data = load_data_config(yaml_path, DistContext())
    with pytest.raises(ConfigError, match="3 categories but the dataset has 1 classes"):
        load_coco_target(data, "val")
    target = load_coco_target(data, "val", single_cls=True)  # one class: any object counts
    assert target is not None and target.scored_categories == (3, 7, 9) and target.category_ids == (3,)
    assert target.scored_dataset() is target.annotations.dataset


def _clipped(bbox: list[float], width: int, height: int) -> list[float]:
    """A COCO [x, y, w, h] box cut to the image."""
    x1, y1 = max(bbox[0], 0), max(bbox[1], 0)
    x2, y2 = min(bbox[0] + bbox[2], width), min(bbox[1] + bbox[3], height)
    return [x1, y1, x2 - x1, y2 - y1]
