"""COCO evaluation: predictions.json in the COCO results format, id mapping, and pycocotools COCOeval numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from utils.data.coco_labels import category_mapping
from utils.data.data_config import DataConfig
from utils.data.image_files import unique_stems
from utils.distributed import DistContext, broadcast_object, gather_objects, run_on_main
from utils.errors import ConfigError, read_json_mapping
from utils.eval.evaluate import EvalResult, ImagePredictions
from utils.eval.metrics import DetectionMetrics

LOGGER = logging.getLogger(__name__)

# COCOeval.stats in order: AP over IoU .50:.95, at .50, at .75, by object area; AR at 1/10/100 detections, by area.
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
PREDICTIONS_FILE = "predictions.json"
EVAL_FILE = "coco_eval.json"


@dataclass(frozen=True)
class CocoAnnotations:
    """A loaded COCO instances file: its raw content and the image id of each image file name (basename)."""

    path: Path
    dataset: dict[str, Any]
    image_ids: dict[str, int]


@dataclass(frozen=True)
class CocoTarget:
    """What a split is scored against: the annotations, the COCO category id of each class index, and the
    categories whose annotations count (the dataset's classes: a file may hold more, its `category_ids:`
    left out of training).

    With `use_categories` False (--single-cls) COCOeval ignores categories (params.useCats = 0), and
    `category_ids` is the one id every prediction is written with.
    """

    annotations: CocoAnnotations
    category_ids: tuple[int, ...]
    scored_categories: tuple[int, ...]
    use_categories: bool = True

    def scored_dataset(self) -> dict[str, Any]:
        """The annotations file's content with only the scored categories and their annotations."""
        dataset = self.annotations.dataset
        wanted = set(self.scored_categories)
        if wanted >= {category["id"] for category in dataset["categories"]}:  # all of them: no copy
            return dataset
        return {
            **dataset,
            "categories": [category for category in dataset["categories"] if category["id"] in wanted],
            "annotations": [ann for ann in dataset["annotations"] if ann["category_id"] in wanted],
        }


def load_annotations(path: Path) -> CocoAnnotations:
    """Read a COCO instances JSON and index its image ids by file name (basename of `file_name`).

    Raises a one-line ConfigError naming the file when it is missing, not JSON, lacks the
    `images`/`annotations`/`categories` lists, has an image without `id`/`file_name` or an
    annotation without `id`/`image_id`/`category_id`/`bbox`, or two images share a basename.
    Annotations without `area` get the bbox area and without `iscrowd` 0 (COCOeval needs both).
    """
    path = Path(path)
    dataset = read_json_mapping(path, "annotations file", "a COCO JSON object with images/annotations/categories lists")
    for key in ("images", "annotations", "categories"):
        if not isinstance(dataset.get(key), list):
            raise ConfigError(f"{path}: not a COCO instances file (no '{key}' list)")
    image_ids: dict[str, int] = {}
    for index, image in enumerate(dataset["images"]):
        if not isinstance(image, dict) or "id" not in image or not isinstance(image.get("file_name"), str):
            raise ConfigError(f"{path}: images[{index}] has no 'id' or 'file_name'")
        name = PurePosixPath(image["file_name"].replace("\\", "/")).name
        if name in image_ids:
            raise ConfigError(f"{path}: two images are named '{name}'; image file names must be unique")
        image_ids[name] = image["id"]
    _check_annotation_entries(dataset, path)
    return CocoAnnotations(path, dataset, image_ids)


def _check_annotation_entries(dataset: dict[str, Any], path: Path) -> None:
    """Raise ConfigError for annotations or categories missing required keys; fill area/iscrowd defaults."""
    if not dataset["categories"]:
        raise ConfigError(f"{path}: the 'categories' list is empty")
    for index, category in enumerate(dataset["categories"]):
        if not isinstance(category, dict) or not isinstance(category.get("id"), int):
            raise ConfigError(f"{path}: categories[{index}] has no integer 'id'")
    for index, ann in enumerate(dataset["annotations"]):
        missing = [
            key for key in ("id", "image_id", "category_id", "bbox") if not isinstance(ann, dict) or key not in ann
        ]
        if missing:
            raise ConfigError(f"{path}: annotations[{index}] has no '{missing[0]}'")
        if "area" not in ann:
            ann["area"] = float(ann["bbox"][2]) * float(ann["bbox"][3])
        ann.setdefault("iscrowd", 0)


