"""Tests for utils/data/dataset.py: items, letterbox geometry, rect batches, augmentation, shards, determinism, EXIF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.dist_helpers import run_distributed
from utils.data.augment import AugmentParams
from utils.data.cache import resized_hw
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels, rect_batch_shapes
from utils.distributed import DistContext
from utils.errors import ConfigError

CTX = DistContext()
SIZES_WH = [(80, 60), (60, 80), (100, 40), (50, 50), (40, 90), (90, 70), (70, 40), (64, 48)]
STRONG = AugmentParams(degrees=15, translate=0.2, scale=0.5, shear=5, perspective=0.0005, flipud=0.5, mixup=0.5)


def _folder(root: Path, sizes: list[tuple[int, int]] = SIZES_WH) -> Path:
    """Images with a background colour per index and one white rectangle labelled with class index % 3."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for i, (width, height) in enumerate(sizes):
        image = np.zeros((height, width, 3), np.uint8)
        image[:] = (200, 10 * i, 50)  # BGR: blue-ish, green encodes the index
        x1, y1, x2, y2 = width // 4, height // 4, width // 2, 3 * height // 4
        image[y1:y2, x1:x2] = 255
        cv2.imwrite(str(root / "images" / f"{i:02d}.png"), image)
        box = ((x1 + x2) / 2 / width, (y1 + y2) / 2 / height, (x2 - x1) / width, (y2 - y1) / height)
        (root / "labels" / f"{i:02d}.txt").write_text(f"{i % 3} " + " ".join(f"{v:.6f}" for v in box) + "\n")
    return root / "images"


def _options(**changes: Any) -> DatasetOptions:
    base: dict[str, Any] = {"img_size": 64, "num_classes": 3, "workers": 2, "batch_size": 4}
    return DatasetOptions(**(base | changes))


