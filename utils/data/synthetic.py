"""Generate the built-in synthetic shapes dataset (images, YOLO polygon labels, COCO val JSON) on first use."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from utils.cpus import usable_cpus

LOGGER = logging.getLogger(__name__)

# Bump whenever the drawing code changes what a given spec produces: an old dataset then fails the
# spec check instead of silently differing from a freshly generated one.
GENERATOR_VERSION = 1
MARKER_NAME = ".complete"
SPLITS: tuple[tuple[str, int], ...] = (("train", 0), ("val", 1))
SHAPE_NAMES: tuple[str, ...] = ("circle", "triangle", "square", "star", "cross", "crescent")

_SUBPIXEL_BITS = 4  # cv2.fillPoly fixed-point shift: vertices are drawn with 1/16 px precision
_MAX_BOX_IOU = 0.3  # a new object's box may overlap any earlier box at most this much
_MIN_VISIBLE = 0.7  # every object keeps at least this fraction of its pixels unoccluded
_MIN_CONTRAST = 110.0  # minimum BGR distance between an object and the background under it


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that decides the generated dataset's content; stored in the completion marker.

    `class_names` are shape names from SHAPE_NAMES (the name picks what is drawn); their order
    gives the class indices. Image sides are drawn independently from [min_side, max_side] px,
    so images are landscape, portrait or square. Object sizes are fractions of the short side.
    """

    seed: int = 0
    num_train: int = 1000
    num_val: int = 200
    class_names: tuple[str, ...] = SHAPE_NAMES
    min_side: int = 256
    max_side: int = 480
    max_objects: int = 8
    min_object_frac: float = 0.05
    max_object_frac: float = 0.5
    empty_fraction: float = 0.03
    jpeg_quality: int = 90

    def __post_init__(self) -> None:
        unknown = [name for name in self.class_names if name not in SHAPE_NAMES]
        if unknown or not self.class_names:
            raise ValueError(f"SyntheticSpec.class_names {unknown or '()'} invalid; choose from {SHAPE_NAMES}")
        if self.num_train < 1 or self.num_val < 1 or not 32 <= self.min_side <= self.max_side:
            raise ValueError(f"SyntheticSpec needs num_train, num_val >= 1 and 32 <= min_side <= max_side: {self}")

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as JSON-ready plain types (tuples become lists), plus the generator version."""
        return {**dataclasses.asdict(self), "class_names": list(self.class_names), "version": GENERATOR_VERSION}

    def split_size(self, split_id: int) -> int:
        """Return the number of images in split `split_id` (0 = train, 1 = val)."""
        return self.num_train if split_id == 0 else self.num_val


def ensure_synthetic_dataset(root: Path, spec: SyntheticSpec = SyntheticSpec(), max_threads: int = 4) -> Path:
    """Return `root` once the synthetic dataset is complete there, generating it if absent.

    Safe when many processes (torchrun ranks or unrelated jobs) call it at once: an exclusive
    fcntl lock on `<parent>/.<name>.lock` lets one process generate while the others wait. The
    data is written into a temporary sibling folder, the marker `root/.complete` (JSON of the
    spec) is written last, and the folder is renamed onto `root` in one step, so a half-written
    dataset is never visible at `root`. Raises ValueError when `root` holds a dataset made with
    another spec, or a folder that is not a complete synthetic dataset. Images are drawn on up to
    `max_threads` threads (4 leaves a trainer's cores alone; benchmarks/gpu.py gives it every core).
    """
    root = Path(root)
    if _is_complete(root, spec):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root.parent / f".{root.name}.lock"):
        if _is_complete(root, spec):  # another process finished while we waited
            return root
        _remove_stale_temps(root)
        tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
        start = time.perf_counter()
        LOGGER.info("Generating synthetic dataset (%d train, %d val images) in %s", spec.num_train, spec.num_val, root)
        _generate(tmp, spec, max_threads)
        (tmp / MARKER_NAME).write_text(json.dumps(spec.to_dict(), indent=1) + "\n")
        os.rename(tmp, root)
        LOGGER.info("Synthetic dataset ready in %.1fs: %s", time.perf_counter() - start, root)
    return root


def _is_complete(root: Path, spec: SyntheticSpec) -> bool:
    """True when `root` holds a finished dataset for `spec`; False when `root` does not exist."""
    if not root.exists():
        return False
    marker = root / MARKER_NAME
    if not marker.is_file():
        raise ValueError(f"{root} exists but is not a complete synthetic dataset (no {MARKER_NAME}); delete it")
    stored = json.loads(marker.read_text())
    if stored != spec.to_dict():
        raise ValueError(f"{root} holds a synthetic dataset with a different spec; delete it or use another path")
    return True


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if needed) for the `with` block.

    The lock file is left in place: deleting it would let a waiter lock a stale inode while a
    newcomer locks a fresh one. The kernel drops the lock if the holder dies.
    """
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            LOGGER.info("Waiting for another process to finish generating next to %s", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_temps(root: Path) -> None:
    """Delete temp folders left by generators that died; only called while holding the lock."""
    for stale in root.parent.glob(f".{root.name}.tmp-*"):
        LOGGER.warning("Removing unfinished synthetic dataset %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _generate(out: Path, spec: SyntheticSpec, max_threads: int) -> None:
    """Write every image and label file under `out` and the COCO JSON for the val split."""
    for kind in ("images", "labels"):
        for split, _ in SPLITS:
            (out / kind / split).mkdir(parents=True, exist_ok=True)
    (out / "annotations").mkdir()
    jobs = [(out, spec, split_id, index) for _, split_id in SPLITS for index in range(spec.split_size(split_id))]
    num_workers = min(max_threads, usable_cpus(), max(1, len(jobs) // 50))
    if num_workers > 1:
        # Every image has its own RNG, so the output is the same for any worker count. Threads, not
        # processes: OpenCV drawing and JPEG encoding release the GIL, and forking a process that
        # already runs OpenMP/OpenCV threads (a test session, a trainer) can deadlock the children.
        with ThreadPoolExecutor(num_workers) as pool:
            records = list(pool.map(_write_sample, jobs))
    else:
        records = [_write_sample(job) for job in jobs]
    val_records = [record for record, job in zip(records, jobs, strict=True) if job[2] == 1]
    coco = _coco_json(val_records, spec.class_names)
    (out / "annotations" / "instances_val.json").write_text(json.dumps(coco, separators=(",", ":")))


def image_name(index: int) -> str:
    """Return the file stem of image `index` in a split: its 1-based COCO image id, zero padded."""
    return f"{index + 1:06d}"


def _write_sample(job: tuple[Path, SyntheticSpec, int, int]) -> dict[str, Any]:
    """Render one image, write its JPEG and label file, and return what the COCO JSON needs."""
    out, spec, split_id, index = job
    split = SPLITS[split_id][0]
    image, objects = render_image(spec, split_id, index)
    height, width = image.shape[:2]
    stem = image_name(index)
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, spec.jpeg_quality])
    assert ok, "JPEG encoding failed"
    (out / "images" / split / f"{stem}.jpg").write_bytes(encoded.tobytes())
    lines = []
    for class_id, polygon_xy in objects:
        coords = (polygon_xy / np.array([width, height])).clip(0.0, 1.0).reshape(-1)
        lines.append(" ".join([str(class_id), *(f"{value:.6f}" for value in coords)]))
    (out / "labels" / split / f"{stem}.txt").write_text("".join(line + "\n" for line in lines))
    return {"id": index + 1, "file_name": f"{stem}.jpg", "width": width, "height": height, "objects": objects}


def _coco_json(records: list[dict[str, Any]], class_names: tuple[str, ...]) -> dict[str, Any]:
    """Build a COCO instances dict: category id = class index + 1, pixel bbox/segmentation, polygon area."""
    images, annotations = [], []
    for record in records:
        images.append({key: record[key] for key in ("id", "file_name", "width", "height")})
        for class_id, polygon_xy in record["objects"]:
            x_min, y_min = polygon_xy.min(0)
            x_max, y_max = polygon_xy.max(0)
            annotations.append(
                {
                    "id": len(annotations) + 1,  # pycocotools treats annotation id 0 as "unmatched"
                    "image_id": record["id"],
                    "category_id": class_id + 1,
                    "bbox": [round(float(v), 3) for v in (x_min, y_min, x_max - x_min, y_max - y_min)],
                    "area": round(polygon_area(polygon_xy), 3),
                    "segmentation": [[round(float(v), 3) for v in polygon_xy.reshape(-1)]],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": i + 1, "name": name} for i, name in enumerate(class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def polygon_area(polygon_xy: np.ndarray) -> float:
    """Return the area of a simple polygon (k, 2) by the shoelace formula, in squared input units."""
    x, y = polygon_xy[:, 0], polygon_xy[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def render_image(spec: SyntheticSpec, split_id: int, index: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Draw image `index` of split `split_id` and return it with its objects.

    Returns (image HWC uint8 BGR, [(class index, polygon (k, 2) float64 pixels)]). Polygon
    coordinates are continuous: the image spans [0, W] x [0, H], a pixel's centre is at +0.5.
    Randomness comes only from `default_rng([seed, split_id, index])`, so any image can be
    rendered alone and the result does not depend on worker count or order.
    """
    rng = np.random.default_rng([spec.seed, split_id, index])
    height, width = (int(v) for v in rng.integers(spec.min_side, spec.max_side + 1, size=2))
    image = _background(rng, height, width)
    _add_distractors(rng, image)
    is_empty = rng.random() < spec.empty_fraction
    num_objects = 0 if is_empty else int(rng.integers(1, spec.max_objects + 1))
    objects = _place_objects(rng, image, spec, num_objects)
    if rng.random() < 0.3:
        image = cv2.GaussianBlur(image, (0, 0), float(rng.uniform(0.4, 1.0)))
    # Uniform sensor noise with standard deviation up to 6 (cheaper to draw than Gaussian noise).
    noise = rng.random(image.shape, dtype=np.float32) - np.float32(0.5)
    image += noise * np.float32(rng.uniform(0.0, 6.0) * np.sqrt(12))
    return np.clip(image, 0, 255, out=image).astype(np.uint8), objects


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Return a float32 (H, W, 3) background: flat colour, linear gradient, smooth texture or a mix."""
    kind = rng.integers(4)
    base = rng.uniform(0, 255, size=3)
    image = np.empty((height, width, 3), np.float32)
    image[:] = base
    if kind in (1, 3):  # linear gradient to a second colour along a random direction
        angle = rng.uniform(0, 2 * np.pi)
        ramp = np.arange(width, dtype=np.float32) * np.cos(angle) + np.arange(height, dtype=np.float32)[
            :, None
        ] * np.sin(angle)
        ramp = (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1.0)
        image += ramp[..., None] * (rng.uniform(0, 255, size=3) - base).astype(np.float32)
    if kind in (2, 3):  # smooth texture: coarse noise upsampled, per-channel or grey
        cell = int(rng.integers(8, 48))
        channels = 3 if rng.random() < 0.5 else 1
        coarse = rng.normal(0, 1, size=(height // cell + 2, width // cell + 2, channels)).astype(np.float32)
        texture = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC).reshape(height, width, -1)
        image += texture * rng.uniform(10, 40)
    return np.clip(image, 0, 255, out=image)


def _add_distractors(rng: np.random.Generator, image: np.ndarray) -> None:
    """Blend faint lines and blurred blobs into `image` in place, so not every edge is an object."""
    height, width = image.shape[:2]
    layer = image.copy()
    for _ in range(int(rng.integers(0, 7))):
        p1 = (int(rng.integers(width)), int(rng.integers(height)))
        p2 = (int(rng.integers(width)), int(rng.integers(height)))
        cv2.line(layer, p1, p2, rng.uniform(0, 255, size=3).tolist(), int(rng.integers(1, 4)), cv2.LINE_AA)
    for _ in range(int(rng.integers(0, 4))):
        centre = (int(rng.integers(width)), int(rng.integers(height)))
        axes = (int(rng.integers(5, width // 4)), int(rng.integers(3, height // 8)))
        angle = float(rng.uniform(0, 180))
        cv2.ellipse(layer, centre, axes, angle, 0, 360, rng.uniform(0, 255, size=3).tolist(), -1, cv2.LINE_AA)
    layer = cv2.GaussianBlur(layer, (0, 0), 1.5)
    alpha = float(rng.uniform(0.15, 0.35))
    image *= 1 - alpha
    image += alpha * layer


def _unit_shape(name: str) -> np.ndarray:
    """Return the polygon (k, 2) of shape `name` fitting in the unit disc, counter-clockwise."""
    if name in ("circle", "triangle", "square"):
        sides = {"circle": 48, "triangle": 3, "square": 4}[name]
        angles = np.linspace(0, 2 * np.pi, sides, endpoint=False) + np.pi / 2
        return np.stack([np.cos(angles), np.sin(angles)], 1)
    if name == "star":  # five points, inner radius 0.42 of outer
        angles = np.linspace(0, 2 * np.pi, 10, endpoint=False) + np.pi / 2
        radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
        return np.stack([radii * np.cos(angles), radii * np.sin(angles)], 1)
    if name == "cross":  # plus sign with arms 0.36 wide (in half-widths), scaled into the unit disc
        a = 0.36
        corners = [(a, -1), (a, -a), (1, -a), (1, a), (a, a), (a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a)]
        return np.array([*corners, (-a, -a), (-a, -1)], np.float64) / np.hypot(1, a)
    # crescent: unit disc minus a disc of radius 0.85 centred at (0.5, 0)
    shift, inner = 0.5, 0.85
    cross_x = (1 - inner**2 + shift**2) / (2 * shift)
    outer_start = np.arctan2(np.sqrt(1 - cross_x**2), cross_x)
    outer = np.linspace(outer_start, 2 * np.pi - outer_start, 28)
    inner_start = np.arctan2(np.sqrt(1 - cross_x**2), cross_x - shift)
    inner_angles = np.linspace(2 * np.pi - inner_start, inner_start, 20)[1:-1]
    outer_xy = np.stack([np.cos(outer), np.sin(outer)], 1)
    inner_xy = np.stack([shift + inner * np.cos(inner_angles), inner * np.sin(inner_angles)], 1)
    return np.concatenate([outer_xy, inner_xy])


def _candidate_polygon(rng: np.random.Generator, name: str, height: int, width: int, spec: SyntheticSpec) -> np.ndarray:
    """Return a randomly sized, stretched, rotated and placed polygon (k, 2) in pixels, inside the image.

    Vertices are rounded to the fixed-point grid fillPoly draws on, so the label is the drawn shape.
    """
    short = min(height, width)
    log_frac = rng.uniform(np.log(spec.min_object_frac), np.log(spec.max_object_frac))
    radius = np.exp(log_frac) * short / 2
    stretch = rng.uniform(0.85, 1.15)
    polygon = _unit_shape(name) * radius * np.array([stretch, 1 / stretch])
    angle = rng.uniform(0, 2 * np.pi)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    polygon = polygon @ rotation.T
    polygon -= polygon.min(0)
    extent = polygon.max(0)
    room = np.array([width, height]) - 2 - extent  # keep a 1 px margin on every side
    polygon += 1 + rng.uniform(0, 1, size=2) * np.maximum(room, 0)
    scale = 1 << _SUBPIXEL_BITS
    return np.round(polygon * scale) / scale


def _polygon_mask(polygon_xy: np.ndarray, x0: int, y0: int, height: int, width: int) -> np.ndarray:
    """Rasterise `polygon_xy` (pixels, continuous coords) into a bool (height, width) crop at (x0, y0)."""
    mask = np.zeros((height, width), np.uint8)
    cv2.fillPoly(mask, [_fixed_point(polygon_xy - [x0, y0])], 1, cv2.LINE_8, _SUBPIXEL_BITS)
    return mask.astype(bool)


def _fixed_point(polygon_xy: np.ndarray) -> np.ndarray:
    """Convert continuous pixel coords to cv2's fixed-point vertex array (pixel centres at integers)."""
    return np.round((polygon_xy - 0.5) * (1 << _SUBPIXEL_BITS)).astype(np.int32)


def _box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box (4,) against xyxy boxes (n, 4)."""
    top_left = np.maximum(box[:2], boxes[:, :2])
    bottom_right = np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(bottom_right - top_left, 0, None), 1)
    area = np.prod(box[2:] - box[:2])
    areas = np.prod(boxes[:, 2:] - boxes[:, :2], 1)
    return inter / (area + areas - inter)


def _place_objects(
    rng: np.random.Generator, image: np.ndarray, spec: SyntheticSpec, num_objects: int
) -> list[tuple[int, np.ndarray]]:
    """Draw up to `num_objects` shapes into `image` (float32, in place) and return their labels.

    A candidate is rejected (and redrawn, at most 30 times; after that the object is dropped) when
    its box overlaps an earlier box with IoU > _MAX_BOX_IOU or when it would leave an earlier object
    with less than _MIN_VISIBLE of its own pixels visible, tracked exactly with a per-pixel owner
    map; so no object is mostly hidden.
    """
    height, width = image.shape[:2]
    owner = np.full((height, width), -1, np.int16)  # index of the top object at each pixel
    objects: list[tuple[int, np.ndarray]] = []
    boxes = np.zeros((0, 4))
    visible: list[int] = []
    full_area: list[int] = []
    for _ in range(num_objects):
        class_id = int(rng.integers(len(spec.class_names)))
        for _attempt in range(30):
            polygon = _candidate_polygon(rng, spec.class_names[class_id], height, width, spec)
            box = np.concatenate([polygon.min(0), polygon.max(0)])
            if len(boxes) and _box_iou(box, boxes).max() > _MAX_BOX_IOU:
                continue
            x0, y0 = int(box[0]), int(box[1])
            x1, y1 = int(np.ceil(box[2])), int(np.ceil(box[3]))
            mask = _polygon_mask(polygon, x0, y0, y1 - y0, x1 - x0)
            covered = np.bincount(owner[y0:y1, x0:x1][mask] + 1, minlength=len(objects) + 1)[1:]
            if any(visible[j] - covered[j] < _MIN_VISIBLE * full_area[j] for j in range(len(objects))):
                continue
            break
        else:
            continue  # crowded image: drop this object rather than hide another
        visible = [count - int(lost) for count, lost in zip(visible, covered, strict=True)]
        visible.append(int(mask.sum()))
        full_area.append(visible[-1])
        owner[y0:y1, x0:x1][mask] = len(objects)
        background = image[y0:y1, x0:x1][mask].mean(0) if mask.any() else image.mean((0, 1))
        colour = _contrasting_colour(rng, background)
        cv2.fillPoly(image, [_fixed_point(polygon)], colour, cv2.LINE_AA, _SUBPIXEL_BITS)
        objects.append((class_id, polygon))
        boxes = np.concatenate([boxes, box[None]])
    return objects


def _contrasting_colour(rng: np.random.Generator, background_bgr: np.ndarray) -> tuple[float, float, float]:
    """Return the first of 20 random BGR colours at least _MIN_CONTRAST from `background_bgr`, else the farthest."""
    candidates = rng.uniform(0, 255, size=(20, 3))
    distances = np.linalg.norm(candidates - background_bgr, axis=1)
    good = np.flatnonzero(distances >= _MIN_CONTRAST)
    choice = good[0] if len(good) else int(distances.argmax())
    return tuple(float(v) for v in candidates[choice])
