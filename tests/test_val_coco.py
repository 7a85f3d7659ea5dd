"""End-to-end COCO validation: val.py --save-json against pycocotools run directly, 2 gloo ranks, errors, speed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

import val
from segment import val as segment_val
from segment.task import SEGMENT
from tests.dist_helpers import PROCESS_TIMEOUT_S, run_distributed
from utils.checkpoint import RunInfo, build_checkpoint, load_checkpoint, save_checkpoint
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset
from utils.distributed import DistContext, gather_objects
from utils.errors import ConfigError
from utils.eval.checkpoint_val import prepare_validation, save_txt, validate_checkpoint
from utils.eval.coco import EVAL_FILE, PREDICTIONS_FILE, STAT_NAMES, output_stems
from utils.eval.config import ValConfig, build_val_parser, val_config_from_args
from utils.eval.evaluate import ImagePredictions
from utils.families import build_model as build_family_model
from utils.tasks import DETECT, Task

REPO = Path(__file__).resolve().parents[1]
# Originals of 128-160 px validated at 64 px: boxes in original pixels reach well past 64.
TINY = SyntheticSpec(num_train=1, num_val=8, max_objects=3, min_object_frac=0.2, min_side=128, max_side=160)
IMGSZ = 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dataset YAML naming the val annotations, annotations file) of an 8-image val split."""
    folder = tmp_path_factory.mktemp("valcoco")
    root = ensure_synthetic_dataset(folder / "shapes", TINY)
    annotations = root / "annotations" / "instances_val.json"
    content = {"path": str(root), "train": "images/train", "val": "images/val", "names": list(SHAPE_NAMES)}
    yaml_file = folder / "coco.yaml"
    yaml_file.write_text(yaml.safe_dump({**content, "val_annotations": str(annotations)}))
    return yaml_file, annotations


