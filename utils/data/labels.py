"""Image/label index: find images, verify each image and YOLO label file (here or in a scan worker), pack, cache."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils.data.image_check import BadInputError, check_image
from utils.data.image_files import ImageFiles, image_to_label_path, labels_folder_cache
from utils.data.mapped_npz import load_npz_mapped, save_npz_atomic
from utils.data.masks import covered_areas
from utils.data.packed_strings import PackedStrings
from utils.data.polygons import gather, ranges

LOGGER = logging.getLogger(__name__)

# The class count of a --single-cls run: any non-negative integer id is a class there (every label becomes
# class 0, as YOLOv5 maps them before its nc check), so no id is past the classes (scan_report.check_class_ids).
ANY_CLASS_ID = 2**31 - 1
# Stored in (and hashed into) the label cache: a cache of another version is rebuilt. 9: a PNG's EXIF orientation
# written after its pixel data is read; 10: a self-intersecting (figure 8) polygon is kept, not dropped as zero-area.
CACHE_VERSION = 10
# Coordinates this far outside [0, 1] are clipped with a warning, further is corrupt; a box row's edges may
# overhang the image this far (rounding) before its clip is noted as a repair.
COORD_TOLERANCE = 0.01
MIN_RELATIVE_AREA = 1e-8  # an instance covering less of the image (masks.covered_areas) is degenerate and dropped
STATUSES = ("found", "missing", "empty", "corrupt")


@dataclass
class LabelRecord:
    """The verified content of one image/label pair.

    `status` is "found", "missing" (no label file: background), "empty" (background) or
    "corrupt" (image skipped). `labels`: (n, 5) float32 [cls, cx, cy, w, h] normalised, the box
    being the min/max of the polygon; `segments`: n (k, 2) float32 normalised polygons (the 4
    corners for a box-only row). `message` is one line naming the file, empty when clean.
    `num_degenerate` counts the zero-area rows left out of `labels`. Class ids are checked to be
    non-negative integers only: whether they are among the dataset's classes is decided on the
    whole index (scan_report.check_class_ids), so the cache does not depend on the class count.
    """

    image_path: str
    status: str
    shape_wh: tuple[int, int] = (0, 0)
    labels: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), np.float32))
    segments: list[np.ndarray] = field(default_factory=list)
    message: str = ""
    num_degenerate: int = 0


def _read_label_rows(label_path: str) -> list[tuple[int, tuple[float, ...]]]:
    """Parse a label file into (line number, row of floats) pairs, blank lines skipped.

    The line numbers travel with the rows so that every later error names the line in the file,
    whatever blank lines or duplicate rows came before it. Raises BadInputError for unreadable
    text or bad columns.
    """
    try:
        # utf-8-sig: editors on Windows start files with a byte-order mark, which is not part of a number
        with open(label_path, encoding="utf-8-sig") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInputError(f"unreadable label file ({type(error).__name__})") from error
    rows = []
    for line_number, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        if not (len(words) == 5 or (len(words) >= 7 and len(words) % 2 == 1)):
            raise BadInputError(f"line {line_number} has {len(words)} columns (need 5, or an odd number >= 7)")
        try:
            rows.append((line_number, tuple(float(word) for word in words)))
        except ValueError as error:
            raise BadInputError(f"line {line_number} has a non-numeric value") from error
    return rows


def _check_rows(numbered_rows: list[tuple[int, tuple[float, ...]]]) -> tuple[list[np.ndarray], list[str]]:
    """Validate and repair parsed (line number, row) pairs; return the cleaned rows and a list of the repairs made.

    Duplicate rows are removed (the first is kept) and coordinates within COORD_TOLERANCE of
    [0, 1] are clipped; anything else wrong raises BadInputError naming the line in the file.
    """
    fixes = []
    first_line: dict[tuple[float, ...], int] = {}
    for line_number, row in numbered_rows:
        first_line.setdefault(row, line_number)
    if len(first_line) < len(numbered_rows):
        fixes.append(f"removed {len(numbered_rows) - len(first_line)} duplicate row(s)")
    arrays = [np.array(row, dtype=np.float64) for row in first_line]
    num_clipped = 0
    for line_number, row in zip(first_line.values(), arrays, strict=True):
        if not np.isfinite(row).all():
            raise BadInputError(f"line {line_number} has a non-finite value")
        class_id = row[0]
        if class_id != int(class_id) or class_id < 0:
            raise BadInputError(f"line {line_number} class id {class_id:g} is not a non-negative integer")
        coords = row[1:]
        if coords.min() < -COORD_TOLERANCE or coords.max() > 1 + COORD_TOLERANCE:
            bad = coords[(coords < -COORD_TOLERANCE) | (coords > 1 + COORD_TOLERANCE)][0]
            raise BadInputError(f"line {line_number} coordinate {bad:g} is outside [0, 1]")
        outside = (coords < 0) | (coords > 1)
        num_clipped += int(outside.sum())
        np.clip(coords, 0.0, 1.0, out=coords)
    if num_clipped:
        fixes.append(f"clipped {num_clipped} coordinate(s) slightly outside [0, 1]")
    return arrays, fixes


def _count_overhanging_boxes(rows: list[np.ndarray]) -> int:
    """Count the box rows (5 columns) whose edges lie more than COORD_TOLERANCE outside the image.

    Such a box is cut to the image (_rows_to_instances) and the cut noted as a repair, like any
    other; an overhang within the tolerance is rounding in a normal label and is cut silently.
    """
    box_rows = [row[1:] for row in rows if len(row) == 5]
    if not box_rows:  # polygon files: ~5 us saved per file of a scan
        return 0
    boxes = np.array(box_rows)
    centres, half_sizes = boxes[:, :2], boxes[:, 2:] / 2
    overhang = np.maximum(half_sizes - centres, centres + half_sizes - 1)  # past the near edge, per axis
    return int((overhang > COORD_TOLERANCE).any(1).sum())


def _rows_to_instances(rows: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Turn clean rows into (labels (n, 5) [cls, cx, cy, w, h], polygons); boxes become their 4 corners."""
    segments = []
    for row in rows:
        if len(row) == 5:
            cx, cy, w, h = row[1:]
            x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
            corners = np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], dtype=np.float32)
            segments.append(np.clip(corners, 0.0, 1.0))  # keep the visible part (noted: _count_overhanging_boxes)
        else:
            segments.append(row[1:].reshape(-1, 2).astype(np.float32))
    labels = np.zeros((len(rows), 5), dtype=np.float32)
    for i, (row, points) in enumerate(zip(rows, segments, strict=True)):
        low, high = points.min(0), points.max(0)
        labels[i] = (row[0], *((low + high) / 2), *(high - low))
    return labels, segments


