"""End to end on a COCO-JSON dataset: segment/train.py (RAM cache, mosaic, copy-paste) and val --save-json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from segment import train as seg_train
from segment import val as seg_val
from tests.coco_fakes import CATEGORIES, NAMES, SIZES_WH, write_coco_dataset
from utils.eval.coco import EVAL_FILE, PREDICTIONS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[1]
COMMON = ["--imgsz", "64", "--workers", "0", "--device", "cpu"]
MODEL = ["--cfg", "yolov5n-seg"]  # its hyp file is a YOLOv5 one


def test_segment_trains_one_epoch_from_the_json_and_scores_with_its_category_ids(tmp_path: Path) -> None:
    data = write_coco_dataset(tmp_path / "coco")  # no names in the YAML: they come from the categories
    hyp = tmp_path / "hyp.yaml"
    text = (REPO / "data" / "hyps" / "hyp.quickstart.yaml").read_text()
    hyp.write_text(text.replace("mixup: 0.0", "mixup: 0.5").replace("copy_paste: 0.0", "copy_paste: 0.5"))
    result = seg_train.main(
        ["--data", str(data), "--epochs", "1", "--batch-size", "4", "--cache", "ram", "--hyp", str(hyp)]
        + ["--project", str(tmp_path / "runs"), "--name", "coco", "--seed", "3", *MODEL, *COMMON]
    )
    assert result.epochs_run == 1 and (result.run_dir / EVAL_FILE).exists()  # the final validation ran COCOeval
    val = seg_val.main(
        ["--weights", str(result.best), "--data", str(data), "--batch-size", "4", "--save-json"]
        + ["--project", str(tmp_path / "val"), "--name", "coco", *COMMON]
    )
    predictions = json.loads((tmp_path / "val" / "coco" / PREDICTIONS_FILE).read_text())
    assert predictions, "nothing to score"
    assert {p["category_id"] for p in predictions} <= {c["id"] for c in CATEGORIES}
    assert {p["image_id"] for p in predictions} <= set(range(1, 8))  # the JSON's ids, not file stems
    for prediction in predictions:  # box and mask in the image's own pixels, as COCOeval reads them
        width, height = SIZES_WH[prediction["image_id"]]
        x, y, box_w, box_h = prediction["bbox"]
        assert 0 <= x <= x + box_w <= width + 0.01 and 0 <= y <= y + box_h <= height + 0.01  # rounded to 3 decimals
        assert 0 < prediction["score"] <= 1
        assert prediction["segmentation"]["size"] == [height, width] and prediction["segmentation"]["counts"]
    # Each image's detected classes, written as the ids of the categories they came from (3, 7, 9).
    written: dict[int, list[int]] = {}
    for prediction in predictions:
        written.setdefault(prediction["image_id"], []).append(prediction["category_id"])
    detected = {int(Path(image.path).stem): image.detections[:, 5] for image in val.predictions}
    expected = {image_id: sorted(CATEGORIES[int(c)]["id"] for c in classes) for image_id, classes in detected.items()}
    assert {image_id: sorted(ids) for image_id, ids in written.items()} == {k: v for k, v in expected.items() if v}
    assert (
        val.metric_source == "pycocotools"
        and json.loads((tmp_path / "val" / "coco" / EVAL_FILE).read_text())["images"] == 7
    )
    assert tuple(torch.load(result.best, weights_only=True)["names"]) == NAMES  # class names from the categories
