"""Tests for utils/data/loader.py, batch.py and workers.py: collate, epoch keys, equal rank batches, seeding."""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import captured, check_parts, run_distributed
from utils.data.batch import collate_batch
from utils.data.loader import build_train_loader, build_val_loader
from utils.data.sampler import SmartDistributedSampler
from utils.data.workers import WORKER_NICENESS, resolve_num_workers, seed_worker
from utils.distributed import DistContext

IMAGE_HW = (8, 12)


class FakeDataset:
    """Contract-shaped dataset: item i has i % 3 labels; records the keys it receives.

    Worker processes cannot append to the parent's `keys`, so the path also encodes
    `pid|index|epoch|draw`, where `draw` is a number from the worker's NumPy global stream.
    """

    def __init__(self, num_items: int, ctx: DistContext, seed: int = 0) -> None:
        self.num_items = num_items
        permutation = np.random.default_rng(seed).permutation(num_items)  # stand-in for rank_shard
        self.shard = permutation[ctx.rank :: ctx.world_size]
        self.keys: list[int | tuple[int, int]] = []

    def __len__(self) -> int:
        return self.num_items

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, object]:
        self.keys.append(key)
        index, epoch = key if isinstance(key, tuple) else (key, -1)
        num_labels = index % 3
        labels = torch.zeros(num_labels, 6)
        labels[:, 1] = float(index)  # class = index, to trace rows back to items
        labels[:, 2:] = 0.5
        return {
            "image": torch.full((*IMAGE_HW, 3), index % 256, dtype=torch.uint8),
            "labels": labels,
            "path": f"{os.getpid()}|{index}|{epoch}|{np.random.randint(2**31)}",
            "shape": ((16, 24), ((0.5, 0.5), (0.0, 0.0))),
        }


def parse_paths(paths: list[str]) -> list[tuple[int, int, int, int]]:
    return [tuple(int(part) for part in path.split("|")) for path in paths]  # type: ignore[misc]


def test_collate_sets_batch_index_and_shapes() -> None:
    dataset = FakeDataset(6, DistContext())
    items = [dataset[i] for i in (2, 3, 4, 5)]  # 2, 0, 1, 2 labels
    original = items[0]["labels"].clone()
    batch = collate_batch(items)
    assert batch["images"].shape == (4, *IMAGE_HW, 3) and batch["images"].dtype == torch.uint8
    assert batch["images"][1, 0, 0, 0] == 3
    assert batch["targets"].shape == (5, 6) and batch["targets"].dtype == torch.float32
    assert batch["targets"][:, 0].tolist() == [0, 0, 2, 3, 3]
    assert batch["targets"][:, 1].tolist() == [2, 2, 4, 5, 5]
    assert torch.equal(items[0]["labels"], original)  # the item's own labels are not written into
    assert len(batch["paths"]) == 4 and batch["shapes"][0] == ((16, 24), ((0.5, 0.5), (0.0, 0.0)))
    assert "masks" not in batch and "segments" not in batch


def test_collate_concatenates_masks_and_lists_segments() -> None:
    dataset = FakeDataset(3, DistContext())
    items = [dataset[i] for i in range(3)]  # 0, 1, 2 instances
    for i, item in enumerate(items):
        item["masks"] = torch.full((i, 4, 6), i, dtype=torch.uint8)
        item["segments"] = [np.full((3, 2), 0.1 * i, dtype=np.float32) for _ in range(i)]
    batch = collate_batch(items)
    assert batch["masks"].shape == (3, 4, 6)
    assert batch["masks"][:, 0, 0].tolist() == [1, 2, 2]  # aligned with targets rows
    assert batch["targets"][:, 0].tolist() == [1, 2, 2]
    assert [len(segments) for segments in batch["segments"]] == [0, 1, 2]


def test_collate_rejects_mixed_masks() -> None:
    dataset = FakeDataset(2, DistContext())
    items = [dataset[0], dataset[1]]
    items[0]["masks"] = torch.zeros(0, 4, 6)
    with pytest.raises(ValueError, match="only 1 of 2 items have 'masks'"):
        collate_batch(items)


