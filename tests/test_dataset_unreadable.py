"""Images that become unreadable after the label scan: replaced in training, left out of validation, never a crash."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from torch import nn

from utils.data.augment import AugmentParams
from utils.data.batch import collate_batch
from utils.data.cache import disk_cache_path
from utils.data.dataset import MAX_UNREADABLE_IN_A_ROW, DatasetOptions, LoadImagesAndLabels
from utils.data.loader import build_train_loader, build_val_loader
from utils.distributed import DistContext
from utils.eval.evaluate import EvalOptions
from utils.tasks import DETECT

RANK_1 = DistContext(rank=1, local_rank=1, world_size=2)  # a hand-built context: its shard is half the images
SIZES_WH = [(48, 32), (32, 48), (40, 40), (56, 24), (24, 56), (44, 36), (36, 44), (52, 28)] * 2
# No geometric change and no flips: a letterboxed training item keeps its image's labels exactly.
STILL = AugmentParams(mosaic=0.0, translate=0.0, scale=0.0, fliplr=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)


def _folder(root: Path) -> Path:
    """Images whose green channel encodes their index, each with one box of class index % 3 and its own size."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for i, (width, height) in enumerate(SIZES_WH):
        cv2.imwrite(str(root / "images" / f"{i:02d}.png"), np.full((height, width, 3), (200, 10 * i, 50), np.uint8))
        (root / "labels" / f"{i:02d}.txt").write_text(f"{i % 3} 0.5 0.5 {0.2 + i / 50:.3f} 0.4\n")
    return root / "images"


def _options(**changes: Any) -> DatasetOptions:
    base: dict[str, Any] = {"img_size": 64, "num_classes": 3, "workers": 2, "batch_size": 4}
    return DatasetOptions(**(base | changes))


def _record_successful_loads(dataset: LoadImagesAndLabels) -> list[int]:
    loaded: list[int] = []
    original = dataset.load_image

    def recording(index: int) -> Any:
        result = original(index)  # raises for an unreadable file: not recorded
        loaded.append(index)
        return result

    dataset.load_image = recording  # type: ignore[method-assign]
    return loaded


def test_letterboxed_training_item_uses_another_shard_image_with_its_labels(tmp_path: Path) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True, aug=STILL), RANK_1)
    victim = int(dataset.shard[2])
    victim_path = dataset.im_files[victim]
    Path(victim_path).unlink()
    loaded = _record_successful_loads(dataset)
    item = dataset[(victim, 0)]
    assert item["unreadable"] == [victim_path] and item["path"] != victim_path
    used = dataset.im_files.index(item["path"])
    assert used in set(dataset.shard.tolist()) and loaded == [used]
    # The labels are the replacement's own: same class and box (normalised to the letterboxed image).
    assert item["labels"][:, 1].tolist() == dataset.labels_of(used)[:, 0].tolist()
    again = dataset[(victim, 0)]  # the replacement comes from the item's own random stream: it repeats
    assert again["path"] == item["path"] and torch.equal(again["image"], item["image"])
    assert torch.equal(again["labels"], item["labels"]) and again["unreadable"] == item["unreadable"]
    assert "unreadable" not in dataset[(int(dataset.shard[0]), 0)]


@pytest.mark.parametrize("mixup", [0.0, 1.0])
def test_mosaic_partners_that_cannot_be_read_are_replaced_from_the_shard(tmp_path: Path, mixup: float) -> None:
    aug = AugmentParams(mosaic=1.0, mixup=mixup)
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True, aug=aug), RANK_1)
    shard = set(dataset.shard.tolist())
    victim = int(dataset.shard[0])
    Path(dataset.im_files[victim]).unlink()
    loaded = _record_successful_loads(dataset)
    hits = 0
    for epoch in range(3):
        for index in sorted(shard):
            item = dataset[(index, epoch)]
            hits += len(item.get("unreadable", []))
            assert set(item.get("unreadable", [])) <= {dataset.im_files[victim]}
            assert item["image"].shape == (64, 64, 3) and item["path"] != dataset.im_files[victim]
    assert hits >= 3  # at least the victim's own item every epoch
    assert victim not in loaded and set(loaded) <= shard
    assert len(loaded) == 3 * len(shard) * (8 if mixup else 4)  # every mosaic still has four images


