"""The dict batch: dataset items collated (padded when sizes differ), and its images as the model's input."""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np
import torch
from torch.utils.data import default_collate

from utils.data.batch_slots import BatchSlots
from utils.data.colour import hsv_jitter

# ((orig_h, orig_w), ((ratio_h, ratio_w), (pad_w, pad_h))): letterbox geometry, see docs/CONTRACTS.md.
ShapeInfo = tuple[tuple[int, int], tuple[tuple[float, float], tuple[float, float]]]


class _BatchRequired(TypedDict):
    images: torch.Tensor
    targets: torch.Tensor
    paths: list[str]
    shapes: list[ShapeInfo]


class Batch(_BatchRequired, total=False):
    """One collated batch as the engine, loss and evaluators read it (docs/CONTRACTS.md).

    images: (B, H, W, 3) uint8 RGB (BGR while it has `hsv_gains`), as augmented (`to_model_input`
    makes the model's input on the device); targets: (N, 6) float32 [batch_index, cls, cx, cy, w, h]
    normalised; paths/shapes: one entry per image. Optional: `segments`, per image the list of
    (k, 2) float32 normalised polygons; `masks`, the items' mask tensors concatenated on dim 0;
    `hsv_gains` (B, 3), HSV factors still to apply on the device, images still BGR
    (`DatasetOptions.hsv_on_device`).
    `unreadable` (always set by `collate_batch`): paths of images that could not be read while the
    batch was built, replaced by other images (training) or left out of it (evaluation).
    """

    segments: list[list[np.ndarray]]
    masks: torch.Tensor
    hsv_gains: torch.Tensor
    unreadable: list[str]
    slot: int


def collate_batch(items: list[dict[str, Any]], slots: BatchSlots | None = None) -> Batch:
    """Stack dataset items (dicts per docs/CONTRACTS.md) into one `Batch`.

    Writes each image's position in the batch into column 0 of its labels (on a copy, so a
    cached item is never modified). Images of different sizes (rectangular training) are padded
    at the right/bottom to the largest height and width with grey 114, their normalised labels
    and polygons rescaled to the padded size, and their masks padded with zeros at the mask
    resolution to the largest mask. Masks are concatenated, so per-instance masks (n_i, h, w)
    become (N, h, w) aligned with `targets` rows and overlap masks (1, h, w) become (B, h, w).
    Raises ValueError when only some items carry masks/segments.

    Items whose `image` is None (evaluation images that could not be read) are left out; their
    paths, and those of images a training item replaced, go to the batch's `unreadable`. When
    every item is left out the batch holds no image (`EvalLoader` drops such batches).
    With `slots` (train loader workers) the images go into one of the worker's reused buffers and
    the batch names it in `slot`, which `TrainLoader` removes when it hands the batch on.
    """
    if not items:
        raise ValueError("collate_batch: got an empty batch")
    unreadable = [str(path) for item in items for path in item.get("unreadable", ())]
    items = [item for item in items if item["image"] is not None]
    if not items:
        no_image = torch.zeros((0, 0, 0, 3), dtype=torch.uint8)
        return {"images": no_image, "targets": torch.zeros((0, 6)), "paths": [], "shapes": [], "unreadable": unreadable}
    paths = [str(item["path"]) for item in items]
    if len({tuple(item["image"].shape) for item in items}) > 1:
        image_hw = (max(i["image"].shape[0] for i in items), max(i["image"].shape[1] for i in items))
        mask_hw = (0, 0)  # mask sides are image sides // mask_ratio, so the largest masks fit the padded image
        if _carried_by(items, "masks"):
            mask_hw = (max(i["masks"].shape[1] for i in items), max(i["masks"].shape[2] for i in items))
        items = [_pad_item(item, image_hw, mask_hw) for item in items]
    targets = []
    for position, item in enumerate(items):
        labels = item["labels"]
        if labels.ndim != 2 or labels.shape[1] != 6:
            raise ValueError(f"collate_batch: {item['path']} labels have shape {tuple(labels.shape)}, expected (n, 6)")
        labels = labels.to(torch.float32, copy=True)
        labels[:, 0] = position
        targets.append(labels)
    images = [item["image"] for item in items]
    # Both stack straight into shared memory inside a worker, saving one copy per batch.
    images_batch, slot = slots.stack(images) if slots is not None else (default_collate(images), None)
    batch: Batch = {
        "images": images_batch,
        "targets": torch.cat(targets, 0),
        "paths": paths,
        "shapes": [item["shape"] for item in items],
        "unreadable": unreadable,
    }
    if _carried_by(items, "segments"):
        batch["segments"] = [list(item["segments"]) for item in items]
    if _carried_by(items, "masks"):
        batch["masks"] = torch.cat([item["masks"] for item in items], 0)
    if _carried_by(items, "hsv"):
        batch["hsv_gains"] = torch.stack([item["hsv"] for item in items])
    if slot is not None:
        batch["slot"] = slot
    return batch