def test_collate_pads_mixed_sizes_and_rescales_labels() -> None:
    dataset = FakeDataset(3, DistContext())
    items = [dataset[1], dataset[2]]  # 1 and 2 labels, all centred at 0.5 with size 0.5
    items[1]["image"] = torch.full((4, 6, 3), 7, dtype=torch.uint8)  # half the height and width of (8, 12)
    batch = collate_batch(items)
    assert batch["images"].shape == (2, *IMAGE_HW, 3)
    assert torch.all(batch["images"][1, :4, :6] == 7) and torch.all(batch["images"][1, 4:] == 114)
    assert torch.all(batch["images"][1, :, 6:] == 114)
    big, small = batch["targets"][0], batch["targets"][1]
    assert big[2:].tolist() == [0.5, 0.5, 0.5, 0.5]  # the largest image is not touched
    # The small image's box sits in its top-left 4 x 6 pixels: centre (3, 2) px of the (12, 8) canvas.
    assert small[2:].tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25])


@pytest.mark.parametrize("num_items", [10, 11, 13])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("per_rank_batch", [2, 4])
def test_every_rank_same_number_of_batches(num_items: int, world_size: int, per_rank_batch: int) -> None:
    counts, seen = [], set()
    for rank in range(world_size):
        ctx = DistContext(rank=rank, world_size=world_size)
        dataset = FakeDataset(num_items, ctx)
        loader = build_train_loader(dataset, per_rank_batch, 0, ctx, seed=1)
        batches = list(loader)
        assert len(batches) == len(loader) == math.ceil(math.ceil(num_items / world_size) / per_rank_batch)
        indices = [index for batch in batches for _, index, _, _ in parse_paths(batch["paths"])]
        assert set(indices) == set(dataset.shard.tolist())  # only this rank's shard
        counts.append(len(batches))
        seen |= set(indices)
    assert len(set(counts)) == 1
    assert seen == set(range(num_items))


def test_keys_carry_epoch_and_order_changes_per_epoch() -> None:
    ctx = DistContext(rank=1, world_size=2)
    dataset = FakeDataset(13, ctx)
    loader = build_train_loader(dataset, 4, 0, ctx, seed=5)
    orders = {}
    for epoch in (3, 4):
        dataset.keys.clear()
        loader.set_epoch(epoch)
        list(loader)
        assert all(isinstance(key, tuple) and key[1] == epoch for key in dataset.keys)
        assert len(dataset.keys) == 7
        orders[epoch] = [index for index, _ in dataset.keys]
    assert orders[3] != orders[4]
    loader.set_epoch(3)
    dataset.keys.clear()
    list(loader)
    assert [index for index, _ in dataset.keys] == orders[3]


def test_persistent_workers_keep_pids_and_get_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    loader = build_train_loader(FakeDataset(12, ctx), 2, 2, ctx, seed=0)
    assert loader.num_workers == 2
    pids_per_epoch = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        records = [record for batch in loader for record in parse_paths(batch["paths"])]
        assert sorted(index for _, index, _, _ in records) == list(range(12))
        assert {key_epoch for _, _, key_epoch, _ in records} == {epoch}
        pids_per_epoch.append({pid for pid, _, _, _ in records})
    assert len(pids_per_epoch[0]) == 2 and os.getpid() not in pids_per_epoch[0]
    assert pids_per_epoch[0] == pids_per_epoch[1]  # same worker processes, not re-forked


def test_workers_draw_different_random_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    loader = build_train_loader(FakeDataset(8, ctx), 2, 2, ctx, seed=0)
    draws: dict[int, list[int]] = {}
    for batch in loader:
        for pid, _, _, draw in parse_paths(batch["paths"]):
            draws.setdefault(pid, []).append(draw)
    assert len(draws) == 2
    first, second = draws.values()
    assert first != second


class UnpicklableDataset(FakeDataset):
    """FakeDataset a worker gets only by fork (pickling it, a copy per worker, fails); path: the builder's parent."""

    def __reduce__(self) -> Any:
        raise TypeError("the dataset was pickled for a worker")

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, object]:
        return {**super().__getitem__(key), "path": str(os.getppid())}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loader workers are forked on Linux only")