def _drop_degenerate(labels: np.ndarray, segments: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray], int]:
    """Leave out instances whose polygon (a box's clipped corners) covers < MIN_RELATIVE_AREA of the image.

    Such rows (collinear or repeated points, a box of zero width or height) cover no pixel, and
    their box outlines a line or a point, not an object. Returns (labels, segments, number dropped).
    """
    outlines = [np.asarray(segment, np.float64).reshape(-1, 2) for segment in segments]
    points = np.concatenate(outlines) if outlines else np.zeros((0, 2))
    keep = np.flatnonzero(covered_areas(points, [len(outline) for outline in outlines]) >= MIN_RELATIVE_AREA)
    return labels[keep], [segments[i] for i in keep], len(segments) - len(keep)


def verify_image_label(image_path: str, label_path: str | None) -> LabelRecord:
    """Check one image and its label file and return what the dataset should use.

    Never raises for bad data: an unusable image or label gives status "corrupt" with a
    one-line reason naming the file; fixable labels are repaired and the repair described.
    Degenerate (zero-area) instances are dropped, counted and named in that line; a file left
    with no instance is "empty" (background). `label_path` None checks the image alone (its
    labels come from a COCO JSON): a usable image is then "missing" (no label file read).
    """
    try:
        shape_wh, image_note = check_image(image_path)
    except BadInputError as error:
        return LabelRecord(image_path, "corrupt", message=f"corrupt image {image_path}: {error}; skipped")
    image_message = f"image {image_path}: {image_note}" if image_note else ""
    if label_path is None or not os.path.lexists(label_path):
        return LabelRecord(image_path, "missing", shape_wh, message=image_message)
    try:
        rows, fixes = _check_rows(_read_label_rows(label_path))
    except BadInputError as error:
        return LabelRecord(image_path, "corrupt", shape_wh, message=f"corrupt label {label_path}: {error}; skipped")
    num_overhanging = _count_overhanging_boxes(rows)
    if num_overhanging:
        fixes.append(f"clipped {num_overhanging} box(es) overhanging the image edge by more than {COORD_TOLERANCE:g}")
    labels, segments, num_degenerate = _drop_degenerate(*_rows_to_instances(rows))
    if num_degenerate:
        fixes.append(f"dropped {num_degenerate} degenerate (zero-area) instance(s)")
    label_message = f"fixed label {label_path}: {'; '.join(fixes)}" if fixes else ""
    message = "; ".join(part for part in (image_message, label_message) if part)
    status = "found" if len(labels) else "empty"
    return LabelRecord(image_path, status, shape_wh, labels, segments, message, num_degenerate)


