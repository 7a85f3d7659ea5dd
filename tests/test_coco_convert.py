"""Tests for utils/data/coco_convert.py: COCO JSON <-> YOLO txt with training's readers, items equal both ways."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.coco_fakes import NAMES, write_coco_dataset
from utils.data.augment import AugmentParams
from utils.data.coco_convert import coco_to_yolo, main
from utils.data.data_config import load_data_config
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.distributed import DistContext
from utils.errors import ConfigError

INDEX_ARRAYS = ("shapes", "labels", "label_offsets", "seg_points", "seg_offsets")


@pytest.fixture
def coco_yaml(tmp_path: Path) -> Path:
    return write_coco_dataset(tmp_path / "coco")


def _options(with_masks: bool, augment: bool) -> DatasetOptions:
    aug = AugmentParams(mosaic=1.0, mixup=0.5, copy_paste=0.5, degrees=10.0) if augment else AugmentParams()
    return DatasetOptions(img_size=64, batch_size=2, augment=augment, aug=aug, with_masks=with_masks, num_classes=3)


def _assert_same_items(first: LoadImagesAndLabels, second: LoadImagesAndLabels) -> None:
    assert first.im_files == second.im_files
    for name in INDEX_ARRAYS:
        np.testing.assert_array_equal(getattr(first.index, name), getattr(second.index, name), err_msg=name)
    for i in range(len(first)):
        key = (i, 1) if first.options.augment else i
        a, b = first[key], second[key]
        assert a.keys() == b.keys()
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[name]), (i, name)
            elif name == "segments":
                assert all(np.array_equal(x, y) for x, y in zip(value, b[name], strict=True)), (i, name)
            else:
                assert value == b[name], (i, name)


@pytest.mark.parametrize("with_masks", [False, True], ids=["detect", "segment"])
def test_json_items_equal_those_of_the_same_labels_written_as_yolo_txt(coco_yaml: Path, with_masks: bool) -> None:
    ctx = DistContext()
    data = load_data_config(coco_yaml, ctx)
    source = data.coco_source("train")
    assert coco_to_yolo(source, with_masks, ctx) == 6  # the 6 images with instances; background and missing: none
    for augment in (False, True):
        from_json = LoadImagesAndLabels(data.split("train"), _options(with_masks, augment), ctx, source)
        from_txt = LoadImagesAndLabels(data.split("train"), _options(with_masks, augment), ctx)
        _assert_same_items(from_json, from_txt)
    polygons = np.diff(from_json.index.seg_offsets)
    assert (polygons != 4).any() == with_masks  # detection reads bbox rows (4 corners), segmentation polygons


def test_command_line_round_trip_json_to_txt_to_json(coco_yaml: Path, tmp_path: Path) -> None:
    main(["to-yolo", "--data", str(coco_yaml), "--task", "segment"])
    txt_yaml = tmp_path / "txt.yaml"
    txt_yaml.write_text(f"path: {coco_yaml.parent}\ntrain: images/train\nval: images/train\nnames: {list(NAMES)}\n")
    out = tmp_path / "back.json"
    main(["to-coco", "--data", str(txt_yaml), "--out", str(out)])
    content = json.loads(out.read_text())
    assert [c["id"] for c in content["categories"]] == [1, 2, 3] and [c["name"] for c in content["categories"]] == list(
        NAMES
    )
    assert [image["id"] for image in content["images"]] == [1, 2, 3, 4, 5, 6, 7]  # numeric stems; 8 has no file
    assert sum("segmentation" not in a for a in content["annotations"]) == 2  # box-only rows stay boxes
    back_yaml = tmp_path / "back.yaml"
    back_yaml.write_text(
        f"path: {coco_yaml.parent}\ntrain: images/train\nval: images/train\ntrain_annotations: {out}\n"
    )
    ctx = DistContext()
    original = LoadImagesAndLabels(
        "unused", _options(True, False), ctx, load_data_config(coco_yaml, ctx).coco_source("train")
    )
    again = LoadImagesAndLabels(
        "unused", _options(True, False), ctx, load_data_config(back_yaml, ctx).coco_source("train")
    )
    assert again.im_files == original.im_files
    np.testing.assert_array_equal(again.index.label_offsets, original.index.label_offsets)
    np.testing.assert_allclose(again.index.labels, original.index.labels, atol=2e-5)  # pixels kept to 1/1000
    np.testing.assert_allclose(again.index.seg_points, original.index.seg_points, atol=2e-5)


def test_to_yolo_needs_annotations_and_to_coco_an_output(coco_yaml: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="to-coco needs --out"):
        main(["to-coco", "--data", str(coco_yaml)])
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"path: {coco_yaml.parent}\ntrain: images/train\nval: images/train\nnames: [a]\n")
    with pytest.raises(ConfigError, match="to-yolo needs 'val_annotations'"):
        main(["to-yolo", "--data", str(plain), "--split", "val"])