def test_workers_are_forked_and_share_the_dataset_whatever_the_default_start_method(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.14's default 'forkserver' would pickle the dataset, RAM image cache included, into every worker."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    default = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        train = build_train_loader(UnpicklableDataset(4, ctx), 2, 2, ctx, seed=0)
        val = build_val_loader(UnpicklableDataset(4, ctx), 2, 2, ctx)
        parents = {path for loader in (train, val) for batch in loader for path in batch["paths"]}
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert parents == {str(os.getpid())}  # each worker is a child of this process, not of a fork server


class TimedDataset(FakeDataset):
    """FakeDataset whose path starts with when the item was built (`time.monotonic_ns()`: one clock, all processes).

    Each item built also leaves a file `<epoch>-<index>` in `built_dir`, so a test can see that the
    workers built a batch without asking the loader for it.
    """

    def __init__(self, num_items: int, ctx: DistContext, built_dir: Path) -> None:
        super().__init__(num_items, ctx)
        self.built_dir = built_dir

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, object]:
        item = super().__getitem__(key)
        _, index, epoch, _ = parse_paths([item["path"]])[0]  # type: ignore[list-item]
        timed = {**item, "path": f"{time.monotonic_ns()}|{index}|{epoch}|0"}
        (self.built_dir / f"{epoch}-{index}").touch()
        return timed


def wait_until_built(dataset: TimedDataset, epoch: int, indices: list[int]) -> None:
    """Return once the workers have built items `indices` of `epoch`, unasked; fail if they do not within 120 s.

    Stands for the rest of a run's set-up (or an epoch's end) during which they should: waiting for the
    evidence rather than sleeping a second keeps the test right however slowly a loaded machine starts them.
    """
    deadline = time.monotonic() + 120
    while not all((dataset.built_dir / f"{epoch}-{index}").exists() for index in indices):
        assert time.monotonic() < deadline, f"no worker built epoch {epoch}'s items {indices} before being asked"
        time.sleep(0.01)


def test_start_has_the_workers_build_the_first_batch_before_it_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Set-up starts the workers (`TrainLoader.start`): their start and first batches overlap the rest of it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    dataset = TimedDataset(8, ctx, tmp_path)
    loader = build_train_loader(dataset, 2, 2, ctx, seed=0, epochs=3)
    loader.start(2, start_batch=1)  # as a run resumed at epoch 3, batch 2 does
    expected = loader.sampler.indices_of(2).tolist()[2:]
    wait_until_built(dataset, 2, expected[:2])  # the rest of the set-up: optimizer, EMA, callbacks
    began = time.monotonic_ns()
    loader.set_epoch(2, start_batch=1)  # what the first epoch asks for: the iteration started goes on
    batches = list(loader)
    assert max(built for built, _, _, _ in parse_paths(batches[0]["paths"])) < began  # that batch, not a new one
    order = [index for batch in batches for _, index, _, _ in parse_paths(batch["paths"])]
    assert order == expected


def test_workers_build_the_next_epochs_first_batch_before_that_epoch_begins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The pipeline runs across the epoch boundary: epoch 1 does not start by waiting for its first batch."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    dataset = TimedDataset(8, ctx, tmp_path)
    loader = build_train_loader(dataset, 2, 2, ctx, seed=0, epochs=2)
    loader.set_epoch(0)
    list(loader)
    expected = loader.sampler.indices_of(1).tolist()
    wait_until_built(dataset, 1, expected[:2])  # the end of an epoch: validation and checkpoints
    began = time.monotonic_ns()
    loader.set_epoch(1)
    batches = list(loader)
    first = parse_paths(batches[0]["paths"])
    assert max(built for built, _, _, _ in first) < began  # built during epoch 0's end, not after
    assert {epoch for batch in batches for _, _, epoch, _ in parse_paths(batch["paths"])} == {1}
    order = [index for batch in batches for _, index, _, _ in parse_paths(batch["paths"])]
    assert order == expected  # exactly the epoch set_epoch(1) alone gives


class NicenessDataset(FakeDataset):
    """FakeDataset whose `path` is the nice value of the process that built the item."""

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, object]:
        return {**super().__getitem__(key), "path": str(os.nice(0))}


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no process priorities on this OS")
def test_workers_run_at_lower_cpu_priority_than_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    expected = {str(min(os.nice(0) + WORKER_NICENESS, 19))}  # the kernel caps nice values at 19
    assert WORKER_NICENESS > 0 and (os.nice(0) == 19 or expected != {str(os.nice(0))})
    train = build_train_loader(NicenessDataset(4, ctx), 2, 2, ctx, seed=0)
    assert {path for batch in train for path in batch["paths"]} == expected
    val = build_val_loader(NicenessDataset(4, ctx), 2, 2, ctx)
    assert {path for batch in val for path in batch["paths"]} == expected
    assert NicenessDataset(1, ctx)[0]["path"] == str(os.nice(0))  # this process keeps its priority