def verify_files(image_files: Sequence[str], read_labels: bool = True) -> LabelIndex:
    """Verify a run of images with their label files and pack the records: one job of a label scan.

    Returns build_index of the verify_image_label records in file order, so indices of
    consecutive runs concatenate (utils/data/scan.py: concatenate_indices) to the index of the
    whole list. Packed, a job's answer is a few arrays, not one Python object per polygon.
    Without `read_labels` it verifies the images only (labels from a COCO JSON; no label file is read).
    """
    return build_index(
        [verify_image_label(path, image_to_label_path(path) if read_labels else None) for path in image_files]
    )


def serve_verification() -> None:
    """Run as a label-scan worker process: answer each job read from stdin with its LabelIndex on stdout.

    A job is a pickled (image_files, read_labels), its answer the pickled verify_files result;
    the process returns when stdin closes (the scanning process is done, or gone). It lives in
    this module because a worker imports only this module (numpy, PIL; yaml via image_files), not
    torch: it starts in ~0.2 s. Only answers go to the original stdout; anything a library prints goes to stderr.
    SIGINT is ignored: Ctrl-C reaches the whole process group, and the parent stops its workers
    by closing their stdin, so one Ctrl-C gives one traceback, not one per worker. An unexpected
    exception ends the process with its traceback on stderr, which the parent reports.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs = sys.stdin.buffer
    while True:
        try:
            image_files, read_labels = pickle.load(jobs)  # the parent's own pipe: trusted data
        except EOFError:
            return
        pickle.dump(verify_files(image_files, read_labels), answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


@dataclass
class LabelIndex:
    """Every usable image with its labels and polygons, packed into a few flat arrays.

    Packed so that forked DataLoader workers share the pages instead of copying millions of
    small Python objects (reference counting writes to every object it touches). `im_files`: the
    image paths, a PackedStrings (any sequence of str given is packed).
    `shapes`: (N, 2) int32 (w, h) after EXIF rotation. `labels`: (M, 5) float32
    [cls, cx, cy, w, h] normalised; image i owns rows label_offsets[i]:label_offsets[i+1].
    `seg_points`: (P, 2) float32 normalised; instance j owns rows seg_offsets[j]:seg_offsets[j+1].
    `counts` maps found/missing/empty/corrupt to numbers of images; `messages` holds one line per
    bad or repaired file (or COCO JSON entry): a list, or a read-only PackedStrings when read from
    the label cache; `num_degenerate` is how many zero-area instances were
    left out in all; `problems` counts a COCO JSON's entries repaired or left out, by reason (empty
    for YOLO txt labels). Arrays read from a label cache are read-only memory maps of the file.
    """

    im_files: PackedStrings
    shapes: np.ndarray
    labels: np.ndarray
    label_offsets: np.ndarray
    seg_points: np.ndarray
    seg_offsets: np.ndarray
    counts: dict[str, int]
    messages: Sequence[str]
    num_degenerate: int = 0
    problems: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.im_files = PackedStrings.pack(self.im_files)

    def __len__(self) -> int:
        return len(self.im_files)

    def labels_of(self, i: int) -> np.ndarray:
        """Return image i's labels, (n, 5) float32 [cls, cx, cy, w, h] normalised (a view)."""
        return self.labels[self.label_offsets[i] : self.label_offsets[i + 1]]

    def segments_of(self, i: int) -> list[np.ndarray]:
        """Return image i's polygons: n arrays (k, 2) float32 normalised (views), aligned with labels_of(i)."""
        first, last = self.label_offsets[i], self.label_offsets[i + 1]
        offsets = self.seg_offsets[first : last + 1]
        return [self.seg_points[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    def polygons_of(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Image i's polygons packed: (points (P, 2) float32 normalised, a view; counts (n,), or (0,) for none)."""
        first, last = self.label_offsets[i], self.label_offsets[i + 1]
        offsets = self.seg_offsets[first : last + 1]
        return self.seg_points[offsets[0] : offsets[-1]], np.diff(offsets)

    def reordered(self, order: np.ndarray) -> LabelIndex:
        """Return a new index holding images in `order` (e.g. sorted by aspect ratio), packed afresh.

        Gathered with array operations (no Python work per image): a million images take about a second.
        """
        order = np.asarray(order, np.int64)
        label_counts = np.diff(self.label_offsets)
        labels, new_label_counts = gather(self.labels, label_counts, order)
        instances = ranges(self.label_offsets[:-1][order], new_label_counts)
        points, point_counts = gather(self.seg_points, np.diff(self.seg_offsets), instances)
        return LabelIndex(
            self.im_files.take(order),
            self.shapes[order],
            labels.reshape(-1, 5),
            _offsets(new_label_counts),
            points.reshape(-1, 2),
            _offsets(point_counts),
            self.counts,
            self.messages,
            self.num_degenerate,
            self.problems,
        )


def _offsets(counts: np.ndarray) -> np.ndarray:
    """(n + 1,) int64 offsets of consecutive runs of `counts` rows."""
    offsets = np.zeros(len(counts) + 1, np.int64)
    offsets[1:] = np.cumsum(counts)
    return offsets


def _pack(
    labels: list[np.ndarray], segments: list[list[np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate per-image labels and polygons into (labels, label_offsets, seg_points, seg_offsets)."""
    label_offsets = _offsets(np.array([len(x) for x in labels], np.int64))
    flat_segments = [s for image_segments in segments for s in image_segments]
    seg_offsets = _offsets(np.array([len(s) for s in flat_segments], np.int64))
    all_labels = np.concatenate(labels).astype(np.float32) if labels else np.zeros((0, 5), np.float32)
    points = np.concatenate(flat_segments).astype(np.float32) if flat_segments else np.zeros((0, 2), np.float32)
    return all_labels.reshape(-1, 5), label_offsets, points.reshape(-1, 2), seg_offsets


def build_index(records: list[LabelRecord]) -> LabelIndex:
    """Pack verified records into a LabelIndex, leaving out the corrupt ones (still counted)."""
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    kept = [r for r in records if r.status != "corrupt"]
    shapes = np.array([r.shape_wh for r in kept], dtype=np.int32).reshape(-1, 2)
    packed = _pack([r.labels for r in kept], [r.segments for r in kept])
    messages = [r.message for r in records if r.message]
    num_degenerate = sum(r.num_degenerate for r in records)
    return LabelIndex([r.image_path for r in kept], shapes, *packed, counts, messages, num_degenerate)


def label_cache_path(image_files: Sequence[str]) -> Path:
    """Return where the label cache of these images lives: the split's own (ImageFiles.cache_path) when
    list_image_files knows it, else next to the first image's labels folder (labels/train.cache)."""
    if isinstance(image_files, ImageFiles) and image_files.cache_path is not None:
        return image_files.cache_path
    return labels_folder_cache(image_files[0])


def save_label_cache(path: Path, index: LabelIndex, digest: str) -> bool:
    """Write `index` to `path` as a pickle-free .npz, atomically; warn and return False if it cannot be written."""
    messages = PackedStrings.pack(index.messages)  # a text array would give each line the longest one's width
    try:
        save_npz_atomic(
            path,
            {
                "version": np.array(CACHE_VERSION),
                "digest": np.array(digest),
                "im_files_data": index.im_files.data,
                "im_files_offsets": index.im_files.offsets,
                "shapes": index.shapes,
                "labels": index.labels,
                "label_offsets": index.label_offsets,
                "seg_points": index.seg_points,
                "seg_offsets": index.seg_offsets,
                "counts": np.array([index.counts[s] for s in STATUSES], dtype=np.int64),
                "messages_data": messages.data,
                "messages_offsets": messages.offsets,
                "num_degenerate": np.array(index.num_degenerate, dtype=np.int64),
                "problem_reasons": np.array(list(index.problems), dtype=str),
                "problem_counts": np.array(list(index.problems.values()), dtype=np.int64),
            },
        )
        return True
    except OSError as error:
        LOGGER.warning(f"label cache {path} is not writable ({error.strerror or error}); continuing without it")
        return False


def load_label_cache(path: Path, digest: str) -> LabelIndex | None:
    """Return the index stored at `path` if its version and digest match, else None (rebuild).

    The arrays are memory maps of the file (load_npz_mapped): every rank of a node that reads
    the same cache shares its pages instead of holding a copy each.
    """
    try:
        data = load_npz_mapped(path)
        if int(data["version"]) != CACHE_VERSION or str(data["digest"]) != digest:
            return None
        reasons = data["problem_reasons"].tolist() if "problem_reasons" in data else []
        problems = dict(zip(reasons, data["problem_counts"].tolist() if reasons else [], strict=True))
        return LabelIndex(
            PackedStrings(data["im_files_data"], data["im_files_offsets"]),
            data["shapes"],
            data["labels"],
            data["label_offsets"],
            data["seg_points"],
            data["seg_offsets"],
            dict(zip(STATUSES, data["counts"].tolist(), strict=True)),
            PackedStrings(data["messages_data"], data["messages_offsets"]),
            int(data["num_degenerate"]),
            problems,
        )
    except Exception:  # missing, truncated or foreign file: treat as no cache and rebuild
        return None