def test_eval_item_format_and_letterbox_geometry(tmp_path: Path) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(), CTX)
    assert len(dataset) == 8 and dataset.counts == {"found": 8, "missing": 0, "empty": 0, "corrupt": 0}
    for i in range(len(dataset)):
        item = dataset[i]
        image, labels = item["image"], item["labels"]
        assert image.dtype == torch.uint8 and image.shape == (64, 64, 3) and image.is_contiguous()
        assert labels.dtype == torch.float32 and labels.shape == (1, 6) and labels[0, 0] == 0
        assert item["path"] == dataset.im_files[i] and "segments" not in item
        cls, cx, cy, w, h = labels[0, 1:].tolist()
        assert cls == i % 3 and 0 <= cx - w / 2 and cx + w / 2 <= 1 and 0 <= cy - h / 2 and cy + h / 2 <= 1
        assert image[int(cy * 64), int(cx * 64)].tolist() == [255, 255, 255]  # the white box is under its label
        (height0, width0), ((ratio_h, ratio_w), (pad_w, pad_h)) = item["shape"]
        assert (width0, height0) == SIZES_WH[i]
        x1_original = (cx - w / 2) * 64 - pad_w
        assert x1_original / ratio_w == pytest.approx(width0 // 4, abs=0.6)  # maps back to original pixels
        corner_x, corner_y = int(pad_w) + 1, int(pad_h) + 1
        assert image[corner_y, corner_x].tolist() == [50, 0 if i == 0 else pytest.approx(10 * i, abs=2), 200]


def test_rect_batches_are_stride_multiples_that_fit(tmp_path: Path) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(rect=True, batch_size=3, stride=16), CTX)
    aspect = dataset.shapes[:, 1] / dataset.shapes[:, 0]
    assert np.all(np.diff(aspect) >= 0)  # sorted by h / w
    assert dataset.batch_shapes.shape == (3, 2) and np.all(dataset.batch_shapes % 16 == 0)
    assert dataset.batch_shapes.max() == 64
    for i in range(len(dataset)):
        item = dataset[i]
        assert tuple(item["image"].shape[:2]) == tuple(dataset.batch_shapes[i // 3])
        assert item["labels"][0, 1] == int(Path(item["path"]).stem) % 3  # labels followed the reordering
    order, shapes = rect_batch_shapes(np.array([[100, 50], [50, 100], [100, 100]]), 1, 64, 32, 0.0)
    assert order.tolist() == [0, 2, 1] and shapes.tolist() == [[32, 64], [64, 64], [64, 32]]


def test_rect_training_keeps_aspect_and_batches_collate(tmp_path: Path) -> None:
    from utils.data.batch import collate_batch

    options = _options(img_size=128, augment=True, rect=True, stride=32, aug=AugmentParams(translate=0, scale=0))
    dataset = LoadImagesAndLabels(_folder(tmp_path), options, CTX)
    assert dataset.batch_shapes is None  # training batches come from a shard: per-image rectangles
    items = [dataset[(i, 0)] for i in range(len(dataset))]
    for item in items:
        height, width = item["image"].shape[:2]
        height0, width0 = item["shape"][0]
        ratio = 128 / max(height0, width0)
        # Each image keeps its aspect ratio: long side 128, short side padded only up to the stride.
        assert (height, width) == tuple(int(np.ceil(round(v * ratio) / 32) * 32) for v in (height0, width0))
    batch = collate_batch(items[:4])
    assert batch["images"].shape[0] == 4
    boxes = batch["targets"][:, 2:]
    assert torch.all((boxes >= 0) & (boxes <= 1))


def test_training_items_keep_labels_and_masks_valid(tmp_path: Path) -> None:
    options = _options(augment=True, aug=STRONG, with_masks=True, mask_ratio=1)
    dataset = LoadImagesAndLabels(_folder(tmp_path), options, CTX)
    total = 0
    for key in [(i, epoch) for i in range(8) for epoch in range(4)]:
        item = dataset[key]
        labels, masks = item["labels"].numpy(), item["masks"].numpy()
        assert "segments" not in item  # training reads masks only: no Python object per polygon in a batch
        assert item["image"].shape == (64, 64, 3) and masks.shape == (len(labels), 64, 64)
        cx, cy, w, h = labels[:, 2:].T
        assert np.all((w > 0) & (h > 0))
        assert np.all(
            (cx - w / 2 >= -1e-5) & (cx + w / 2 <= 1 + 1e-5) & (cy - h / 2 >= -1e-5) & (cy + h / 2 <= 1 + 1e-5)
        )
        for row, mask in zip(labels, masks, strict=True):  # each mask fills its box (the box is its polygon's bounds)
            rows, cols = np.nonzero(mask)
            box = np.concatenate([row[2:4] - row[4:6] / 2, row[2:4] + row[4:6] / 2]) * 64
            if not len(rows):
                continue
            mask_box = np.array([cols.min(), rows.min(), cols.max() + 1, rows.max() + 1])
            assert (mask_box[:2] >= box[:2] - 0.5).all() and (mask_box[2:] <= box[2:] + 0.5).all()  # inside its box
            # Tight too, unless the image border cut the warped rectangle into a wedge whose tip covers no pixel centre.
            if (box[2:] - box[:2]).min() >= 2 and (box[:2] > 0).all() and (box[2:] < 64).all():
                np.testing.assert_allclose(mask_box, box, atol=1.0)
        total += len(labels)
    assert total > 32  # mosaics carry several objects


def _record_loads(dataset: LoadImagesAndLabels) -> list[int]:
    """Wrap `dataset.load_image` so every index it loads is appended to the returned list."""
    loaded: list[int] = []
    original = dataset.load_image

    def recording(index: int) -> Any:
        loaded.append(index)
        return original(index)

    dataset.load_image = recording  # type: ignore[method-assign]
    return loaded


def test_mosaic_partners_only_come_from_this_ranks_shard(tmp_path: Path) -> None:
    ctx = DistContext(rank=1, local_rank=1, world_size=2)
    aug = AugmentParams(mosaic=1.0, mixup=1.0)
    dataset = LoadImagesAndLabels(_folder(tmp_path, SIZES_WH * 3), _options(augment=True, aug=aug), ctx)
    shard = set(dataset.shard.tolist())
    assert len(shard) == 12
    loaded = _record_loads(dataset)
    for epoch in range(3):
        for index in sorted(shard):
            dataset[(index, epoch)]
    assert len(loaded) == 3 * 12 * 8  # two mosaics of four images each
    assert set(loaded) <= shard and len(set(loaded)) > 6


def test_items_repeat_per_key_and_vary_with_epoch_and_rank(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    dataset = LoadImagesAndLabels(folder, _options(augment=True, aug=STRONG), CTX)
    first, again = dataset[(3, 2)], dataset[(3, 2)]
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["labels"], again["labels"])
    assert not torch.equal(first["image"], dataset[(3, 5)]["image"])
    assert torch.equal(dataset[3]["image"], dataset[(3, 0)]["image"])
    # Without mosaic the shard plays no part, so only the rank in the seed can tell the two ranks apart.
    no_mosaic = _options(augment=True, aug=AugmentParams(mosaic=0.0, degrees=10))
    rank0 = LoadImagesAndLabels(folder, no_mosaic, DistContext(rank=0, world_size=2))
    rank1 = LoadImagesAndLabels(folder, no_mosaic, DistContext(rank=1, world_size=2))
    assert not torch.equal(rank0[(3, 2)]["image"], rank1[(3, 2)]["image"])
    keys = [(i, 1) for i in range(8)]
    serial = list(DataLoader(dataset, batch_size=None, sampler=keys, num_workers=0))
    parallel = list(DataLoader(dataset, batch_size=None, sampler=keys, num_workers=2))
    for a, b in zip(serial, parallel, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["labels"], b["labels"])


def test_close_mosaic_epoch_turns_mosaic_and_mixup_off_from_that_epoch(tmp_path: Path) -> None:
    aug = AugmentParams(mosaic=1.0, mixup=1.0)
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True, aug=aug, close_mosaic_epoch=2), CTX)
    loaded = _record_loads(dataset)
    for epoch, images_per_item, mosaic in ((0, 8, True), (1, 8, True), (2, 1, False), (5, 1, False)):
        loaded.clear()
        item = dataset[(3, epoch)]
        assert len(loaded) == images_per_item  # two 4-image mosaics (mixup), then the image alone
        (original_hw, _) = item["shape"]
        assert (original_hw == (64, 64)) is mosaic  # a mosaic has no original geometry; image 3 is 50 x 50
    # The same items as a dataset without the option until the closing epoch.
    plain = LoadImagesAndLabels(_folder(tmp_path / "plain"), _options(augment=True, aug=aug), CTX)
    assert torch.equal(plain[(3, 1)]["image"], dataset[(3, 1)]["image"])