class OpenCVThreadsDataset(FakeDataset):
    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, object]:
        return {**super().__getitem__(key), "path": str(cv2.getNumThreads())}


def test_workers_run_opencv_in_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallelism comes from the workers; OpenCV's pool inside each would only oversubscribe the cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    ctx = DistContext()
    threads = cv2.getNumThreads()
    try:
        cv2.setNumThreads(4)  # as on a machine with 4 cores, whatever this one has
        train = build_train_loader(OpenCVThreadsDataset(4, ctx), 2, 2, ctx, seed=0)
        assert {path for batch in train for path in batch["paths"]} == {"1"}
        assert cv2.getNumThreads() == 4  # the training process keeps its pool
    finally:
        cv2.setNumThreads(threads)


def _draws_after_seeding(worker_id: int, seed: int, rank: int) -> tuple[float, int, float]:
    seed_worker(worker_id, seed=seed, rank=rank)
    return random.random(), int(np.random.randint(2**31)), float(torch.rand(()))


def test_seed_worker_differs_across_workers_and_ranks_and_repeats() -> None:
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        grid = {(rank, worker): _draws_after_seeding(worker, 7, rank) for rank in range(3) for worker in range(3)}
        for position in range(3):  # python, numpy and torch streams each differ everywhere
            assert len({draws[position] for draws in grid.values()}) == 9
        assert _draws_after_seeding(1, 7, 2) == grid[(2, 1)]
        assert _draws_after_seeding(1, 8, 2) != grid[(2, 1)]
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


def test_resolve_num_workers_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert resolve_num_workers(16, DistContext(local_world_size=2), 16) == 4  # CPUs split over local ranks
    assert resolve_num_workers(16, DistContext(), 3) == 3  # no more workers than images per batch
    assert resolve_num_workers(2, DistContext(), 16) == 2
    assert resolve_num_workers(4, DistContext(local_world_size=16), 16) == 0


def test_val_loader_covers_each_index_once_across_ranks() -> None:
    indices = []
    for rank in range(3):
        ctx = DistContext(rank=rank, world_size=3)
        loader = build_val_loader(FakeDataset(11, ctx), 2, 0, ctx)
        for batch in loader:
            records = parse_paths(batch["paths"])
            assert {epoch for _, _, epoch, _ in records} == {-1}  # plain int keys
            indices += [index for _, index, _, _ in records]
    assert indices == list(range(11))
    single = build_val_loader(FakeDataset(5, DistContext()), 2, 0, DistContext())
    assert [len(batch["paths"]) for batch in single] == [2, 2, 1]


def _gather_loader_batches(ctx: DistContext, num_items: int) -> None:
    train = build_train_loader(FakeDataset(num_items, ctx, seed=3), 2, 0, ctx, seed=3)
    train.set_epoch(1)
    mine = [index for batch in train for _, index, _, _ in parse_paths(batch["paths"])]
    val = [index for batch in build_val_loader(FakeDataset(num_items, ctx), 2, 0, ctx) for index in batch["paths"]]
    every: list[tuple[int, list[int], list[str]] | None] = [None] * ctx.world_size
    dist.all_gather_object(every, (len(train), mine, val))
    assert len({num_batches for num_batches, _, _ in every}) == 1
    assert len({len(indices) for _, indices, _ in every}) == 1
    assert set().union(*(set(indices) for _, indices, _ in every)) == set(range(num_items))
    val_indices = [parse_paths([path])[0][1] for _, _, paths in every for path in paths]
    assert val_indices == list(range(num_items))


@pytest.mark.distributed
def test_two_gloo_ranks_get_equal_batches(rank_results: list[dict[str, Any]]) -> None:
    check_parts(rank_results, "equal_batches")  # the ranks assert; a rank that raised fails this test