def untrained_checkpoint(path: Path, task: Task, cfg: str) -> Path:
    """Save an untrained `cfg` model whose objectness and class logits are biased to 0 (scores 0.5), so it
    outputs boxes at any confidence threshold below 0.25. A segmentation model's prototypes and mask
    coefficients are biased positive, so each mask fills its box (a box-shaped mask overlaps its object)."""
    torch.manual_seed(0)
    spec = task.spec_from_cfg(cfg, len(SHAPE_NAMES))
    model = build_family_model(spec)
    with torch.no_grad():
        for conv in model.head.convs:
            bias = conv.bias.view(model.head.num_anchors, model.head.num_outputs)
            bias[:, 4 : 5 + len(SHAPE_NAMES)] = 0.0
            bias[:, 5 + len(SHAPE_NAMES) :] = 3.0
        if hasattr(model.head, "proto"):
            model.head.proto.project.bn.bias.fill_(5.0)
    run = RunInfo(task=task.name, model_spec=spec.to_dict(), names=list(SHAPE_NAMES), train_config={}, hyp={})
    checkpoint = build_checkpoint(
        run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0.0
    )
    save_checkpoint(checkpoint, path, DistContext())
    return path


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained detection checkpoint that outputs boxes."""
    return untrained_checkpoint(tmp_path_factory.mktemp("weights") / "untrained.pt", DETECT, "yolov5n")


def _val_args(weights: Path, data: Path, project: Path, *extra: str, imgsz: int = IMGSZ) -> list[str]:
    return ["--weights", str(weights), "--data", str(data), "--imgsz", str(imgsz), "--batch-size", "4",
            "--workers", "0", "--device", "cpu", "--project", str(project), "--name", "v", *extra]  # fmt: skip


def test_save_txt_gives_images_of_one_stem_a_file_each_on_every_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = ["/d/b/x.jpg", "/d/a/x.jpg", "/d/a/x.png", "/d/a/y.jpg"]
    with caplog.at_level(logging.WARNING):
        stems = output_stems(paths, DistContext(), "labels")
    assert stems == {"/d/a/x.jpg": "x", "/d/a/x.png": "x-2", "/d/a/y.jpg": "y", "/d/b/x.jpg": "x-3"}
    assert "2 image(s) share a file stem with another; labels renamed (first: /d/a/x.png -> x-2)" in caplog.text
    assert output_stems(list(reversed(paths)), DistContext(rank=1, world_size=2), "labels") == stems  # any rank
    box, other = np.array([[2.0, 2.0, 6.0, 6.0, 0.9, 1.0]]), np.array([[0.0, 0.0, 8.0, 8.0, 0.9, 3.0]])
    rank_shards = ([ImagePredictions(paths[0], (10, 10), box), ImagePredictions(paths[1], (10, 10), other)],
                   [ImagePredictions(p, (10, 10), box) for p in paths[2:]])  # fmt: skip
    for shard in rank_shards:  # each rank writes its own images into the shared folder
        save_txt(types.SimpleNamespace(predictions=shard), tmp_path / "labels", stems)
    written = {f.stem: f.read_text() for f in (tmp_path / "labels").glob("*.txt")}
    assert sorted(written) == ["x", "x-2", "x-3", "y"]
    assert written["x-3"] == "1 0.400000 0.400000 0.400000 0.400000\n"  # /d/b/x.jpg, the first shard's box
    assert written["x"] == "3 0.400000 0.400000 0.800000 0.800000\n"  # /d/a/x.jpg, the other box


def test_val_takes_its_default_size_from_the_checkpoint(dataset, weights: Path, tmp_path: Path) -> None:
    data, _ = dataset
    checkpoint = load_checkpoint(weights)
    checkpoint["train_config"] = {"imgsz": 96}
    trained_96 = tmp_path / "trained_96.pt"
    save_checkpoint(checkpoint, trained_96, DistContext())
    argv = _val_args(trained_96, data, tmp_path)
    without_imgsz = argv[: argv.index("--imgsz")] + argv[argv.index("--imgsz") + 2 :]
    for args, expected in ((without_imgsz, 96), (argv, IMGSZ)):
        cfg = val_config_from_args(build_val_parser().parse_args(args))
        setup = prepare_validation(cfg, DETECT, DistContext())
        assert setup.imgsz == expected and setup.loader.dataset.options.img_size == expected


def _direct_cocoeval(annotations: Path, predictions: Path | list, iou_type: str = "bbox") -> np.ndarray:
    """The 12 COCOeval numbers of a results file (or list), computed the way pycocotools' own example does."""
    gt = COCO(str(annotations))
    evaluator = COCOeval(gt, gt.loadRes(predictions if isinstance(predictions, list) else str(predictions)), iou_type)
    evaluator.params.imgIds = sorted(gt.getImgIds())
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return evaluator.stats


@pytest.mark.slow
def test_save_json_reports_exactly_what_cocoeval_gives(dataset, weights: Path, tmp_path: Path, caplog) -> None:
    data, annotations = dataset
    with caplog.at_level(logging.INFO):
        result = val.main(_val_args(weights, data, tmp_path, "--save-json", "--save-txt", "--plots"))
    run_dir = tmp_path / "v"
    # Boxes are in original-image pixels: inside each image, and beyond the 64 px network input.
    size = {image["id"]: (image["width"], image["height"]) for image in json.loads(annotations.read_text())["images"]}
    boxes = json.loads((run_dir / PREDICTIONS_FILE).read_text())
    right = [r["bbox"][0] + r["bbox"][2] for r in boxes]
    inside = all(0 <= r["bbox"][0] and x2 <= size[r["image_id"]][0] + 1e-3 for r, x2 in zip(boxes, right, strict=True))
    assert inside and max(right) > 1.5 * IMGSZ, "predictions.json boxes are not in (clipped) original-image pixels"
    stats = _direct_cocoeval(annotations, run_dir / PREDICTIONS_FILE)
    assert stats[8] > 0, "the untrained model should find some objects (AR100), or this comparison is vacuous"
    assert result.metric_source == "pycocotools"
    assert result.metrics.map50_95 == max(stats[0], 0.0) and result.metrics.map50 == max(stats[1], 0.0)
    saved = json.loads((run_dir / EVAL_FILE).read_text())
    assert [saved["bbox"][name] for name in STAT_NAMES] == stats.tolist()
    assert f"Metric source: pycocotools COCOeval on {annotations}" in caplog.text
    assert len(list((run_dir / "labels").glob("*.txt"))) == TINY.num_val  # --save-txt shares the run folder
    assert (run_dir / "PR_curve.png").is_file() and (run_dir / "F1_curve.png").is_file()  # --plots
    assert (run_dir / "val_batch0_labels.jpg").is_file() and (run_dir / "val_batch0_pred.jpg").is_file()


