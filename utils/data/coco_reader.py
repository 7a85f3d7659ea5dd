"""COCO instances JSON -> CocoParse: images, categories and clean instances in a few flat arrays, streamed."""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from utils.data.coco_polygons import object_outline, polygon_parts, rle_to_polygon
from utils.data.json_stream import JsonStream
from utils.data.labels import COORD_TOLERANCE
from utils.data.polygons import clip_polygon, pack, replace
from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)

# Reasons an entry is changed or left out, as the scan summary counts them.
BAD_IMAGE = "image entries left out (bad or duplicate)"
UNKNOWN_IMAGE = "annotations of images not in 'images'"
UNKNOWN_CATEGORY = "annotations of unknown categories"
BAD_ANNOTATION = "malformed annotations"
ZERO_AREA = "zero-area boxes"
OUTSIDE = "boxes outside the image"
GATHER_BLOCK = 1 << 16  # instances normalised at a time: bounds the temporary arrays
CLIPPED = "boxes clipped to the image"
BAD_SEGMENTATION = "unusable segmentations (box kept)"
POLYGON_CLIPPED = "polygons clipped to the image"
CROWD = "crowd regions not trained"


@dataclass
class CocoParse:
    """The usable content of one COCO instances JSON, packed into flat arrays (one Python object per image name).

    `category_ids` (C,) int64 ascending with `category_names`: class index i is the i-th
    category by ascending id unless the dataset YAML maps otherwise. Images in file order:
    `image_ids` (N,) int64, `file_names`, `image_wh` (N, 2) int64 as the JSON states them.
    Instances (crowd regions and bad entries left out) grouped by image in JSON order: image i
    owns instances `instance_offsets[i]:instance_offsets[i + 1]`; `annotation_ids` (M,) int64,
    `categories` (M,) int32 index into category_ids, `boxes_xywhn` (M, 4) float64 [cx, cy, w, h]
    normalised and inside the image. Instance j's polygon (multi-part joined, RLE traced) is
    `points[polygon_offsets[j]:polygon_offsets[j + 1]]`, (k, 2) float32 normalised inside
    [0, 1]; k = 0 when it has none. `has_segmentation` (M,) bool: whether the annotation had a
    non-empty `segmentation` at all (a usable one or not; unusable ones are noted here), so the
    segmentation task can tell an annotation without one from a polygon that was dropped
    (missing_segmentation_notes); detection needs none and says nothing. `messages` holds one
    line per bad entry naming the JSON and the id; `problems` counts them by reason.
    """

    source: str
    category_ids: np.ndarray
    category_names: list[str]
    image_ids: np.ndarray
    file_names: list[str]
    image_wh: np.ndarray
    instance_offsets: np.ndarray
    annotation_ids: np.ndarray
    categories: np.ndarray
    boxes_xywhn: np.ndarray
    polygon_offsets: np.ndarray
    points: np.ndarray
    has_segmentation: np.ndarray
    messages: list[str]
    problems: dict[str, int]


def _is_int(value: Any) -> bool:
    return type(value) is int


def _whole(value: Any) -> int | None:
    """An image side as an int: an int, or a float with no fraction (some exporters write 640.0); else None."""
    if type(value) is int:
        return value
    return int(value) if type(value) is float and value.is_integer() else None


