"""A split's labels from a COCO instances JSON: categories to classes, images under the split folder, packed index."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from utils.data.coco_node import PARSE_VERSION, load_coco_parse
from utils.data.coco_reader import BAD_SEGMENTATION, CocoParse, missing_segmentation_notes
from utils.data.labels import MIN_RELATIVE_AREA, STATUSES, LabelIndex, load_label_cache, save_label_cache
from utils.data.masks import covered_areas
from utils.data.polygons import gather, packed_bounds, ranges
from utils.data.scan import check_same_image_files, files_hash, scan_in_rounds
from utils.data.scan_report import report_scan
from utils.distributed import DistContext, all_gather_objects, barrier
from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)

FILE_NOT_FOUND = "image files not found"
OTHER_CATEGORY = "annotations of categories outside the classes"
SIZE_DIFFERS = "images whose size differs from the JSON"
DEGENERATE = "degenerate (zero-area) instances"


@dataclass(frozen=True)
class CocoSource:
    """A split labelled by a COCO instances JSON: the file, the folder its `file_name`s are under, the classes.

    `category_ids` is the dataset YAML's explicit class -> category id list (None: by name or by
    ascending id, see category_mapping); the same mapping writes predictions back as category ids.
    """

    annotations: Path
    image_root: Path
    names: tuple[str, ...]
    category_ids: tuple[int, ...] | None = None


def category_mapping(
    names: Sequence[str], categories: list[dict[str, Any]], explicit: Sequence[int] | None, source: Path
) -> tuple[int, ...]:
    """Return the COCO category id of each class index.

    An `explicit` list (dataset YAML `category_ids:`) wins, each id must exist in the file. Else,
    when the class names equal the categories' names (any order), classes map by name. Else class
    i maps to the i-th category by ascending id (COCO's 80 classes -> its 91-id list), unless that
    gives a class a category of another name while the file has one of its name (names partly
    swapped or misspelt: it would train on the wrong boxes). That, and a differing class/category
    count without an explicit mapping, are one-line ConfigErrors naming `source`.
    Training labels read from the JSON and --save-json predictions both use this mapping.
    """
    ids = sorted(category["id"] for category in categories)
    if explicit is not None:
        unknown = [cid for cid in explicit if cid not in set(ids)]
        if unknown:
            raise ConfigError(f"{source}: category_ids lists category {unknown[0]}, which is not in the file")
        return tuple(int(cid) for cid in explicit)
    by_name = {str(category.get("name")): category["id"] for category in categories}
    if len(by_name) == len(names) == len(set(names)) and set(by_name) == set(names):
        return tuple(int(by_name[name]) for name in names)
    if len(ids) != len(names):
        raise ConfigError(
            f"{source}: {len(ids)} categories but the dataset has {len(names)} classes; "
            "set 'category_ids:' (one category id per class) in the dataset YAML"
        )
    name_of = {category["id"]: str(category.get("name")) for category in categories}
    for index, (name, cid) in enumerate(zip(names, ids, strict=True)):
        if name != name_of[cid] and name in by_name:  # by id order the class would train on another category
            raise ConfigError(
                f"{source}: class {index} '{name}' would take category {cid} '{name_of[cid]}' (ascending ids), but "
                f"the file's category '{name}' is id {by_name[name]}; give the YAML's names in the file's order, or "
                "set 'category_ids:'"
            )
    return tuple(int(cid) for cid in ids)


def class_of_category(parse: CocoParse, source: CocoSource) -> np.ndarray:
    """(C,) int64: the class index of each of the parse's categories (ascending id), -1 for one no class maps to."""
    categories = [{"id": int(i), "name": n} for i, n in zip(parse.category_ids, parse.category_names, strict=True)]
    mapping = category_mapping(source.names, categories, source.category_ids, source.annotations)
    classes = np.full(len(parse.category_ids), -1, np.int64)
    classes[np.searchsorted(parse.category_ids, mapping)] = np.arange(len(mapping))
    return classes


def resolve_image_files(parse: CocoParse, source: CocoSource) -> tuple[list[str], np.ndarray, list[str]]:
    """Find each JSON image under the split folder: (existing paths sorted, their parse image index, messages).

    A `file_name` is looked up under `image_root` as written, then by its base name (exports
    often keep the tool's own folders in it). Images with no file are left out, one message
    each naming the JSON and the image id.
    """
    root = str(source.image_root)
    found: dict[str, int] = {}
    messages = []
    for row, name in enumerate(parse.file_names):
        relative = name.replace("\\", "/")
        path = os.path.normpath(os.path.join(root, relative))
        if not os.path.isfile(path):
            path = os.path.join(root, PurePosixPath(relative).name)
        image_id = parse.image_ids[row]
        if not os.path.isfile(path):
            messages.append(f"{parse.source}: image {image_id}: {name} not found under {root}; left out")
        elif path in found:
            messages.append(f"{parse.source}: image {image_id}: {name} is also image {parse.image_ids[found[path]]}")
        else:
            found[path] = row
    files = sorted(found)
    return files, np.array([found[path] for path in files], np.int64), messages


def _box_corners(boxes_xywhn: np.ndarray) -> np.ndarray:
    """Corners (n, 4, 2) float32 in [0, 1] of normalised boxes, computed as a YOLO box row's are (labels.py)."""
    cx, cy, w, h = boxes_xywhn.T
    x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    corners = np.stack([x1, y1, x2, y1, x2, y2, x1, y2], 1).astype(np.float32).reshape(-1, 4, 2)
    return np.clip(corners, 0.0, 1.0)


def _instance_outlines(
    parse: CocoParse, instances: np.ndarray, with_masks: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of `instances` as YOLO would read them: (points (P, 2) float32, counts (n,), polygon (n,) bool).

    Segmentation takes an instance's polygon and detection its bbox (as its 4 corners, the way a
    YOLO box row is stored); an instance without a polygon is a box for both.
    """
    polygon_counts = np.diff(parse.polygon_offsets)[instances]
    is_polygon = (polygon_counts > 0) if with_masks else np.zeros(len(instances), bool)
    counts = np.where(is_polygon, polygon_counts, 4)
    starts = np.cumsum(counts) - counts
    points = np.empty((int(counts.sum()), 2), np.float32)
    polygons = np.flatnonzero(is_polygon)
    points[ranges(starts[polygons], counts[polygons])] = parse.points[
        ranges(parse.polygon_offsets[instances[polygons]], counts[polygons])
    ]
    boxes = np.flatnonzero(~is_polygon)
    points[ranges(starts[boxes], counts[boxes])] = _box_corners(parse.boxes_xywhn[instances[boxes]]).reshape(-1, 2)
    return points, counts, is_polygon


def build_coco_index(
    parse: CocoParse, verified: LabelIndex, rows: dict[str, int], classes: np.ndarray, with_masks: bool
) -> LabelIndex:
    """Pack the JSON's instances of the verified images into a LabelIndex, the same a YOLO txt scan would give.

    `verified` is the image-only scan of the split's files (shapes, corrupt images), `rows` maps
    each path to its parse image, `classes` each category to a class (-1: left out). Labels are
    [cls, cx, cy, w, h] of the outline's tight box, as for a YOLO row; zero-area outlines are
    dropped. Counts: found (instances), missing (no annotation: background), empty (all left out),
    corrupt (unusable images); every left-out annotation has a message naming the JSON and its id.
    """
    image_rows = np.array([rows[path] for path in verified.im_files], np.int64)
    first = parse.instance_offsets[image_rows]
    per_image = parse.instance_offsets[image_rows + 1] - first
    instances = ranges(first, per_image)
    owner = np.repeat(np.arange(len(image_rows)), per_image)
    instance_classes = classes[parse.categories[instances]]
    messages, problems = [], {}
    for j in np.flatnonzero(instance_classes < 0):
        category = parse.category_ids[parse.categories[instances[j]]]
        messages.append(
            f"{parse.source}: annotation {parse.annotation_ids[instances[j]]}: category {category} is not "
            "one of the dataset's classes (category_ids); left out"
        )
    points, counts, is_polygon = _instance_outlines(parse, instances, with_masks)
    keep = (instance_classes >= 0) & (covered_areas(points, counts) >= MIN_RELATIVE_AREA)
    for j in np.flatnonzero((instance_classes >= 0) & ~keep):
        shape = "polygon" if is_polygon[j] else "box"
        messages.append(f"{parse.source}: annotation {parse.annotation_ids[instances[j]]}: zero-area {shape}; left out")
    problems[OTHER_CATEGORY] = int((instance_classes < 0).sum())
    num_degenerate = int(len(keep) - keep.sum() - problems[OTHER_CATEGORY])
    if with_masks:  # an annotation without a segmentation trains as its box: a rectangular mask, said
        unsegmented = missing_segmentation_notes(parse, instances[keep])
        messages += unsegmented
        problems[BAD_SEGMENTATION] = len(unsegmented)
    points, counts = gather(points, counts, np.flatnonzero(keep))
    bounds = packed_bounds(points, counts)
    labels = np.empty((len(counts), 5), np.float32)
    labels[:, 0] = instance_classes[keep]
    labels[:, 1:3] = (bounds[:, :2] + bounds[:, 2:]) / 2
    labels[:, 3:] = bounds[:, 2:] - bounds[:, :2]
    kept_per_image = np.bincount(owner[keep], minlength=len(image_rows))
    label_offsets = np.concatenate([[0], np.cumsum(kept_per_image)]).astype(np.int64)
    seg_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    found = int((kept_per_image > 0).sum())
    emptied = int(((per_image > 0) & (kept_per_image == 0)).sum())
    background = int((per_image == 0).sum())
    status = {"found": found, "missing": background, "empty": emptied, "corrupt": verified.counts["corrupt"]}
    size_messages = _size_differences(parse, image_rows, verified)
    problems[SIZE_DIFFERS] = len(size_messages)
    problems = {reason: count for reason, count in problems.items() if count}
    return LabelIndex(
        verified.im_files,
        verified.shapes,
        labels,
        label_offsets,
        points,
        seg_offsets,
        {key: status[key] for key in STATUSES},
        verified.messages + size_messages + messages,
        num_degenerate,
        problems,
    )


def _size_differences(parse: CocoParse, image_rows: np.ndarray, verified: LabelIndex) -> list[str]:
    """One message per image whose file is not the size the JSON states (its normalised labels are kept)."""
    stated = parse.image_wh[image_rows]
    differs = np.flatnonzero((stated != verified.shapes).any(1))
    return [
        f"{parse.source}: image {parse.image_ids[image_rows[i]]}: {verified.im_files[i]} is "
        f"{verified.shapes[i][0]}x{verified.shapes[i][1]} but the JSON says {stated[i][0]}x{stated[i][1]}; "
        "its labels are scaled to the file"
        for i in differs
    ]


def coco_cache_path(json_path: Path, with_masks: bool) -> Path:
    """The label cache of a COCO split beside its JSON: instances_train2017.detect.cache / .segment.cache."""
    return json_path.with_name(f"{json_path.stem}.{'segment' if with_masks else 'detect'}.cache")


def scan_coco_labels(
    source: CocoSource, with_masks: bool, ctx: DistContext, num_workers: int | None = None
) -> LabelIndex:
    """Return the split's packed LabelIndex from its COCO JSON, the same on every rank; every rank must call it.

    The JSON is read once per node (utils/data/coco_node.py). When every rank finds a current
    label cache (coco_cache_path; its digest covers the JSON, every image file, the classes and
    the task) it is mapped and nothing else is read. Otherwise the images are verified as a YOLO
    scan verifies them, split across ranks in rounds (utils/data/scan.py), the local main rank of
    each node packs the index and writes the cache, and the node's other ranks map that file
    (one copy per node); a rank that cannot read it packs its own. Rank 0 logs the bad entries
    and the summary. A mismatch of classes and categories is a one-line ConfigError; so is a
    split with no usable image.
    """
    parse = load_coco_parse(source.annotations, ctx)
    classes = class_of_category(parse, source)
    files, image_rows, missing = resolve_image_files(parse, source)
    cache_path = coco_cache_path(source.annotations, with_masks)
    check_same_image_files(files, f"image list of {source.annotations}", ctx)
    base = files_hash(files, [str(source.annotations)], ctx, len(source.names))
    key = f"{base}\0{with_masks}\0{classes.tolist()}\0{source.image_root}\0{PARSE_VERSION}"  # what the index came from
    digest = hashlib.sha256(key.encode(errors="surrogateescape")).hexdigest()  # a root's name may not be UTF-8
    index = load_label_cache(cache_path, digest)
    has_cache = all_gather_objects(index is not None, ctx)
    where = f"{cache_path} (cached)"
    if not all(has_cache):
        verified = scan_in_rounds(files, False, ctx, len(has_cache), num_workers)
        verified.counts["corrupt"] += len(missing)
        verified.messages[:0] = missing
        rows = dict(zip(files, image_rows.tolist(), strict=True))
        built = None
        if ctx.is_local_main:
            built = _with_parse_notes(build_coco_index(parse, verified, rows, classes, with_masks), parse, len(missing))
            save_label_cache(cache_path, built, digest)
        barrier(ctx)  # the cache is written: the node's other ranks map it instead of packing their own
        index = load_label_cache(cache_path, digest)
        index = built if index is None else index
        if index is None:
            index = _with_parse_notes(build_coco_index(parse, verified, rows, classes, with_masks), parse, len(missing))
        where = f"read {source.annotations}"
    if ctx.is_main:
        report_scan(index, where, cache_path=cache_path)
    if not len(index):
        raise ConfigError(f"{source.annotations}: none of its images is usable under {source.image_root}")
    return index


def _with_parse_notes(index: LabelIndex, parse: CocoParse, num_missing: int) -> LabelIndex:
    """Put the JSON's own bad-entry messages and counts (and the missing image files) in front of the index's."""
    problems = dict(parse.problems)
    if num_missing:
        problems[FILE_NOT_FOUND] = num_missing
    for reason, count in index.problems.items():
        problems[reason] = problems.get(reason, 0) + count
    index.messages[:0] = parse.messages
    index.problems = problems
    return index