@pytest.mark.slow
def test_segment_save_json_masks_match_cocoeval_segm(dataset, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data, annotations = dataset
    weights = untrained_checkpoint(tmp_path / "seg.pt", SEGMENT, "yolov5n-seg")
    result = segment_val.main(_val_args(weights, data, tmp_path, "--save-json", imgsz=128))
    written = json.loads((tmp_path / "v" / PREDICTIONS_FILE).read_text())
    assert written and all(set(r["segmentation"]) == {"size", "counts"} for r in written)
    # Masks are scored without the box, so each detection's area (for the small/medium/large ranges) is its mask's.
    stats = _direct_cocoeval(annotations, [{k: v for k, v in r.items() if k != "bbox"} for r in written], "segm")
    assert stats[8] > 0, "the untrained model should overlap some objects (AR100), or this comparison is vacuous"
    assert result.mask_metrics is not None and result.metric_source == "pycocotools"
    assert result.mask_metrics.map50_95 == max(stats[0], 0.0) and result.mask_metrics.map50 == max(stats[1], 0.0)
    saved = json.loads((tmp_path / "v" / EVAL_FILE).read_text())
    assert [saved["segm"][name] for name in STAT_NAMES] == stats.tolist()
    assert result.metrics.map50_95 == max(saved["bbox"]["AP"], 0.0)

    # Ground truth COCOeval cannot rasterise (an empty segmentation, a 2-point polygon): boxes are still scored
    # by pycocotools, masks by the internal metric, and the run says so instead of failing inside COCOeval.
    document = json.loads(annotations.read_text())
    document["annotations"][0]["segmentation"] = []
    document["annotations"][1]["segmentation"] = [[1.0, 2.0, 30.0, 40.0]]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(document))
    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text(yaml.safe_dump({**yaml.safe_load(data.read_text()), "val_annotations": str(broken)}))
    with caplog.at_level(logging.INFO):
        fallback = segment_val.main(_val_args(weights, broken_yaml, tmp_path, "--save-json", "--exist-ok", imgsz=128))
    ids = [document["annotations"][i]["id"] for i in (0, 1)]
    assert "2 annotation(s) of the evaluated images have no segmentation COCOeval can score" in caplog.text
    assert f"first: id {ids[0]}" in caplog.text
    assert fallback.metric_source == "pycocotools" and fallback.mask_metric_source == "internal"
    assert f"Metric source: pycocotools COCOeval on {broken} for boxes; masks: internal" in caplog.text
    assert "segm" not in json.loads((tmp_path / "v" / EVAL_FILE).read_text())


def _validate_on_ranks(ctx: DistContext, cfg: ValConfig) -> tuple[list[int] | None, dict[str, float], int, Any]:
    gathered = gather_objects(ctx.rank * 10, ctx)
    result = validate_checkpoint(cfg, DETECT, ctx)
    return gathered, result.as_dict(), len(result.predictions), result.confusion.matrix


@pytest.mark.distributed
def test_two_rank_validation_matches_one_process(dataset, weights: Path, tmp_path: Path) -> None:
    # 2 ranks x 4 images per batch see exactly the batches (and rect shapes) of 1 process at batch 4.
    data, _ = dataset
    common = dict(
        weights=weights, data=data, imgsz=IMGSZ, workers=0, device="cpu", save_json=True, exist_ok=True, plots=True
    )
    single = validate_checkpoint(ValConfig(batch_size=4, project=tmp_path, name="one", **common), DETECT, DistContext())
    two_cfg = ValConfig(batch_size=8, project=tmp_path, name="two", **common)
    ranks = run_distributed(_validate_on_ranks, 2, tmp_path / "dist", two_cfg, timeout_s=120)
    assert ranks[0][0] == [0, 10] and ranks[1][0] is None  # gather_objects: the list on rank 0 only
    assert ranks[0][1] == ranks[1][1] == single.as_dict()
    assert ranks[0][2] > 0 and ranks[1][2] > 0 and ranks[0][2] + ranks[1][2] == TINY.num_val  # disjoint shards
    # The confusion matrix is summed over ranks: every label counted once, in a class or as missed.
    matrix = single.confusion.matrix
    assert matrix[:, :-1].sum() == single.num_instances > 0
    np.testing.assert_array_equal(ranks[0][3], matrix)
    np.testing.assert_array_equal(ranks[1][3], matrix)
    assert (tmp_path / "two" / "confusion_matrix.png").is_file() and (tmp_path / "two" / "PR_curve.png").is_file()
    one = json.loads((tmp_path / "one" / PREDICTIONS_FILE).read_text())
    two = json.loads((tmp_path / "two" / PREDICTIONS_FILE).read_text())
    assert two == one  # the same detections, each image's exactly once
    assert len({r["image_id"] for r in two}) == TINY.num_val
    one_eval, two_eval = (json.loads((tmp_path / name / EVAL_FILE).read_text()) for name in ("one", "two"))
    one_eval.pop("seconds"), two_eval.pop("seconds")
    assert two_eval == one_eval


@pytest.mark.slow
@pytest.mark.distributed  # val.py in a subprocess
def test_missing_annotations_file_is_one_error_line(dataset, weights: Path, tmp_path: Path) -> None:
    data, _ = dataset
    missing = tmp_path / "nowhere" / "instances_val.json"
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(yaml.safe_dump({**yaml.safe_load(data.read_text()), "val_annotations": str(missing)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "val.py", *_val_args(weights, bad_yaml, tmp_path, "--save-json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {missing}: annotations file not found"


@pytest.mark.slow
def test_malformed_annotations_file_is_config_error(dataset, weights: Path, tmp_path: Path) -> None:
    data, _ = dataset
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [], "annotations": [')
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(yaml.safe_dump({**yaml.safe_load(data.read_text()), "val_annotations": str(broken)}))
    with pytest.raises(ConfigError, match="broken.json: not valid JSON") as error:
        val.main(_val_args(weights, bad_yaml, tmp_path, "--save-json"))
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_task_speed_reports_times_only(dataset, weights: Path, tmp_path: Path, caplog) -> None:
    data, _ = dataset
    with caplog.at_level(logging.INFO):
        val.main(_val_args(weights, data, tmp_path, "--task", "speed", "--save-json"))
    assert "Speed per image:" in caplog.text and "--conf-thres 0.25 --iou-thres 0.45" in caplog.text
    assert "mAP50-95" not in caplog.text and "Metric source" not in caplog.text
    assert not (tmp_path / "v").exists()  # YOLOv5's speed task writes no JSON


@pytest.mark.slow
@pytest.mark.distributed  # val.py in a subprocess
def test_corrupt_checkpoint_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"not a zip archive")
    done = subprocess.run(
        [sys.executable, "val.py", "--weights", str(bad), "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and str(bad) in lines[0], done.stderr