def test_training_shrinks_images_with_linear_and_evaluation_with_area(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    path = folder / "00.png"
    raw = np.random.default_rng(0).integers(0, 256, cv2.imread(str(path)).shape, np.uint8)  # edges everywhere
    cv2.imwrite(str(path), raw)
    height, width = resized_hw(*raw.shape[:2], 64)
    assert max(raw.shape[:2]) > 64
    linear = cv2.resize(raw, (width, height), interpolation=cv2.INTER_LINEAR)
    area = cv2.resize(raw, (width, height), interpolation=cv2.INTER_AREA)
    assert not np.array_equal(linear, area)
    for cache_mode in ("none", "ram"):
        train = LoadImagesAndLabels(folder, _options(augment=True, cache_mode=cache_mode), CTX)
        evaluation = LoadImagesAndLabels(folder, _options(augment=False, cache_mode=cache_mode), CTX)
        np.testing.assert_array_equal(train.load_image(0)[0], linear)
        np.testing.assert_array_equal(evaluation.load_image(0)[0], area)


def test_ram_cache_holds_the_shard_and_serves_the_same_pixels(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    ctx = DistContext(rank=1, local_rank=1, world_size=2, local_world_size=2)
    cached = LoadImagesAndLabels(folder, _options(augment=True, cache_mode="ram"), ctx)
    plain = LoadImagesAndLabels(folder, _options(augment=True), ctx)
    assert cached.cache is not None and cached.cache.indices.tolist() == cached.shard.tolist()
    assert len(cached.cache) == 4 and plain.cache is None
    for index in range(8):
        a, b = cached.load_image(index), plain.load_image(index)
        assert a[1:] == b[1:] and np.array_equal(a[0], b[0])
    a, b = cached[(int(cached.shard[0]), 4)], plain[(int(cached.shard[0]), 4)]
    assert torch.equal(a["image"], b["image"])
    item_image = cached.load_image(int(cached.shard[0]))[0]
    with pytest.raises(ValueError, match="read-only"):  # a view of the cache, not a copy: not writable
        item_image[:] = 0
    assert cached.cache.get(int(cached.shard[0])).max() > 0


def test_exif_orientation_is_honoured(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = 255  # left half white as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # viewers rotate 90 degrees clockwise: the left half ends up on top
    Image.fromarray(stored).save(tmp_path / "images" / "a.jpg", exif=exif.tobytes(), quality=100)
    dataset = LoadImagesAndLabels(tmp_path / "images", _options(img_size=40), CTX)
    assert dataset.shapes.tolist() == [[20, 40]]
    image, original_hw, resized_hw = dataset.load_image(0)
    assert original_hw == (40, 20) and resized_hw == (40, 20)
    assert image[:18].mean() > 240 and image[22:].mean() < 15


def test_a_png_exif_orientation_after_the_pixel_data_is_honoured(tmp_path: Path) -> None:
    # The PNG spec puts eXIf before the pixel data, but OpenCV also applies one written after it; the scan's
    # size (rect shapes, caches) must then be the turned one too.
    import io
    import struct
    import zlib

    (tmp_path / "images").mkdir()
    encoded = io.BytesIO()
    Image.fromarray(np.zeros((20, 40, 3), np.uint8)).save(encoded, "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    raw = exif.tobytes().removeprefix(b"Exif\x00\x00")
    chunk = struct.pack(">I", len(raw)) + b"eXIf" + raw + struct.pack(">I", zlib.crc32(b"eXIf" + raw))
    data = encoded.getvalue()
    end = data.rfind(b"IEND") - 4
    (tmp_path / "images" / "a.png").write_bytes(data[:end] + chunk + data[end:])
    dataset = LoadImagesAndLabels(tmp_path / "images", _options(img_size=40), CTX)
    assert dataset.shapes.tolist() == [[20, 40]]
    assert dataset.load_image(0)[1] == (40, 20)


def test_single_cls_class_counts_and_label_sizes(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    dataset = LoadImagesAndLabels(folder, _options(), CTX)
    assert dataset.class_counts().tolist() == [3, 3, 2]
    wh = dataset.label_wh_at(64)
    assert wh.shape == (8, 2) and wh.dtype == np.float32
    np.testing.assert_allclose(wh[0], [64 / 4, 48 / 2], atol=0.01)  # 80x60 image, box 20x30 px at scale 0.8
    single = LoadImagesAndLabels(folder, _options(single_cls=True), CTX)
    assert single.class_counts().tolist() == [8]
    assert all(single[i]["labels"][:, 1].eq(0).all() for i in range(8))
    assert single.index.labels[:, 0].tolist() == [i % 3 for i in range(8)]  # the packed index is left intact
    # Class ids past `names` stop a run (the YAML is short), but not a --single-cls one: all are class 0 there.
    label = sorted((tmp_path / "labels").rglob("*.txt"))[0]
    label.write_text(label.read_text() + "7 0.5 0.5 0.2 0.2\n")
    with pytest.raises(ConfigError, match="declares 3 classes"):
        LoadImagesAndLabels(folder, _options(), CTX)
    single = LoadImagesAndLabels(folder, _options(single_cls=True), CTX)
    assert single.class_counts().tolist() == [9] and single.counts["corrupt"] == 0
    with pytest.raises(ValueError, match="cache mode 'gpu'"):
        LoadImagesAndLabels(folder, _options(cache_mode="gpu"), CTX)


def _build_on_rank(ctx: DistContext, folder: str) -> dict[str, Any]:
    dataset = LoadImagesAndLabels(folder, _options(augment=True, cache_mode="ram", seed=3), ctx)
    return {
        "files": dataset.im_files,
        "shard": dataset.shard.tolist(),
        "cached": dataset.cache.indices.tolist() if dataset.cache else None,
        "cached_bytes": dataset.cache.nbytes if dataset.cache else None,
        "shard_bytes": sum(3 * int(np.prod(resized_hw(int(h), int(w), 64))) for w, h in dataset.shapes[dataset.shard]),
        "counts": dataset.counts,
        "labels": dataset.index.labels.tolist(),
    }


@pytest.mark.distributed
def test_two_gloo_ranks_share_the_label_cache_and_split_the_images(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", SIZES_WH * 2)
    rank0, rank1 = run_distributed(_build_on_rank, 2, tmp_path / "dist", str(folder))
    assert (tmp_path / "data" / "labels.cache").is_file()
    assert rank0["files"] == rank1["files"] and rank0["labels"] == rank1["labels"]
    assert rank0["counts"] == rank1["counts"] == {"found": 16, "missing": 0, "empty": 0, "corrupt": 0}
    assert sorted(rank0["shard"] + rank1["shard"]) == list(range(16)) and len(rank0["shard"]) == 8
    assert rank0["cached"] == rank0["shard"] and rank1["cached"] == rank1["shard"]
    # Each rank holds exactly its shard's resized pixels, nothing of the other rank's.
    assert rank0["cached_bytes"] == rank0["shard_bytes"] and rank1["cached_bytes"] == rank1["shard_bytes"]
