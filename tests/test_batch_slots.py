"""Tests for utils/data/batch_slots.py: train batches built in reused worker buffers arrive intact."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest
import torch

from utils.data.augment import AugmentParams
from utils.data.batch import collate_batch
from utils.data.batch_slots import BatchSlots
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.loader import build_train_loader
from utils.distributed import DistContext

CTX = DistContext()
BATCH = 2  # 12 batches an epoch: more than the 2 workers x 3 slots, so slots are reused within one


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> LoadImagesAndLabels:
    root = tmp_path_factory.mktemp("slots")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    for i in range(24):
        noise = np.random.default_rng(i).integers(0, 256, (40 + i, 70 - i, 3), dtype=np.uint8)
        cv2.imwrite(str(root / "images" / f"{i}.png"), noise)
        (root / "labels" / f"{i}.txt").write_text(f"{i % 2} 0.5 0.5 0.4 0.3\n")
    options = DatasetOptions(img_size=64, num_classes=2, workers=1, augment=True, aug=AugmentParams(), batch_size=BATCH)
    return LoadImagesAndLabels(root / "images", options, CTX)


def _expected(dataset: LoadImagesAndLabels, paths: list[str], epoch: int) -> torch.Tensor:
    """The batch's images built in this process from the same keys (items are a function of index and epoch)."""
    index = {path: i for i, path in enumerate(dataset.im_files)}
    return collate_batch([dataset[(index[path], epoch)] for path in paths])["images"]


def test_batches_from_slots_equal_items_built_here_even_when_all_are_kept(
    dataset: LoadImagesAndLabels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    loader = build_train_loader(dataset, BATCH, 2, CTX, seed=0, epochs=2)  # nothing is built past epoch 1
    assert loader.slots is not None and loader.slots.slots_per_worker == 3
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = list(loader)  # every batch kept: more than the slots there are
        assert len(batches) == 12 and all("slot" not in batch for batch in batches)
        for batch in batches:
            assert torch.equal(batch["images"], _expected(dataset, batch["paths"], epoch))
    assert not loader.slots.busy.any()  # every slot given back
    assert sorted(loader.slots._mapped) == [0, 1]  # both workers' rings were used (and stay mapped)


def test_lent_batches_are_read_in_place_from_the_worker_ring_and_every_slot_comes_back(
    dataset: LoadImagesAndLabels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    loader = build_train_loader(dataset, BATCH, 2, CTX, seed=0)
    assert loader.slots is not None
    for epoch in range(2):  # 12 batches an epoch: every slot is lent and reused
        loader.set_epoch(epoch)
        for batch in loader.lent():
            lent = loader.slots._lent
            assert lent is not None and loader.slots.busy[lent] == 1 and "slot" not in batch
            ring = loader.slots._mapped[lent // loader.slots.slots_per_worker]
            assert batch["images"].untyped_storage().data_ptr() == ring.data_ptr()  # no copy was made
            assert torch.equal(batch["images"], _expected(dataset, batch["paths"], epoch))
        assert loader.slots._lent is None  # the last batch's slot came back
        assert int(loader.slots.busy.sum()) <= 2 * 2  # at most the batches built ahead (2 per worker) for the next
    loader.set_epoch(2)
    for _ in loader.lent():
        break  # an abandoned epoch still gives back the batch it had lent
    assert loader.slots._lent is None


def test_a_worker_with_no_free_slot_falls_back_to_a_new_buffer(
    dataset: LoadImagesAndLabels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    loader = build_train_loader(dataset, BATCH, 1, CTX, seed=0, epochs=1)  # the DataLoader's iteration: 1 epoch
    loader.set_epoch(0)
    raw = list(loader.loader)  # the DataLoader itself: nothing takes the batches, so no slot is given back
    assert [batch.get("slot") for batch in raw] == [0, 1, 2] + [None] * 9
    for batch in raw:
        assert torch.equal(batch["images"], _expected(dataset, batch["paths"], 0))


def test_take_copies_out_and_frees_and_stack_outside_a_worker_is_plain() -> None:
    slots = BatchSlots(num_workers=1, slots_per_worker=2, slot_shape=(2, 3, 4, 4))
    images = [torch.full((3, 4, 4), v, dtype=torch.uint8) for v in (1, 2)]
    stacked, slot = slots.stack(images)
    assert slot is None and torch.equal(stacked, torch.stack(images))  # not in a worker
    shared = torch.stack(images).share_memory_()
    slots.busy[1] = 1
    batch = slots.take({"images": shared, "slot": 1})
    assert "slot" not in batch and slots.busy[1] == 0
    assert batch["images"].untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()
    assert torch.equal(batch["images"], shared)
    assert slots.take({"images": shared}) == {"images": shared}  # a batch that had no slot passes through


def test_a_lent_slot_is_given_back_by_the_next_take_or_release() -> None:
    slots = BatchSlots(num_workers=1, slots_per_worker=3, slot_shape=(2, 3, 4, 4))
    shared = torch.arange(96, dtype=torch.uint8).view(2, 3, 4, 4).share_memory_()
    slots.busy[:] = 1
    batch = slots.take({"images": shared, "slot": 0}, lend=True)
    assert batch["images"] is shared and slots.busy.tolist() == [1, 1, 1]  # read in place, still busy
    slots.take({"images": shared, "slot": 1}, lend=True)
    assert slots.busy.tolist() == [0, 1, 1]  # the first batch's slot is free once the next is taken
    slots.take({"images": shared, "slot": 2})  # copied out: its own slot is free at once, the lent one too
    assert slots.busy.tolist() == [0, 0, 0]
    slots.busy[0] = 1
    slots.take({"images": shared, "slot": 0}, lend=True)
    slots.release()
    assert slots.busy.tolist() == [0, 0, 0] and slots._lent is None