def image_hw(images: torch.Tensor) -> tuple[int, int]:
    """(height, width) of a batch's `images` (B, H, W, 3)."""
    return int(images.shape[1]), int(images.shape[2])


def to_model_input(
    images: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32, bgr: bool = False
) -> torch.Tensor:
    """A batch's uint8 `images` (B, H, W, 3) as the model's input: RGB (B, 3, H, W) in [0, 1] on `device`.

    The uint8 pixels are copied (non-blocking: asynchronous from pinned memory on CUDA) and widened
    there, so loader workers never write float pixels; `bgr`: the batch is still in OpenCV's order
    (its colour work was left to the device, `Batch.hsv_gains`). The result has channels-last
    strides, the layout the model's convolutions run in by default (an NCHW model copies it).
    """
    pixels = images.to(device, non_blocking=True).permute(0, 3, 1, 2)
    return (pixels.flip(1) if bgr else pixels).to(dtype) / 255


def images_on_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The batch's images as the model's input on `device` (`to_model_input`), with its `hsv_gains` applied there.

    A batch with gains left its colour work to the device: it is still BGR and gets its jitter here.
    """
    if "hsv_gains" not in batch:
        return to_model_input(batch["images"], device, dtype)
    images = to_model_input(batch["images"], device, dtype, bgr=True)
    return hsv_jitter(images, batch["hsv_gains"].to(device, non_blocking=True))


def _pad_item(item: dict[str, Any], image_hw: tuple[int, int], mask_hw: tuple[int, int]) -> dict[str, Any]:
    """Return a copy of `item` padded right/bottom to `image_hw` (grey 114), labels and polygons rescaled.

    Its masks, if any, are padded with zeros (background) to `mask_hw`, their own resolution,
    so every mask pixel keeps its place relative to the image's top-left corner.
    """
    image = item["image"]
    height, width = image_hw
    own_height, own_width = image.shape[:2]
    if (own_height, own_width) == (height, width):
        return item
    padded = torch.full((height, width, image.shape[2]), 114, dtype=image.dtype)
    padded[:own_height, :own_width] = image
    labels = item["labels"].clone()
    labels[:, [2, 4]] *= own_width / width
    labels[:, [3, 5]] *= own_height / height
    out = {**item, "image": padded, "labels": labels}
    if "segments" in item:
        scale = np.array([own_width / width, own_height / height], dtype=np.float32)
        out["segments"] = [segment * scale for segment in item["segments"]]
    if "masks" in item:
        masks = item["masks"]
        out["masks"] = masks.new_zeros((masks.shape[0], *mask_hw))
        out["masks"][:, : masks.shape[1], : masks.shape[2]] = masks
    return out


def _carried_by(items: list[dict[str, Any]], key: str) -> bool:
    """Return whether the items carry `key`; raise ValueError when only some of them do."""
    count = sum(key in item for item in items)
    if 0 < count < len(items):
        raise ValueError(
            f"collate_batch: only {count} of {len(items)} items have '{key}' (batch at {items[0]['path']})"
        )
    return count == len(items)