class _Entries:
    """What the stream has read so far: per-entry fields appended to flat arrays, checked once all is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.image_ids = array.array("q")
        self.file_names: list[str] = []
        self.image_wh = array.array("q")
        self.ann_ids = array.array("q")
        self.ann_images = array.array("q")
        self.ann_categories = array.array("q")
        self.boxes = array.array("d")
        self.point_counts = array.array("q")
        self.has_segmentation = array.array("b")
        self.points = array.array("f")  # pixels, x y x y ...
        # Annotation position -> (height, width) of its RLE, checked against its image once the images are read.
        self.rle_sizes: dict[int, tuple[int, int]] = {}
        self.categories: list[Any] | None = None
        self.seen = {"images": False, "annotations": False}
        self.messages: list[str] = []
        self.problems: dict[str, int] = {}

    def note(self, reason: str, message: str) -> None:
        """Count one bad entry under `reason` and keep its one-line message."""
        self.problems[reason] = self.problems.get(reason, 0) + 1
        self.messages.append(f"{self.path}: {message}")

    def add_image(self, position: int, image: Any) -> None:
        """Keep an `images` entry with an integer id, a file name and a positive whole width and height."""
        if not isinstance(image, dict):
            image = {}
        image_id, name = image.get("id"), image.get("file_name")
        width, height = _whole(image.get("width")), _whole(image.get("height"))
        if not (_is_int(image_id) and isinstance(name, str) and name and width is not None and height is not None):
            self.note(BAD_IMAGE, f"images[{position}] lacks an integer 'id', 'file_name', 'width' or 'height'")
            return
        if width < 1 or height < 1:
            self.note(BAD_IMAGE, f"image {image_id}: size {width}x{height} is not positive; left out")
            return
        self.image_ids.append(image_id)
        self.file_names.append(name)
        self.image_wh.extend((width, height))

    def add_annotation(self, position: int, ann: Any) -> None:
        """Keep an `annotations` entry's ids, bbox and polygon (pixels); crowd regions are only counted.

        Called once per annotation (860k for COCO train2017), so the checks are plain type tests.
        """
        if type(ann) is not dict:
            self.note(BAD_ANNOTATION, f"annotations[{position}] is not an object; left out")
            return
        if ann.get("iscrowd"):
            self.problems[CROWD] = self.problems.get(CROWD, 0) + 1  # not a bad entry: counted, not warned
            return
        ann_id, image_id, category_id = ann.get("id"), ann.get("image_id"), ann.get("category_id")
        if not (type(ann_id) is int and type(image_id) is int and type(category_id) is int):
            name = f"annotation {ann_id}" if type(ann_id) is int else f"annotations[{position}]"
            self.note(BAD_ANNOTATION, f"{name} lacks an integer 'id', 'image_id' or 'category_id'; left out")
            return
        bbox, boxes = ann.get("bbox"), self.boxes
        try:  # the array's conversion checks the values are numbers
            if type(bbox) is not list or len(bbox) != 4:
                raise TypeError
            boxes.extend(bbox)
        except TypeError:
            del boxes[4 * len(self.ann_ids) :]
            self.note(BAD_ANNOTATION, f"annotation {ann_id}: 'bbox' is not [x, y, width, height]; left out")
            return
        points = self.points
        num_values = len(points)
        segmentation = ann.get("segmentation")
        if segmentation:
            part = segmentation[0] if type(segmentation) is list and len(segmentation) == 1 else None
            try:  # the common case, kept fast: one polygon of 3+ points
                if type(part) is not list or len(part) < 6 or len(part) % 2:
                    raise TypeError
                points.extend(part)
            except TypeError:
                del points[num_values:]
                points.frombytes(self._outline(ann_id, segmentation).tobytes())
        self.ann_ids.append(ann_id)
        self.ann_images.append(image_id)
        self.ann_categories.append(category_id)
        self.point_counts.append((len(points) - num_values) >> 1)
        self.has_segmentation.append(1 if segmentation else 0)  # [], {}, None or no key: none

    def _outline(self, ann_id: int, segmentation: Any) -> np.ndarray:
        """A segmentation other than one plain polygon as flat float32 pixel x, y values; empty when unusable."""
        try:
            if isinstance(segmentation, list):
                parts = polygon_parts(segmentation)
                outline = object_outline(parts) if parts else np.zeros((0, 2))
            elif isinstance(segmentation, dict):
                outline = rle_to_polygon(segmentation)
                self.rle_sizes[len(self.ann_ids)] = tuple(segmentation["size"])  # a valid size, or it raised
            else:
                raise ValueError("'segmentation' is neither polygons nor RLE")
        except (TypeError, ValueError) as error:
            self.note(BAD_SEGMENTATION, f"annotation {ann_id}: {error}; its box is used")
            return np.zeros(0, np.float32)
        if len(outline) < 3:
            self.note(BAD_SEGMENTATION, f"annotation {ann_id}: 'segmentation' has no polygon of 3+ points; box used")
            return np.zeros(0, np.float32)
        return outline.astype(np.float32).reshape(-1)


def read_coco_json(path: Path) -> CocoParse:
    """Stream a COCO instances JSON into a CocoParse, checking every entry (see utils/data/coco_reader.py).

    Only the chunk of text in hand and compact arrays are held, never the whole document as
    Python objects. Bad entries are left out or repaired, each with one message and a count:
    nothing is lost silently and nothing crashes. A file that cannot be a COCO instances file
    (not found, not JSON, no `images`/`annotations`/`categories` list, no usable category) is a
    one-line ConfigError naming it.
    """
    path = Path(path)
    entries = _Entries(path)
    try:
        with open(path, encoding="utf-8-sig") as file:
            stream = JsonStream(file, path)
            for key in stream.items():
                if key in ("images", "annotations") and stream.next_is("["):
                    add = entries.add_image if key == "images" else entries.add_annotation
                    for position, element in enumerate(stream.elements()):
                        add(position, element)
                    entries.seen[key] = True
                elif key == "categories":
                    entries.categories = stream.value()
                else:
                    stream.value()  # info, licenses and the like: not needed
    except FileNotFoundError:
        raise ConfigError(f"{path}: COCO annotations file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: unreadable COCO annotations file ({type(error).__name__}: {error})") from None
    for key in ("images", "annotations"):
        if not entries.seen[key]:
            raise ConfigError(f"{path}: not a COCO instances file (no '{key}' list)")
    return _finish(entries)


def missing_segmentation_notes(parse: CocoParse, instances: np.ndarray) -> list[str]:
    """One line per instance of `instances` (positions in the parse's instances) whose annotation has no segmentation.

    For the segmentation task only: such an instance trains as its box, a rectangular mask, which
    must not pass unsaid; the caller counts the lines under BAD_SEGMENTATION. Detection uses the
    boxes and does not call it. Instances with an unusable segmentation are not named again: the
    reader noted them already.
    """
    unsegmented = instances[~parse.has_segmentation[instances]]
    return [
        f"{parse.source}: annotation {parse.annotation_ids[j]}: no 'segmentation' (missing or empty); its box is used"
        for j in unsegmented
    ]


def _categories(entries: _Entries) -> tuple[np.ndarray, list[str]]:
    """Category ids ascending and their names; duplicates are warned and the first kept."""
    path, raw = entries.path, entries.categories
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: not a COCO instances file (no 'categories' list)")
    by_id: dict[int, str] = {}
    for position, category in enumerate(raw):
        category_id = category.get("id") if isinstance(category, dict) else None
        if not _is_int(category_id):
            entries.note(BAD_ANNOTATION, f"categories[{position}] has no integer 'id'; left out")
        elif category_id in by_id:
            entries.note(BAD_ANNOTATION, f"category {category_id} is listed twice; the first is kept")
        else:
            by_id[category_id] = str(category.get("name", category_id))
    if not by_id:
        raise ConfigError(f"{path}: the 'categories' list has no usable category (each needs an integer 'id')")
    ids = sorted(by_id)
    return np.array(ids, np.int64), [by_id[i] for i in ids]


def _unique_images(entries: _Entries) -> np.ndarray:
    """Indices of the images to keep: the first entry of each id and of each file name (duplicates warned)."""
    ids = np.frombuffer(entries.image_ids, np.int64)
    _, first = np.unique(ids, return_index=True)
    keep = np.zeros(len(ids), bool)
    keep[first] = True
    names_seen: dict[str, int] = {}
    for index in range(len(ids)):
        name = entries.file_names[index]
        if not keep[index]:
            entries.note(BAD_IMAGE, f"image id {ids[index]} is listed twice; the entry for {name} is left out")
        elif name in names_seen:
            keep[index] = False
            entries.note(BAD_IMAGE, f"image {ids[index]}: file_name {name} is also image {names_seen[name]}; left out")
        else:
            names_seen[name] = int(ids[index])
    return np.flatnonzero(keep)


def _lookup(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Position of each of `values` in `sorted_values`, or -1 where it is not there."""
    if not len(sorted_values):
        return np.full(len(values), -1, np.int64)
    position = np.minimum(np.searchsorted(sorted_values, values), len(sorted_values) - 1)
    return np.where(sorted_values[position] == values, position, -1)


def _finish(entries: _Entries) -> CocoParse:
    """Check the entries against each other and the images' sizes, and pack the usable ones."""
    category_ids, category_names = _categories(entries)
    kept = _unique_images(entries)
    image_ids = np.frombuffer(entries.image_ids, np.int64)[kept]
    file_names = [entries.file_names[i] for i in kept]
    image_wh = np.frombuffer(entries.image_wh, np.int64).reshape(-1, 2)[kept]
    order = np.argsort(image_ids, kind="stable")
    ann_ids = np.frombuffer(entries.ann_ids, np.int64)
    image_of = _lookup(image_ids[order], np.frombuffer(entries.ann_images, np.int64))
    if len(order):  # (no usable image: every lookup is -1 already, and order[0] does not exist)
        image_of = np.where(image_of >= 0, order[np.maximum(image_of, 0)], -1)
    category_of = _lookup(category_ids, np.frombuffer(entries.ann_categories, np.int64))
    keep = (image_of >= 0) & (category_of >= 0)
    for j in np.flatnonzero(image_of < 0):
        entries.note(UNKNOWN_IMAGE, f"annotation {ann_ids[j]}: image_id {entries.ann_images[j]} is not in 'images'")
    for j in np.flatnonzero((image_of >= 0) & (category_of < 0)):
        category = entries.ann_categories[j]
        entries.note(UNKNOWN_CATEGORY, f"annotation {ann_ids[j]}: category_id {category} is not in 'categories'")
    # Sizes of each annotation's image (of image 0 where the image is unknown: such annotations are left out).
    wh = image_wh[np.maximum(image_of, 0)].astype(np.float64) if len(image_wh) else np.ones((len(image_of), 2))
    boxes, box_ok = _clip_boxes(entries, np.frombuffer(entries.boxes, np.float64).reshape(-1, 4), wh, keep)
    keep &= box_ok
    keep_index = np.flatnonzero(keep)
    by_image = keep_index[np.argsort(image_of[keep_index], kind="stable")]  # JSON order within each image
    instance_offsets = np.zeros(len(image_ids) + 1, np.int64)
    instance_offsets[1:] = np.cumsum(np.bincount(image_of[by_image], minlength=len(image_ids)))
    mismatched = _rle_size_mismatches(entries, by_image, image_wh[image_of[by_image]])
    points, counts = _gather_polygons(entries, by_image, wh[by_image], mismatched)
    polygon_offsets = np.zeros(len(by_image) + 1, np.int64)
    polygon_offsets[1:] = np.cumsum(counts)
    return CocoParse(
        source=str(entries.path),
        category_ids=category_ids,
        category_names=category_names,
        image_ids=image_ids,
        file_names=file_names,
        image_wh=image_wh,
        instance_offsets=instance_offsets,
        annotation_ids=ann_ids[by_image],
        categories=category_of[by_image].astype(np.int32),
        boxes_xywhn=boxes[by_image],
        polygon_offsets=polygon_offsets,
        points=points,
        has_segmentation=np.frombuffer(entries.has_segmentation, np.int8)[by_image].astype(bool),
        messages=entries.messages,
        problems=entries.problems,
    )


def _clip_boxes(
    entries: _Entries, boxes_xywh: np.ndarray, image_wh: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (M, 4) [cx, cy, w, h] normalised, clipped to their image, and which are usable.

    A box with no area (w or h <= 0, or not finite) or none inside the image is left out; one
    that overhangs the image is cut to it. Each is warned (for the `keep` ones) and counted.
    """
    with np.errstate(invalid="ignore"):
        x1, y1 = boxes_xywh[:, 0], boxes_xywh[:, 1]
        x2, y2 = x1 + boxes_xywh[:, 2], y1 + boxes_xywh[:, 3]
        finite = np.isfinite(boxes_xywh).all(1)
        has_area = finite & (boxes_xywh[:, 2] > 0) & (boxes_xywh[:, 3] > 0)
        clipped = np.stack(
            [np.clip(x1, 0, image_wh[:, 0]), np.clip(y1, 0, image_wh[:, 1]), np.clip(x2, 0, image_wh[:, 0])]
            + [np.clip(y2, 0, image_wh[:, 1])],
            1,
        )
        inside = has_area & (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
        changed = inside & (clipped != np.stack([x1, y1, x2, y2], 1)).any(1)
    ann_ids = entries.ann_ids
    for j in np.flatnonzero(keep & ~has_area):
        entries.note(ZERO_AREA, f"annotation {ann_ids[j]}: bbox {boxes_xywh[j].tolist()} has no area; left out")
    for j in np.flatnonzero(keep & has_area & ~inside):
        size = f"{int(image_wh[j, 0])}x{int(image_wh[j, 1])}"
        entries.note(OUTSIDE, f"annotation {ann_ids[j]}: bbox {boxes_xywh[j].tolist()} is outside its {size} image")
    for j in np.flatnonzero(keep & changed):
        entries.note(CLIPPED, f"annotation {ann_ids[j]}: bbox {boxes_xywh[j].tolist()} overhangs its image; clipped")
    wh = np.concatenate([image_wh, image_wh], 1)
    xyxyn = clipped / np.where(wh > 0, wh, 1)
    boxes = np.stack(
        [(xyxyn[:, 0] + xyxyn[:, 2]) / 2, (xyxyn[:, 1] + xyxyn[:, 3]) / 2]
        + [xyxyn[:, 2] - xyxyn[:, 0]]
        + [xyxyn[:, 3] - xyxyn[:, 1]],
        1,
    )
    return boxes, inside


def _rle_size_mismatches(entries: _Entries, instances: np.ndarray, image_wh: np.ndarray) -> np.ndarray:
    """Positions (ascending) in `instances` whose RLE is not the size of its image (`image_wh` (n, 2)): noted.

    Such a mask was encoded for another image or resolution: where it lands on this one is a guess,
    so the instance keeps its box, as for any unusable segmentation.
    """
    if not entries.rle_sizes:
        return np.zeros(0, np.int64)
    position_of = np.full(len(entries.ann_ids), -1, np.int64)
    position_of[instances] = np.arange(len(instances))
    mismatched = []
    for annotation, (height, width) in entries.rle_sizes.items():
        j = position_of[annotation]
        if j < 0 or (width, height) == tuple(image_wh[j]):
            continue
        image_w, image_h = image_wh[j]
        message = (
            f"annotation {entries.ann_ids[annotation]}: RLE size {height}x{width} (h x w) is not its image's "
            f"{image_h}x{image_w}; its box is used"
        )
        entries.note(BAD_SEGMENTATION, message)
        mismatched.append(j)
    return np.array(sorted(mismatched), np.int64)


def _overhang(polygon: np.ndarray) -> float:
    """How far (normalised, >= 0) the farthest point of a finite polygon (k, 2) lies outside [0, 1]."""
    return float(max(0.0, -polygon.min(), polygon.max() - 1.0))


def _gather_polygons(
    entries: _Entries, instances: np.ndarray, image_wh: np.ndarray, dropped: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The polygons of annotations `instances`, in that order, normalised by their image's size `image_wh` (n, 2).

    Positions `dropped` of `instances` get no polygon (their box is used; the caller has noted why).

    Returns (points (P, 2) float32 in [0, 1], counts (n,)). Gathered in blocks, so the only full-size
    arrays are the pixel points read and the result. A polygon partly outside its image is clipped to
    it (Sutherland-Hodgman; rare, one at a time), warned and counted when a point lay more than
    COORD_TOLERANCE of the image's size outside (as an overhanging bbox is; less is rounding at the
    edge); one with a non-finite point or nothing inside is dropped (the instance keeps its box),
    warned and counted.
    """
    source = np.frombuffer(entries.points, np.float32).reshape(-1, 2)
    all_counts = np.frombuffer(entries.point_counts, np.int64)
    starts = (np.cumsum(all_counts) - all_counts)[instances]
    counts = all_counts[instances]  # a copy: zeroing some leaves the starts computed from all_counts
    counts[dropped] = 0
    points = np.empty((int(counts.sum()), 2), np.float32)
    bad = np.zeros(len(instances), bool)
    written = 0
    for first in range(0, len(instances), GATHER_BLOCK):
        block = slice(first, first + GATHER_BLOCK)
        picked = counts[block]
        within = np.arange(picked.sum()) - np.repeat(np.cumsum(picked) - picked, picked)
        scale = np.repeat(image_wh[block].astype(np.float32), picked, axis=0)
        normalised = source[np.repeat(starts[block], picked) + within] / scale
        with np.errstate(invalid="ignore"):
            outside = ~((normalised >= 0) & (normalised <= 1)).all(1)  # NaN counts as outside
        bad[block] = np.bincount(np.repeat(np.arange(len(picked)), picked)[outside], minlength=len(picked)) > 0
        points[written : written + len(normalised)] = normalised
        written += len(normalised)
    if not bad.any():
        return points, counts
    offsets = np.cumsum(counts) - counts
    fixed = []
    for j in np.flatnonzero(bad):
        polygon = points[offsets[j] : offsets[j] + counts[j]]
        clipped = clip_polygon(polygon, 1.0, 1.0) if np.isfinite(polygon).all() else np.zeros((0, 2), np.float32)
        ann_id = entries.ann_ids[instances[j]]
        if len(clipped) < 3:
            entries.note(BAD_SEGMENTATION, f"annotation {ann_id}: polygon is outside its image; its box is used")
            clipped = np.zeros((0, 2), np.float32)
        elif (overhang := _overhang(polygon)) > COORD_TOLERANCE:
            message = f"annotation {ann_id}: polygon overhangs its image by {overhang:.3g} of its size; clipped"
            entries.note(POLYGON_CLIPPED, message)
        fixed.append(np.clip(clipped, 0.0, 1.0))
    new_points, new_counts = pack(fixed)
    return replace(points, counts, np.flatnonzero(bad), new_points, new_counts)