def test_train_loader_warns_once_per_file_across_workers_and_counts_every_replacement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True), RANK_1)
    victims = [dataset.im_files[int(i)] for i in dataset.shard[:2]]
    for path in victims:
        Path(path).unlink()
    loader = build_train_loader(dataset, 2, 2, RANK_1, seed=0)  # two forked workers
    assert loader.num_workers == 2
    reported = 0
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            loader.set_epoch(epoch)
            reported += sum(len(batch["unreadable"]) for batch in loader)
    warnings = [record.getMessage() for record in caplog.records]
    for path in victims:
        assert sum(message.startswith(f"cannot read image {path} ") for message in warnings) == 1
    summaries = [message for message in warnings if "unreadable image(s) during training epoch" in message]
    assert len(summaries) == 2 and loader.unreadable.count == reported >= 2 * len(victims)
    assert loader.unreadable.files == set(victims)


def test_training_gives_up_only_when_the_images_are_gone(tmp_path: Path) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True), RANK_1)
    for path in dataset.im_files:
        Path(path).unlink()
    with pytest.raises(FileNotFoundError, match=f"{MAX_UNREADABLE_IN_A_ROW} images in a row could not be read"):
        dataset[(int(dataset.shard[0]), 0)]


def test_a_vanished_disk_cache_file_is_read_from_its_image(tmp_path: Path) -> None:
    dataset = LoadImagesAndLabels(_folder(tmp_path), _options(augment=True, cache_mode="disk"), DistContext())
    cached = dataset.load_image(0)[0]
    disk_cache_path(dataset.im_files[0], dataset.options.img_size, augment=True).unlink()
    np.testing.assert_array_equal(dataset.load_image(0)[0], cached)
    assert "unreadable" not in dataset[(0, 0)]


def test_collate_leaves_out_unreadable_evaluation_items() -> None:
    item = {"image": torch.zeros(8, 8, 3, dtype=torch.uint8), "labels": torch.zeros(0, 6), "path": "a", "shape": None}
    gone = {"image": None, "path": "b", "unreadable": ["b"]}
    batch = collate_batch([gone, item, {**gone, "path": "c", "unreadable": ["c"]}])
    assert batch["paths"] == ["a"] and batch["images"].shape == (1, 8, 8, 3) and batch["unreadable"] == ["b", "c"]
    empty = collate_batch([gone])
    assert empty["paths"] == [] and empty["images"].shape[0] == 0 and empty["unreadable"] == ["b"]
    assert collate_batch([item])["unreadable"] == []


class _OneBoxPerImage(nn.Module):
    """A 'model' whose eval output is one fixed decoded row per image (xywh pixels, obj, 3 class scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.row = nn.Parameter(torch.tensor([32.0, 32.0, 16.0, 16.0, 0.9, 0.8, 0.1, 0.1]), requires_grad=False)
        # What every model has and evaluation reads (utils/backends: module_info): strides, the head's mask count.
        self.stride = torch.tensor([8.0, 16.0, 32.0])
        self.head = SimpleNamespace(num_masks=0)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.row.expand(len(images), 1, -1), []


@pytest.mark.parametrize("with_masks", [False, True])
def test_validation_leaves_out_unreadable_images_and_whole_unreadable_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, with_masks: bool
) -> None:
    options = DatasetOptions.for_evaluation(img_size=64, batch_size=4, num_classes=3, with_masks=with_masks)
    dataset = LoadImagesAndLabels(_folder(tmp_path), options, DistContext())
    gone = [dataset.im_files[i] for i in (1, 4, 5, 6, 7)]  # one of batch 0 and all of batch 1
    for path in gone:
        Path(path).unlink()
    loader = build_val_loader(dataset, 4, 0, DistContext())
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
        result = DETECT.evaluate(_OneBoxPerImage(), loader, EvalOptions(num_classes=3), DistContext())
    assert [len(batch["paths"]) for batch in batches] == [3, 4, 4]  # batch 1 is not yielded at all
    assert not set(gone) & {path for batch in batches for path in batch["paths"]}
    if with_masks:
        assert all(len(batch["masks"]) == len(batch["targets"]) for batch in batches)
    assert result.num_images == len(dataset) - len(gone) and result.num_instances == len(dataset) - len(gone)
    warnings = [record.getMessage() for record in caplog.records]
    for path in gone:  # two passes (list, evaluate), still one warning per file
        assert sum(message.startswith(f"cannot read image {path} ") for message in warnings) == 1
    assert sum("5 unreadable image(s) during validation" in message for message in warnings) == 2
    assert loader.unreadable.count == 2 * len(gone)
