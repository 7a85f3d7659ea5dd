"""LoadImagesAndLabels: the detection/segmentation dataset that composes index, cache and augmentations per item."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from utils.data.augment import (
    AugmentParams,
    Instances,
    instances_to_labels,
    letterbox,
    mixup,
    mosaic4,
    random_perspective,
    transform_instances,
)
from utils.data.cache import CACHE_MODES, ImageCache, rank_shard, read_image, resize_long_side
from utils.data.coco_labels import CocoSource, scan_coco_labels
from utils.data.colour import IDENTITY_GAINS, apply_hsv, draw_hsv_gains
from utils.data.copy_paste import copy_paste, is_box_outline
from utils.data.image_files import list_image_files
from utils.data.labels import ANY_CLASS_ID, LabelIndex
from utils.data.masks import polygons_to_masks, polygons_to_overlap_mask
from utils.data.scan import check_same_image_files, scan_labels
from utils.data.shm_cache import ShmImageCache, open_shm_cache
from utils.distributed import DistContext
from utils.errors import ConfigError

if TYPE_CHECKING:
    from utils.data.batch import ShapeInfo

LOGGER = logging.getLogger(__name__)
# Unreadable images in a row after which a training item gives up: the files are gone, not just a few of them.
MAX_UNREADABLE_IN_A_ROW = 16
# What load_image returns: (BGR image resized to long side img_size, (h0, w0) original, (h, w) resized).
LoadedImage = tuple[np.ndarray, tuple[int, int], tuple[int, int]]


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    """How to build and serve a dataset; `num_classes` is required, the rest has YOLOv5 defaults.

    `batch_size` is the per-rank batch, used only for rectangular batch shapes; `cache_mode`
    is "none", "auto", "ram", "shm" or "disk" (utils/data/cache.py, shm_cache.py); `seed` is the shared
    seed (shard split, augmentation streams);
    `workers` sizes the cache-fill thread pools (the label scan uses this rank's share of the CPUs,
    utils/data/scan.py). `close_mosaic_epoch`: from this
    epoch on (0-based, read from the item key) training items are single letterboxed images, no
    mosaic or mixup; None keeps mosaic throughout. With `with_masks` items carry
    polygons and masks at image size / `mask_ratio`, one per instance or, with `overlap_mask`,
    one index mask per image (docs/CONTRACTS.md, "Segmentation"). Items are (H, W, 3) uint8 RGB;
    with `hsv_on_device` training items stay BGR and carry their HSV gains (`hsv`) instead of having
    them applied: the training loop does both on the device (utils/data/colour.py; set on CUDA).
    `names_file` is the dataset YAML that declares the classes, named when labels use class ids
    >= `num_classes` (utils/data/scan_report.py: check_class_ids). `canvas_hw` letterboxes every evaluation
    image to that (h, w) (a file exported at one non-square size); `img_size` is then its long side.
    """

    img_size: int = 640
    batch_size: int = 16
    augment: bool = False
    aug: AugmentParams = field(default_factory=AugmentParams)
    rect: bool = False
    stride: int = 32
    pad: float = 0.0
    cache_mode: str = "none"
    single_cls: bool = False
    with_masks: bool = False
    mask_ratio: int = 4
    overlap_mask: bool = False
    num_classes: int
    seed: int = 0
    workers: int = 8
    close_mosaic_epoch: int | None = None
    hsv_on_device: bool = False
    names_file: Path | None = None
    canvas_hw: tuple[int, int] | None = None

    @classmethod
    def for_evaluation(cls, **settings: Any) -> DatasetOptions:
        """Options of a validation set: no augmentation or cache, rectangular batches padded by half a stride.

        `settings` are the other fields (img_size, batch_size, stride, num_classes, ...). Training's
        per-epoch validation and val.py both build their sets here, so the same batch size gives the
        same images and the same numbers.
        """
        fixed = {"augment": False, "aug": AugmentParams(), "rect": True, "pad": 0.5, "cache_mode": "none"}
        return cls(**{**settings, **fixed})


def rect_batch_shapes(
    shapes_wh: np.ndarray, batch_size: int, img_size: int, stride: int, pad: float
) -> tuple[np.ndarray, np.ndarray]:
    """Sort images by aspect ratio and give each batch the smallest stride-multiple (h, w) that holds it.

    Returns (order (N,) int64 indices sorted by h/w, batch_shapes (ceil(N / batch_size), 2)
    int64 (h, w)). Batches of wide images get short canvases and tall ones narrow canvases, as
    in YOLOv5 rectangular inference, so little padding is computed.
    """
    aspect = shapes_wh[:, 1] / shapes_wh[:, 0]  # h / w
    order = np.argsort(aspect, kind="stable")
    aspect = aspect[order]
    starts = np.arange(0, len(aspect), batch_size)
    lowest = aspect[starts]
    highest = aspect[np.minimum(starts + batch_size, len(aspect)) - 1]
    relative_hw = np.ones((len(starts), 2))
    relative_hw[highest < 1] = np.stack([highest, np.ones_like(highest)], 1)[highest < 1]
    relative_hw[lowest > 1] = np.stack([np.ones_like(lowest), 1 / lowest], 1)[lowest > 1]
    batch_shapes = np.ceil(relative_hw * img_size / stride + pad).astype(np.int64) * stride
    return order.astype(np.int64), batch_shapes


def _warn_if_copy_paste_idle(aug: AugmentParams, use_mosaic: bool, index: LabelIndex) -> None:
    """Warn once (rank 0) when copy_paste > 0 can never act: it runs inside mosaic and needs polygon labels."""
    if not use_mosaic or aug.mosaic == 0:
        message = "copy_paste %g has no effect: it is applied to mosaics, and mosaic is off (--rect or hyp mosaic 0)"
        LOGGER.warning(message, aug.copy_paste)
        return
    if _boxes_only(index):
        LOGGER.warning(
            "copy_paste %g has no effect: the training labels have no polygons (box-only labels cannot be copy-pasted)",
            aug.copy_paste,
        )


def _boxes_only(index: LabelIndex) -> bool:
    """Whether every label is a box (its 4 corners), none a polygon outline; False without labels."""
    lengths = np.diff(index.seg_offsets)
    if not len(lengths) or not (lengths == 4).all():
        return False
    return bool(is_box_outline(index.seg_points.reshape(-1, 4, 2)).all())


class LoadImagesAndLabels(Dataset):
    """The training/validation dataset: images and YOLO labels from `sources` as item dicts (docs/CONTRACTS.md).

    `sources` are folders, .txt image lists or image files (`list_image_files`). With `coco` the
    images and labels are instead those of a COCO instances JSON (utils/data/coco_labels.py: the
    JSON's images under its folder, bbox rows for detection, polygons with `with_masks`); the
    items are the same as from the same labels written as YOLO txt.

    Every rank must construct it (the label scan waits for the local main rank). Training
    (`augment`) uses `self.shard = rank_shard(...)`: the image cache holds only these items and
    mosaic/mixup partners are drawn only from them. With `--cache shm` every rank reads every
    image from the node's shared copy, so `self.shard` is every index (the sampler then deals out
    one permutation of the whole dataset), unless that cache fell back to "ram". Items are keyed
    by `index` or `(index, epoch)`; all randomness of an item comes from
    `np.random.default_rng([seed, rank, epoch, index])`, so augmentation repeats exactly for the
    same key, regardless of worker count, and differs between ranks and epochs.

    An image that cannot be read any more (deleted, a network file system error since the label
    scan) never ends a run: a training item uses another image of this rank's shard in its place,
    an evaluation item comes back with `image` None and the collate leaves it out. Either way the
    item's `unreadable` key lists the paths, which the loaders warn about and count.
    """

    def __init__(
        self,
        sources: str | Path | Sequence[str | Path],
        options: DatasetOptions,
        ctx: DistContext,
        coco: CocoSource | None = None,
    ) -> None:
        if options.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache mode '{options.cache_mode}' is not one of {', '.join(CACHE_MODES)}")
        if options.mask_ratio < 1:
            raise ValueError(f"mask ratio {options.mask_ratio} must be a positive integer")
        self.options = options
        self.ctx = ctx
        if coco is not None:
            index = scan_coco_labels(coco, options.with_masks, ctx)
        else:
            files = list_image_files(sources)
            # A train set (the augmented one) of background images only is refused; another split is warned of.
            # Under --single-cls every class id is 0, so ids past `names` are no reason to stop.
            num_classes = ANY_CLASS_ID if options.single_cls else options.num_classes
            index = scan_labels(files, num_classes, ctx, names_file=options.names_file, require_labels=options.augment)
        named = str(coco.annotations) if coco is not None else _sources_text(sources)
        if options.augment and len(index) < ctx.world_size:  # every rank scanned the same index: all stop here
            raise ConfigError(
                f"{named}: {len(index)} usable training image(s) for {ctx.world_size} processes; every rank "
                "needs at least one (use fewer processes or more images)"
            )
        self.batch_shapes: np.ndarray | None = None  # (num_batches, 2) (h, w) in rect mode
        if options.rect:
            order, batch_shapes = rect_batch_shapes(
                index.shapes, options.batch_size, options.img_size, options.stride, options.pad
            )
            index = index.reordered(order)
            # Evaluation walks the dataset in order, so its batches match these shapes. Training
            # batches come from a rank's shard, so each image gets its own minimal rectangle instead
            # and the collate pads the few mismatches.
            self.batch_shapes = None if options.augment else batch_shapes
        self.index: LabelIndex = index
        self.labels = index.labels.copy() if options.single_cls else index.labels  # (M, 5), packed
        if options.single_cls:
            self.labels[:, 0] = 0
        self.use_mosaic = options.augment and not options.rect  # rect batches need unmixed images
        if options.augment and options.aug.copy_paste > 0 and ctx.is_main:
            _warn_if_copy_paste_idle(options.aug, self.use_mosaic, index)
        if options.augment and options.with_masks and coco is None and ctx.is_main and _boxes_only(index):
            # A COCO JSON without segmentations is noted per annotation by its reader.
            LOGGER.warning(
                f"{named}: no training label has a polygon, so every mask is its box's "
                "rectangle; is --data a segmentation dataset?"
            )
        self.cache: ImageCache | ShmImageCache | None = None
        if options.cache_mode == "shm":  # every rank calls it; None on every rank means: fall back to "ram"
            self.cache = open_shm_cache(
                index.im_files, index.shapes, options.img_size, ctx, options.workers, augment=options.augment
            )
        # A training rank draws from its own shard, unless every rank can read every image from the node's copy.
        every_image = not options.augment or isinstance(self.cache, ShmImageCache)
        self.shard = np.arange(len(index)) if every_image else rank_shard(len(index), ctx, options.seed)
        if options.cache_mode != "none" and self.cache is None:
            self.cache = ImageCache(
                index.im_files,
                index.shapes,
                self.shard,
                options.img_size,
                "ram" if options.cache_mode == "shm" else options.cache_mode,
                ctx,
                options.workers,
                augment=options.augment,
            )

    def __len__(self) -> int:
        return len(self.index)

    def check_same_on_every_rank(self, what: str) -> None:
        """Raise a one-line ConfigError on every rank unless every rank built this dataset from the same files.

        Every rank must call it (one small all-gather). Compares the image count and a digest of
        the paths in dataset order; `what` names the set in the message ("train set").
        """
        check_same_image_files(self.im_files, what, self.ctx)

    @property
    def im_files(self) -> list[str]:
        """Image paths in dataset order (sorted by aspect ratio in rect mode)."""
        return self.index.im_files

    @property
    def shapes(self) -> np.ndarray:
        """(N, 2) int32 original (w, h) of every image, EXIF orientation applied."""
        return self.index.shapes

    @property
    def counts(self) -> dict[str, int]:
        """How many label files were found, missing (background), empty, and corrupt (image skipped)."""
        return dict(self.index.counts)

    def labels_of(self, index: int) -> np.ndarray:
        """Return item `index`'s labels (n, 5) [cls, cx, cy, w, h] normalised (single_cls applied; a view)."""
        return self.labels[self.index.label_offsets[index] : self.index.label_offsets[index + 1]]

    def class_counts(self) -> np.ndarray:
        """Return the number of instances per class, (num_classes,) int64 (1 entry with single_cls)."""
        num_classes = 1 if self.options.single_cls else self.options.num_classes
        return np.bincount(self.labels[:, 0].astype(np.int64), minlength=num_classes)

    def label_wh_at(self, img_size: int) -> np.ndarray:
        """Return every label's (w, h) in pixels with its image resized to long side `img_size`, (M, 2) float32.

        Used by the anchor check, which adds its own random scale jitter.
        """
        shapes = self.index.shapes.astype(np.float64)
        scaled_wh = img_size * shapes / shapes.max(axis=1, keepdims=True)
        per_label = np.repeat(scaled_wh, np.diff(self.index.label_offsets), axis=0)
        return (self.labels[:, 3:5] * per_label).astype(np.float32)

    def load_image(self, index: int) -> LoadedImage:
        """Return (BGR image resized to long side img_size (to fit canvas_hw when set), (h0, w0), (h, w) resized).

        Served from the cache when it holds the item: from the RAM or shm cache as a read-only
        view, not a copy (a mosaic reads four images and writes none of them; every path that
        changes pixels works on a new array); otherwise decoded from disk (`read_image`: EXIF
        orientation applied, any file name); a disk-cache file that vanished or broke since it
        was written is passed over for the image.
        Raises FileNotFoundError naming the file when it cannot be read.
        """
        width0, height0 = (int(v) for v in self.index.shapes[index])
        try:
            cached = self.cache.get(index) if self.cache is not None else None
        except (OSError, ValueError, EOFError):  # np.load of a deleted, truncated or foreign .npy
            cached = None
        if cached is not None:
            image = cached.view()
            image.flags.writeable = False  # a view of the shared buffer: a write would change the cache
            return image, (height0, width0), image.shape[:2]
        path = self.index.im_files[index]
        image = read_image(path)
        if image is None:
            raise FileNotFoundError(f"cannot read image {path} (deleted or corrupted since the label scan?)")
        height0, width0 = image.shape[:2]
        # Fitted to a fixed canvas at once: its letterbox then only pads, as detect.py's one resize does.
        fit = self.options.canvas_hw or self.options.img_size
        image = resize_long_side(image, fit, self.options.augment)
        return image, (height0, width0), image.shape[:2]

    def _instances(self, index: int, width: int, height: int) -> Instances:
        """Item `index`'s labels and polygons in pixels of an image of `width` x `height`."""
        points, counts = self.index.polygons_of(index)
        return Instances.from_labels(self.labels_of(index), points, counts, width, height)

    def _load_mosaic(
        self, index: int, rng: np.random.Generator, unreadable: list[str], mirror: tuple[bool, bool]
    ) -> tuple[np.ndarray, Instances, int]:
        """Mosaic of item `index` and 3 partners from this rank's shard, warped (and `mirror`ed) to img_size x img_size.

        Returns the canvas, its instances and the index of the image in its first quadrant (`index`
        unless that image was unreadable and replaced, see `_load_readable`).
        """
        size = self.options.img_size
        images, instances, used = [], [], []
        for i in [index, *rng.choice(self.shard, size=3).tolist()]:
            loaded, (image, _, (height, width)) = self._load_readable(i, rng, unreadable)
            images.append(image)
            instances.append(self._instances(loaded, width, height))
            used.append(loaded)
        image, inst = mosaic4(images, instances, size, rng)
        image, inst = copy_paste(image, inst, self.options.aug.copy_paste, rng)  # on the canvas, as YOLOv5
        return (*self._perspective(image, inst, rng, (-size // 2, -size // 2), mirror), used[0])

    def _load_readable(self, index: int, rng: np.random.Generator, unreadable: list[str]) -> tuple[int, LoadedImage]:
        """Load training item `index`'s image, or another image of this rank's shard when it cannot be read.

        Returns (index loaded, what `load_image` returned for it). The replacement is drawn
        from the item's own `rng`, so a run repeats exactly while the same files are missing; each
        unreadable path is appended to `unreadable` once. Raises FileNotFoundError after
        MAX_UNREADABLE_IN_A_ROW failures in a row (the dataset is gone, not a few files).
        """
        first_path = self.index.im_files[index]
        for _ in range(MAX_UNREADABLE_IN_A_ROW):
            try:
                return index, self.load_image(index)
            except FileNotFoundError:
                if self.index.im_files[index] not in unreadable:  # drawn again: still one file to report and count
                    unreadable.append(self.index.im_files[index])
                index = int(rng.choice(self.shard))
        raise FileNotFoundError(
            f"{MAX_UNREADABLE_IN_A_ROW} images in a row could not be read, starting at {first_path}; "
            "is the dataset folder still there?"
        )

    def _perspective(
        self,
        image: np.ndarray,
        inst: Instances,
        rng: np.random.Generator,
        border: tuple[int, int],
        mirror: tuple[bool, bool],
    ) -> tuple[np.ndarray, Instances]:
        """random_perspective with this dataset's augmentation strengths, the flips done by the same warp."""
        aug = self.options.aug
        return random_perspective(
            image, inst, rng, aug.degrees, aug.translate, aug.scale, aug.shear, aug.perspective, border, mirror
        )

    def _letterboxed(self, index: int, loaded: LoadedImage) -> tuple[np.ndarray, Instances, ShapeInfo]:
        """Item `index`'s image (`loaded`, as load_image returns it) letterboxed to its rect batch shape or img_size."""
        image, (height0, width0), (height, width) = loaded
        if self.options.canvas_hw is not None:
            target: int | tuple[int, int] = tuple(self.options.canvas_hw)
        elif self.batch_shapes is not None:
            target = tuple(int(v) for v in self.batch_shapes[index // self.options.batch_size])
        else:
            target = self.options.img_size
        # auto: a rect training image keeps its aspect ratio, padded only to the stride.
        is_rect_train = self.options.rect and self.batch_shapes is None
        image, (ratio_w, ratio_h), pad = letterbox(
            image, target, auto=is_rect_train, scaleup=self.options.augment, stride=self.options.stride
        )
        inst = transform_instances(self._instances(index, width, height), (ratio_w, ratio_h), pad)
        # Overall scale from the original pixels to the returned image: load resize x letterbox resize.
        shape: ShapeInfo = ((height0, width0), ((height / height0 * ratio_h, width / width0 * ratio_w), pad))
        return image, inst, shape

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        """Return the item for `key` = index or (index, epoch); see docs/CONTRACTS.md for the dict.

        An unreadable image is replaced (training) or marked for the collate to leave out
        (evaluation: `image` None); the item's `unreadable` then lists the paths.
        """
        index, epoch = (key, 0) if isinstance(key, int | np.integer) else key
        index = int(index) % len(self)
        if not self.options.augment:
            return self._evaluation_item(index)
        aug = self.options.aug
        rng = np.random.default_rng([self.options.seed, self.ctx.rank, int(epoch), index])
        unreadable: list[str] = []
        mosaic = self._mosaic_open(epoch) and rng.random() < aug.mosaic
        mirror = (bool(rng.random() < aug.fliplr), bool(rng.random() < aug.flipud))  # done inside the warp
        if mosaic:
            image, inst, index = self._load_mosaic(index, rng, unreadable, mirror)
            if rng.random() < aug.mixup:  # the partner is mirrored alike: the flips apply to the blend
                partner = self._load_mosaic(int(rng.choice(self.shard)), rng, unreadable, mirror)
                image, inst = mixup(image, inst, *partner[:2], rng)
            size = image.shape[0]
            shape: ShapeInfo = ((size, size), ((1.0, 1.0), (0.0, 0.0)))  # no original-image geometry
        else:
            index, loaded = self._load_readable(index, rng, unreadable)
            image, inst, shape = self._letterboxed(index, loaded)
            image, inst = self._perspective(image, inst, rng, (0, 0), mirror)
        gains = draw_hsv_gains(rng, aug.hsv_h, aug.hsv_s, aug.hsv_v)
        if not self.options.hsv_on_device:  # BGR -> RGB here; otherwise on the device with the jitter
            image = apply_hsv(image, gains, to_rgb=True) if gains is not None else _to_rgb(image)
        item = self._to_item(image, inst, self.index.im_files[index], shape)
        if self.options.hsv_on_device:
            item["hsv"] = torch.tensor(IDENTITY_GAINS if gains is None else gains, dtype=torch.float32)
        if unreadable:
            item["unreadable"] = unreadable
        return item

    def _evaluation_item(self, index: int) -> dict[str, Any]:
        """Item `index` letterboxed, not augmented; `image` None (and `unreadable`) when its file cannot be read."""
        path = self.index.im_files[index]
        try:
            loaded = self.load_image(index)
        except FileNotFoundError:  # deleted or failing since the label scan: skipped, so validation still finishes
            return {"image": None, "path": path, "unreadable": [path]}
        image, inst, shape = self._letterboxed(index, loaded)
        return self._to_item(_to_rgb(image), inst, path, shape)

    def _mosaic_open(self, epoch: int) -> bool:
        """Whether items of `epoch` may be mosaics (training, not rect, before `close_mosaic_epoch`)."""
        close = self.options.close_mosaic_epoch
        return self.use_mosaic and (close is None or epoch < close)

    def _to_item(self, image: np.ndarray, inst: Instances, path: str, shape: ShapeInfo) -> dict[str, Any]:
        """Pack an augmented (H, W, 3) image (RGB, or BGR with `hsv_on_device`) and its instances into an item."""
        height, width = image.shape[:2]
        labels = torch.zeros((len(inst), 6), dtype=torch.float32)
        labels[:, 1:] = torch.from_numpy(instances_to_labels(inst, width, height))
        # (H, W, 3) as augmented: the device makes it (3, H, W) float (`utils.data.batch.to_model_input`).
        pixels = torch.from_numpy(np.ascontiguousarray(image))
        item: dict[str, Any] = {"image": pixels, "labels": labels, "path": path, "shape": shape}
        if self.options.with_masks:
            if not self.options.augment:  # evaluation scores masks from the polygons; training never reads them
                scale = np.array([width, height], dtype=np.float32)
                item["segments"] = [(segment / scale).astype(np.float32) for segment in inst.segments]
            item["masks"] = torch.from_numpy(self._masks(inst.segments, height, width))
        return item

    def _masks(self, segments: list[np.ndarray], height: int, width: int) -> np.ndarray:
        """Rasterise the item's final pixel polygons at 1 / mask_ratio of the image.

        Per instance: uint8 (n, H // r, W // r), row i for labels row i; with overlap_mask: int16
        (1, H // r, W // r) holding i + 1 where instance i is (smaller instances win overlaps).
        """
        if self.options.overlap_mask:
            return polygons_to_overlap_mask(segments, height, width, self.options.mask_ratio)
        return polygons_to_masks(segments, height, width, self.options.mask_ratio)


def _to_rgb(image: np.ndarray) -> np.ndarray:
    """A new RGB copy of a BGR uint8 image (the input may be a read-only cache view)."""
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _sources_text(sources: str | Path | Sequence[str | Path]) -> str:
    """The dataset's sources as a message names them: 'a, b' for a list of folders or list files."""
    return ", ".join(map(str, [sources] if isinstance(sources, str | Path) else sources))