def test_collate_pads_masks_of_mixed_sizes_with_zeros() -> None:
    dataset = FakeDataset(3, DistContext())
    items = [dataset[1], dataset[2]]  # 1 and 2 labels
    # Tall and wide images at mask ratio 2: the batch is (8, 12) with (4, 6) masks, taken from different items.
    items[0]["image"], items[0]["masks"] = (
        torch.zeros((8, 6, 3), dtype=torch.uint8),
        torch.ones((1, 4, 3), dtype=torch.uint8),
    )
    items[1]["image"], items[1]["masks"] = (
        torch.zeros((4, 12, 3), dtype=torch.uint8),
        torch.ones((2, 2, 6), dtype=torch.uint8),
    )
    batch = collate_batch(items)
    assert batch["images"].shape == (2, 8, 12, 3)
    masks = batch["masks"]
    assert masks.shape == (3, 4, 6) and masks.dtype == torch.uint8
    assert masks[0, :, :3].all() and not masks[0, :, 3:].any()  # padded on the right only
    assert masks[1:, :2].all() and not masks[1:, 2:].any()  # padded at the bottom only
    assert items[0]["masks"].shape == (1, 4, 3)  # the items themselves are left as they were


def test_collate_stacks_overlap_masks_per_image() -> None:
    dataset = FakeDataset(3, DistContext())
    items = [dataset[i] for i in range(3)]  # 0, 1, 2 labels: one index mask per image all the same
    for item in items[:2]:
        item["masks"] = torch.full((1, 4, 6), 3, dtype=torch.int16)  # images (8, 12) at mask ratio 2
    small = torch.tensor([[[1, 2, 0], [2, 2, 1]]], dtype=torch.int16)
    items[2]["image"], items[2]["masks"] = torch.zeros((4, 6, 3), dtype=torch.uint8), small
    batch = collate_batch(items)
    masks = batch["masks"]
    assert masks.shape == (3, 4, 6) and masks.dtype == torch.int16
    assert masks[:2].eq(3).all()
    assert torch.equal(masks[2, :2, :3], small[0]) and masks[2, 2:].eq(0).all() and masks[2, :, 3:].eq(0).all()


# (epoch, first batch) the loader is asked for in turn: runs on from epoch 0 to 1, restarts for a mid-epoch resume
# of epoch 2 (as after a crash), runs on to 3.
STREAM_POSITIONS = [(0, 0), (1, 0), (2, 1), (3, 0)]


def _stream_as_per_epoch_samplers(ctx: DistContext, num_items: int, shared: bool) -> None:
    dataset = FakeDataset(num_items, ctx, seed=3)
    if shared:  # every rank reads every image (--cache shm): one permutation dealt out to the ranks
        dataset.shard = np.arange(num_items)
    loader = build_train_loader(dataset, 2, 1, ctx, seed=3, epochs=4)  # a worker per rank (2 cores and more)
    mine = []
    for epoch, start_batch in STREAM_POSITIONS:
        loader.set_epoch(epoch, start_batch)
        keys = [(index, key_epoch) for batch in loader for _, index, key_epoch, _ in parse_paths(batch["paths"])]
        alone = SmartDistributedSampler(dataset.shard, ctx, 3, num_items)  # a fresh sampler, as before the stream
        alone.set_epoch(epoch, start=start_batch * 2)
        assert keys == [(index, epoch) for index in alone], (epoch, start_batch)
        mine.append([index for index, _ in keys])
    every: list[list[list[int]] | None] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    for position, (_, start_batch) in enumerate(STREAM_POSITIONS):
        per_rank = [ranks[position] for ranks in every]  # type: ignore[index]
        assert len({len(indices) for indices in per_rank}) == 1  # equal steps on every rank
        if start_batch == 0:
            assert set().union(*map(set, per_rank)) == set(range(num_items))  # every image this epoch
        if not shared:  # each rank only its own shard: disjoint
            assert not set(per_rank[0]) & set(per_rank[1])


@pytest.mark.distributed
@pytest.mark.parametrize("shared", [False, True])
def test_two_gloo_ranks_stream_epochs_exactly_as_set_epoch_would(
    rank_results: list[dict[str, Any]], shared: bool
) -> None:
    check_parts(rank_results, f"stream_shared_{shared}")  # the ranks assert; a rank that raised fails this test


def _rank_checks(ctx: DistContext) -> dict[str, Any]:
    """The 2-rank checks of this module, in the same order on both ranks: one spawned job for all of them."""
    return {
        "equal_batches": captured(_gather_loader_batches, ctx, 13),
        **{
            f"stream_shared_{shared}": captured(_stream_as_per_epoch_samplers, ctx, 11, shared)
            for shared in (False, True)
        },
    }


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of _rank_checks: a spawned job costs seconds of torch imports, so the tests share one."""
    return run_distributed(_rank_checks, 2, tmp_path_factory.mktemp("loader_ranks"))