def load_coco_target(data: DataConfig, split: str, single_cls: bool = False) -> CocoTarget | None:
    """Load the annotations the dataset YAML names for `split` and map classes; None when it names none."""
    path = data.annotations.get(split)
    if path is None:
        return None
    annotations = load_annotations(path)
    categories = annotations.dataset["categories"]
    if single_cls:  # every object one class: the classes' categories when they map, else every category
        try:
            scored = category_mapping(data.names, categories, data.category_ids, path)
        except ConfigError:
            scored = tuple(sorted(category["id"] for category in categories))
        return CocoTarget(annotations, (min(scored),), scored, use_categories=False)
    # The classes' categories: a file's other categories (left out of training by `category_ids:`) are not scored.
    mapping = category_mapping(data.names, categories, data.category_ids, path)
    return CocoTarget(annotations, mapping, mapping)


def predictions_to_coco(
    predictions: Sequence[ImagePredictions],
    image_ids: Mapping[str, int | str],
    category_ids: Sequence[int],
    source: str = "the annotations file",
) -> list[dict[str, Any]]:
    """Turn per-image detections into COCO result dicts: image_id, category_id, bbox [x, y, w, h], score.

    Boxes are original-image pixels rounded to 3 decimals, scores to 5; `segmentation` (an RLE
    dict with str counts) is added when the image has `masks_rle`. `image_ids` is keyed by image
    path (stem_image_ids) or file basename (an annotations file's `file_name`); images missing from
    it are left out and reported in one warning naming `source`, the count and the first one.
    """
    results: list[dict[str, Any]] = []
    missing: list[str] = []
    for item in predictions:
        name = Path(item.path).name
        image_id = image_ids.get(item.path, image_ids.get(name))
        if image_id is None:
            missing.append(name)
            continue
        detections = np.asarray(item.detections, np.float64).reshape(-1, 6)
        boxes = detections[:, :4].copy()
        boxes[:, 2:] -= boxes[:, :2]
        classes = detections[:, 5].astype(np.int64).tolist()
        scores = np.round(detections[:, 4], 5).tolist()
        for index, (box, cls, score) in enumerate(zip(np.round(boxes, 3).tolist(), classes, scores, strict=True)):
            record = {"image_id": image_id, "category_id": int(category_ids[cls]), "bbox": box, "score": score}
            if item.masks_rle is not None:
                record["segmentation"] = _json_rle(item.masks_rle[index])
            results.append(record)
    if missing:
        LOGGER.warning(
            f"{len(missing)} evaluated images are not in {source} and are left out of COCO scoring, first: {missing[0]}"
        )
    return results


def _json_rle(rle: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of a pycocotools RLE with `counts` as str (pycocotools' encode gives bytes)."""
    counts = rle["counts"]
    return {
        "size": [int(v) for v in rle["size"]],
        "counts": counts.decode("ascii") if isinstance(counts, bytes) else counts,
    }


def output_stems(image_files: Sequence[str], ctx: DistContext, what: str) -> dict[str, str]:
    """Each image's output stem (image_files.unique_stems over the sorted list: alike on every rank); rank 0 warns.

    Every output of one run takes its names from this one mapping (val's --save-txt files and
    --save-json image ids), so an image has the same name in each. `what` says what is renamed.
    """
    paths = sorted(image_files)
    stems, renamed = unique_stems(paths)
    if renamed and ctx.is_main:
        LOGGER.warning(f"{len(renamed)} image(s) share a file stem with another; {what} renamed (first: {renamed[0]})")
    return dict(zip(paths, stems, strict=True))


def stem_image_ids(stems: Mapping[str, str]) -> dict[str, int | str]:
    """Image ids without an annotations file, keyed by image path: its output stem, an int when numeric.

    As YOLOv5, COCO's zero-padded names give COCO's ids (000000000139.jpg: 139). Stems that would give
    the same number (1.jpg and 001.jpg) keep their names as ids: one id would merge their detections.
    """
    numbers = {path: int(stem) for path, stem in stems.items() if stem.isascii() and stem.isdigit()}
    taken = Counter(numbers.values())
    return {path: numbers[path] if taken[numbers.get(path, -1)] == 1 else stem for path, stem in stems.items()}


def run_cocoeval(
    gt: Any, results: list[dict[str, Any]], iou_type: str, image_ids: list[int], use_categories: bool = True
) -> Any:
    """Run pycocotools COCOeval (`iou_type` 'bbox' or 'segm') on `results` restricted to `image_ids`.

    `gt` is a pycocotools COCO. Returns the COCOeval after summarize() (its `stats` hold the 12
    numbers of STAT_NAMES), or None when `results` is empty (loadRes cannot load an empty list).
    The 12 summary lines are logged; pycocotools' other prints are dropped. loadRes adds keys to
    the dicts it gets (area, id, a box polygon), so it gets shallow copies.
    """
    from pycocotools.cocoeval import COCOeval

    if not results:
        return None
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        detections = gt.loadRes([dict(record) for record in results])
        evaluator = COCOeval(gt, detections, iou_type)
        evaluator.params.imgIds = list(image_ids)
        evaluator.params.useCats = int(use_categories)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    LOGGER.info(f"COCOeval {iou_type}:")
    for line in captured.getvalue().splitlines():
        if line.lstrip().startswith("Average"):
            LOGGER.info(line)
    return evaluator


def per_class_ap(evaluator: Any, category_ids: Sequence[int], class_ids: np.ndarray) -> tuple[list[float], list[float]]:
    """Return COCOeval's AP50 and AP50-95 of each class in `class_ids` (area all, 100 detections).

    A class whose category has no ground truth among the scored images gets 0.
    """
    precision = evaluator.eval["precision"]  # (iou thresholds, recall points, categories, areas, max dets)
    columns = list(evaluator.params.catIds) if evaluator.params.useCats else None
    ap50, ap = [], []
    for class_id in class_ids.tolist():
        category = category_ids[class_id] if columns is not None else None
        if columns is not None and category not in columns:
            ap50.append(0.0)
            ap.append(0.0)
            continue
        curve = precision[:, :, 0 if columns is None else columns.index(category), 0, -1]
        ap50.append(_mean_scored(curve[0]))
        ap.append(_mean_scored(curve))
    return ap50, ap


def _mean_scored(values: np.ndarray) -> float:
    """Mean of the entries COCOeval scored (it marks unscored ones -1); 0 when there are none."""
    scored = values[values > -1]
    return float(scored.mean()) if scored.size else 0.0


def check_coco_target(data: DataConfig, split: str, ctx: DistContext, single_cls: bool = False) -> CocoTarget | None:
    """Load and check the split's annotations on rank 0 before any work; every rank must call it.

    Returns the target on rank 0 (None on other ranks, and when the YAML names no annotations);
    a bad file is the same one-line ConfigError on every rank.
    """
    return run_on_main(lambda: load_coco_target(data, split, single_cls), ctx, "loading the COCO annotations")


def _write_json(path: Path, content: Any) -> None:
    """Write `content` as JSON next to `path` and rename it into place, so no reader sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as file:
        json.dump(content, file, separators=(",", ":"))
    os.replace(tmp, path)


def coco_evaluate(
    result: EvalResult,
    data: DataConfig,
    split: str,
    save_dir: Path,
    ctx: DistContext,
    *,
    single_cls: bool = False,
    target: CocoTarget | None = None,
    stems: Mapping[str, str] | None = None,
) -> EvalResult:
    """Score `result`'s predictions with pycocotools and return the result with COCOeval's mAPs.

    Every rank must call it, after an evaluation run with `collect_predictions=True`. Each rank's
    predictions (its disjoint shard) are gathered to rank 0 only; rank 0 writes
    `save_dir/predictions.json`, runs COCOeval (bbox, plus segm when masks were predicted) on the
    split's annotations file, logs the 12 summary numbers and writes `save_dir/coco_eval.json`.
    The scores are broadcast and every rank returns `result` with `metrics` (and `mask_metrics`)
    map50/map50_95/fitness and per-class AP replaced and `metric_source="pycocotools"` (and
    `mask_metric_source`, when the ground truth's segmentations could be scored). Without an
    annotations file for `split` the result is returned unchanged (internal metric) and
    predictions.json uses file stems as image ids (`stems`, output_stems of the evaluated set, so
    they match the run's other outputs; by default the predictions' own) and class indices as
    category ids. `target`, when rank 0 already loaded it (`check_coco_target`), saves reading the
    file again. A bad annotations file is one ConfigError on every rank.
    """
    gathered = gather_objects(result.predictions, ctx)
    save_dir = Path(save_dir)

    def score_on_main() -> dict[str, Any] | None:
        predictions = [item for part in gathered or [] for item in part]
        coco_target = target or load_coco_target(data, split, single_cls)
        save_dir.mkdir(parents=True, exist_ok=True)
        if coco_target is None:
            own = stems if stems is not None else output_stems([p.path for p in predictions], ctx, "image ids")
            _write_json(
                save_dir / PREDICTIONS_FILE,
                predictions_to_coco(predictions, stem_image_ids(own), range(len(data.names))),
            )
            LOGGER.info(
                f"No '{split}_annotations' in {data.yaml_file}: mAP is the internal metric; wrote "
                f"{save_dir / PREDICTIONS_FILE} (image_id = file stem, category_id = class index)"
            )
            return None
        class_ids = {"bbox": result.metrics.class_ids, "segm": (result.mask_metrics or result.metrics).class_ids}
        return _score(predictions, coco_target, class_ids, save_dir)

    scores = broadcast_object(run_on_main(score_on_main, ctx, "COCO evaluation"), ctx)
    if scores is None:
        return result
    metrics = _with_scores(result.metrics, scores["bbox"])
    mask_metrics, mask_source = result.mask_metrics, result.mask_metric_source
    if mask_metrics is not None and "segm" in scores:
        mask_metrics, mask_source = _with_scores(mask_metrics, scores["segm"]), "pycocotools"
    return dataclasses.replace(
        result, metrics=metrics, mask_metrics=mask_metrics, metric_source="pycocotools", mask_metric_source=mask_source
    )


def _score(
    predictions: list[ImagePredictions], target: CocoTarget, class_ids: dict[str, np.ndarray], save_dir: Path
) -> dict[str, Any]:
    """On rank 0: write predictions.json, run COCOeval per IoU type, write coco_eval.json; return the scores."""
    path = target.annotations.path
    known = target.annotations.image_ids
    image_ids = list(dict.fromkeys(known[Path(p.path).name] for p in predictions if Path(p.path).name in known))
    if not image_ids:
        raise ConfigError(f"{path}: none of the {len(predictions)} evaluated images is in this annotations file")
    results = predictions_to_coco(predictions, known, target.category_ids, str(path))
    _write_json(save_dir / PREDICTIONS_FILE, results)
    iou_types = ["bbox"]
    scored = target.scored_dataset()
    if any(p.masks_rle is not None for p in predictions):
        unscorable = unscorable_segmentations(scored, set(image_ids))
        if not unscorable:
            iou_types.append("segm")
        else:
            LOGGER.warning(
                f"{path}: {len(unscorable)} annotation(s) of the evaluated images have no segmentation COCOeval can "
                f"score (missing, empty, a first polygon of 4 numbers or fewer, or an RLE of another size than its "
                f"image; first: id {unscorable[0]}); masks are scored by the internal metric"
            )
    gt = _coco_api(scored)
    start = time.perf_counter()
    scores = {}
    for iou_type in iou_types:
        # Segmentation results carry no bbox, so loadRes takes each detection's area from its mask.
        typed = results if iou_type == "bbox" else [{k: v for k, v in r.items() if k != "bbox"} for r in results]
        evaluator = run_cocoeval(gt, typed, iou_type, image_ids, target.use_categories)
        scores[iou_type] = _scores_of(evaluator, target.category_ids, class_ids[iou_type], iou_type)
    seconds = time.perf_counter() - start
    summary = {"annotations": str(path), "images": len(image_ids), "detections": len(results), "seconds": seconds}
    _write_json(save_dir / EVAL_FILE, {**summary, **{key: value["stats"] for key, value in scores.items()}})
    LOGGER.info(f"COCOeval on {len(image_ids)} images took {seconds:.2f}s; saved {save_dir / EVAL_FILE}")
    return scores


def unscorable_segmentations(dataset: dict[str, Any], image_ids: set[int]) -> list[Any]:
    """Ids of the annotations of `image_ids` whose `segmentation` pycocotools cannot rasterise.

    COCOeval turns every ground-truth segmentation of an evaluated image into a mask, with
    pycocotools' frPyObjects, which looks only at the first polygon of a list: more than 4 numbers
    and every part is rasterised (odd counts and short later parts too); exactly 4 is taken for a
    box and fails (TypeError); fewer, or an empty list, fails too. A missing segmentation fails,
    and an RLE must be its image's size. Polygons need their image's integer height and width.
    """
    sizes = {image.get("id"): (image.get("height"), image.get("width")) for image in dataset["images"]}
    unscorable = []
    for ann in dataset["annotations"]:
        if ann.get("image_id") not in image_ids:
            continue
        segmentation, size = ann.get("segmentation"), sizes.get(ann.get("image_id"))
        known_size = size is not None and all(isinstance(side, int) and side > 0 for side in size)
        if isinstance(segmentation, list):
            usable = bool(segmentation) and all(isinstance(part, list) for part in segmentation)
            usable = usable and len(segmentation[0]) > 4
        elif isinstance(segmentation, dict):
            usable = "counts" in segmentation and list(segmentation.get("size") or ()) == list(size or ())
        else:
            usable = False
        if not (usable and known_size):
            unscorable.append(ann.get("id"))
    return unscorable


def _scores_of(evaluator: Any, category_ids: Sequence[int], class_ids: np.ndarray, iou_type: str) -> dict[str, Any]:
    """Named summary stats and per-class APs of a finished COCOeval; zeros (and a warning) for None."""
    if evaluator is None:
        LOGGER.warning(f"No detections to score ({iou_type}); the COCO metrics are 0")
        zeros = [0.0] * len(class_ids)
        return {"stats": dict.fromkeys(STAT_NAMES, 0.0), "ap50": zeros, "ap": zeros}
    ap50, ap = per_class_ap(evaluator, category_ids, class_ids)
    return {"stats": dict(zip(STAT_NAMES, (float(v) for v in evaluator.stats), strict=True)), "ap50": ap50, "ap": ap}


def _with_scores(metrics: DetectionMetrics, scores: dict[str, Any]) -> DetectionMetrics:
    """Return `metrics` with COCOeval's AP50/AP (-1, "no ground truth", counts as 0) and per-class APs."""
    map50, map50_95 = max(scores["stats"]["AP50"], 0.0), max(scores["stats"]["AP"], 0.0)
    return dataclasses.replace(
        metrics,
        map50=map50,
        map50_95=map50_95,
        fitness=0.1 * map50 + 0.9 * map50_95,
        ap50=np.asarray(scores["ap50"], np.float64),
        ap=np.asarray(scores["ap"], np.float64),
    )


def _coco_api(dataset: dict[str, Any]) -> Any:
    """Build a pycocotools COCO over a loaded file's content without reading the file again (its prints dropped)."""
    from pycocotools.coco import COCO

    gt = COCO()
    gt.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt
