"""Samplers: each epoch's order of a rank's shard or the shared dataset, its batches (train); unpadded ranges (eval)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from utils.distributed import DistContext, all_gather_objects


def per_rank_length(dataset_len: int, world_size: int) -> int:
    """Return how many samples every rank draws per epoch: ceil(dataset_len / world_size).

    Shards from `rank_shard` differ in length by at most one, so the longest shard has exactly
    this many items. Every rank computes it from the dataset length alone, with no collective,
    and pads a shorter shard up to it, so all ranks run the same number of steps.
    """
    return math.ceil(dataset_len / world_size)


def order_seed(seed: int, epoch: int, rank: int) -> int:
    """Return the torch seed for the sampler order of (seed, epoch, rank).

    Mixed through `np.random.SeedSequence` rather than `seed + epoch + rank`, so (epoch 1, rank 0)
    and (epoch 0, rank 1) do not collide into the same permutation. Negative seeds are wrapped
    into the unsigned range SeedSequence accepts.
    """
    words = np.random.SeedSequence([seed % 2**64, epoch, rank]).generate_state(2, np.uint32)
    return int(words[0]) << 32 | int(words[1])


class SmartDistributedSampler(Sampler[int]):
    """Training sampler: a fresh deterministic order each epoch, equally long on every rank.

    `shard` holds the dataset indices this rank may read (`dataset.shard`). Two cases:
    - its `rank_shard` (no cache, `ram`, `disk`): the sampler draws only images this rank has
      cached, in an order that is a pure function of (seed, epoch, rank). A shorter shard is
      padded by repeating its own items from the start of the epoch's permutation (never
      another rank's).
    - every index (`--cache shm`: every rank reads every image from the node's shared copy):
      one permutation of the whole dataset per (seed, epoch), the same on every rank, padded
      with its own head to `num_samples * world_size` and dealt out with rank r taking
      positions r, r + W, ..., so an epoch shows every image once (padding aside) and mosaic
      partners come from the whole dataset. With one process both cases give the same order.
    Call `set_epoch(epoch)` before each epoch to reshuffle; the same (seed, epoch) always gives
    the same order, also after a resume. `plan_remainder(epoch, seen, batch_size)` makes one epoch
    end with only the images a run interrupted in it had not trained yet: a resume on another number of ranks or
    another per-rank batch, where the interrupted run's positions mean other images. Every rank
    yields `num_samples` indices per epoch, default `ceil(dataset_len / world_size)`, so DDP steps
    stay in lock-step without communication (a remainder plan gathers its lengths once). A
    `num_samples` below that truncates the epoch. Raises ValueError when the shard is neither
    of the two cases or when there are fewer items than ranks (a rank with nothing to sample).
    """

    def __init__(
        self,
        shard: np.ndarray,
        ctx: DistContext,
        seed: int,
        dataset_len: int,
        shuffle: bool = True,
        num_samples: int | None = None,
    ) -> None:
        self.shard = np.asarray(shard, dtype=np.int64).reshape(-1)
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0  # samples of this epoch already seen (mid-epoch resume)
        self.ctx = ctx
        self.dataset_len = dataset_len
        # plan_remainder: the epoch that yields only the unseen images, this rank's share of them, and the images
        # that epoch had trained before (kept in mid-epoch checkpoints, so the plan can be made again).
        self.plan_epoch: int | None = None
        self.plan = np.zeros(0, np.int64)
        self.plan_seen = np.zeros(0, np.int64)
        _check_shard(self.shard, dataset_len, ctx)
        self.is_global = len(self.shard) == dataset_len  # every rank reads every item: one shared permutation
        self.num_samples = per_rank_length(dataset_len, ctx.world_size) if num_samples is None else num_samples
        if self.num_samples < 1:
            raise ValueError(f"SmartDistributedSampler: num_samples must be >= 1, got {self.num_samples}")

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch whose order the next iteration yields, from its `start`-th sample on.

        Call it on every rank with the same values. `start` > 0 continues an epoch interrupted
        after `start` samples (a mid-epoch resume): the order is the epoch's own, so the rest is
        exactly what the uninterrupted run would have seen.
        """
        if not 0 <= start <= self.length_of(epoch):
            raise ValueError(f"start {start} is outside 0..{self.length_of(epoch)}")
        self.epoch = int(epoch)
        self.start = int(start)

    def epoch_indices(self) -> np.ndarray:
        """Return the dataset indices of the epoch `set_epoch` selected, (length_of(epoch),) int64 (`indices_of`)."""
        return self.indices_of(self.epoch)

    def indices_of(self, epoch: int) -> np.ndarray:
        """Return `epoch`'s dataset indices for this rank, (length_of(epoch),) int64, padded from the same permutation.

        A pure function of (seed, epoch, rank) and the remainder plan: it neither reads nor changes
        the epoch `set_epoch` selected, so a loader may draw later epochs' orders ahead of time
        (`EpochStream`).
        """
        if epoch == self.plan_epoch:
            return self.plan
        order = self._order(epoch)
        if self.is_global:
            return _deal(order, self.num_samples, self.rank, self.world_size)
        return np.tile(order, math.ceil(self.num_samples / len(order)))[: self.num_samples]

    def length_of(self, epoch: int) -> int:
        """The samples every rank draws in `epoch`: `num_samples`, or the remainder plan's length."""
        return len(self.plan) if epoch == self.plan_epoch else self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        """`epoch`'s unpadded order: of this rank's shard, or (shared) of the whole dataset with rank 0's seed.

        The shared order is seeded as rank 0's shard order is, so a single process samples exactly as
        without a shared cache. Without shuffling the shard's own order (the dataset's; aspect-ratio
        order with rect) is kept, so each batch still holds similar shapes.
        """
        if not self.shuffle:
            return self.shard
        generator = torch.Generator().manual_seed(order_seed(self.seed, epoch, 0 if self.is_global else self.rank))
        return self.shard[torch.randperm(len(self.shard), generator=generator).numpy()]

    def plan_remainder(self, epoch: int, seen: np.ndarray, batch_size: int) -> int:
        """Make `epoch` end with only the images not in `seen` (dataset indices it trained); every rank calls it.

        Each rank keeps its own order of the epoch without the seen images (the shared order dealt
        out, with a shared cache), padded by repeating its own items to the longest rank's count (a
        gather of the counts: ranks must step together), so the rest of the epoch trains each unseen
        image once and no seen one again, padding aside; a rank with nothing left pads with its own
        items. Those batches of `batch_size` are the epoch's last: the epoch keeps its usual number
        of batches, the first ones standing for what was trained (filled with seen images, never
        drawn), so a loader started at the returned batch counts its batches, optimizer steps and
        mid-epoch saves on as after any mid-epoch resume. The plan holds until another call;
        `plan_seen` keeps `seen` for the checkpoints. Returns the batch the rest starts at.
        """
        seen = np.unique(np.asarray(seen, dtype=np.int64))
        is_seen = np.zeros(self.dataset_len, bool)
        is_seen[seen] = True
        order = self._order(epoch)
        left = order[~is_seen[order]]
        if self.is_global:
            per_rank = math.ceil(len(left) / self.world_size)
            rest = _deal(left, per_rank, self.rank, self.world_size) if len(left) else left
        else:
            counts = all_gather_objects(len(left), self.ctx) if self.ctx.is_distributed else [len(left)]
            longest = max(counts)
            pool = left if len(left) else order
            rest = np.tile(pool, math.ceil(longest / len(pool)))[:longest] if longest else left
        whole, left_batches = math.ceil(self.num_samples / batch_size), math.ceil(len(rest) / batch_size)
        done = max(0, whole - left_batches) if len(seen) else 0
        filler = np.tile(seen, math.ceil(done * batch_size / len(seen)))[: done * batch_size] if done else seen[:0]
        self.plan_epoch, self.plan_seen = int(epoch), seen
        self.plan = np.concatenate([filler, rest]).astype(np.int64)
        return done

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.start :].tolist())

    def __len__(self) -> int:
        return self.length_of(self.epoch) - self.start


def _deal(order: np.ndarray, per_rank: int, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s `per_rank` items of `order` dealt out to `world_size` ranks, `order` repeated to fill them."""
    total = per_rank * world_size
    return np.tile(order, math.ceil(total / len(order)))[:total][rank::world_size]


class EpochStream(Sampler[list[tuple[int, int]]]):
    """The train loader's batch sampler: batches of `(index, epoch)` keys for epoch after epoch.

    An iteration starts where `begin(epoch, batch)` last put it and runs on into the following
    epochs, up to `end_epoch` - 1 (at least the starting epoch) or without end when that is None.
    Each epoch is `sampler.indices_of(epoch)` cut into batches of `batch_size`, its last batch
    possibly short, so batch b of epoch e holds the same keys however the iteration got there
    (from the start, after a mid-epoch resume, or running on from epoch e - 1). One iteration over
    many epochs lets the workers build the next epoch's first batches while this epoch's last ones
    train and while it is validated, rather than starting every epoch with an empty pipeline.
    The epoch travels inside every key because workers build batches ahead and keep their own
    copy of the dataset: whatever depends on the epoch (the item's random stream, closing mosaic)
    is derived from the key in the worker, never from state the training process changes.
    """

    def __init__(self, sampler: SmartDistributedSampler, batch_size: int, end_epoch: int | None = None) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.end_epoch = end_epoch
        self.start = (0, 0)  # (epoch, batch) the next iteration begins at

    def begin(self, epoch: int, batch: int = 0) -> None:
        """Make the next iteration start at batch `batch` of `epoch`."""
        self.start = (int(epoch), int(batch))

    def batches_per_epoch(self) -> int:
        """Batches of one whole epoch (the same on every rank): what step counts are on."""
        return math.ceil(self.sampler.num_samples / self.batch_size)

    def batches_in(self, epoch: int, skipped_samples: int = 0) -> int:
        """Batches of `epoch` after its first `skipped_samples` samples: fewer for a remainder plan's epoch."""
        return math.ceil((self.sampler.length_of(epoch) - skipped_samples) / self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, batch = self.start  # read now, not when the DataLoader first draws from the generator
        return self._keys(epoch, batch)

    def _keys(self, epoch: int, batch: int) -> Iterator[list[tuple[int, int]]]:
        end = None if self.end_epoch is None else max(self.end_epoch, epoch + 1)
        while end is None or epoch < end:
            indices = self.sampler.indices_of(epoch)[batch * self.batch_size :].tolist()
            for first in range(0, len(indices), self.batch_size):
                yield [(index, epoch) for index in indices[first : first + self.batch_size]]
            epoch, batch = epoch + 1, 0


def _check_shard(shard: np.ndarray, dataset_len: int, ctx: DistContext) -> None:
    """Raise ValueError unless `shard` is this rank's `rank_shard` of a `dataset_len` dataset, or all of it."""
    if dataset_len < ctx.world_size:
        raise ValueError(
            f"dataset has {dataset_len} images but the job has {ctx.world_size} processes; "
            "every rank needs at least one image (use fewer processes or more data)"
        )
    if len(shard) == dataset_len:  # every index: a cache every rank reads (--cache shm)
        if not np.array_equal(np.sort(shard), np.arange(dataset_len)):
            raise ValueError(f"rank {ctx.rank} shard has {dataset_len} indices but not each of 0..{dataset_len - 1}")
        return
    shortest, longest = dataset_len // ctx.world_size, per_rank_length(dataset_len, ctx.world_size)
    if not shortest <= len(shard) <= longest:
        raise ValueError(
            f"rank {ctx.rank} shard has {len(shard)} indices, expected {shortest}..{longest} for "
            f"{dataset_len} images over {ctx.world_size} ranks (or all {dataset_len}); pass the dataset's own shard"
        )
    if shard.min() < 0 or shard.max() >= dataset_len:
        raise ValueError(f"rank {ctx.rank} shard has indices outside 0..{dataset_len - 1}")


def inference_batches(dataset_len: int, rank: int, world_size: int, group: int, batch: int) -> list[range]:
    """Return `rank`'s evaluation batches, contiguous and in dataset order.

    The dataset is cut into groups of `group` items (the batch its rectangular shapes were computed
    with: one shape per group), each group into batches of at most `batch`, and rank r takes batches
    [ceil(r * S / W), ceil((r + 1) * S / W)) of the S in all. No batch crosses a group, so every image is
    letterboxed as one process with batches of `group` letterboxes it, whatever the number of ranks,
    and the ranks' batch counts differ by at most one. With fewer batches than ranks the last ranks
    get none, never rank 0 (the rank that draws the val_batch figures).
    """
    if group < 1 or batch < 1:
        raise ValueError(f"inference batch sizes must be >= 1, got group {group} and batch {batch}")
    batches = [
        range(start, min(start + batch, first + group, dataset_len))
        for first in range(0, dataset_len, group)
        for start in range(first, min(first + group, dataset_len), batch)
    ]
    count = len(batches)
    return batches[-(-rank * count // world_size) : -(-(rank + 1) * count // world_size)]


class ShardedInferenceSampler(Sampler[list[int]]):
    """The evaluation batch sampler: this rank's contiguous batches (`inference_batches`); never pads or duplicates.

    The union over ranks is every index exactly once, so gathered predictions need no de-dup
    and metrics count each image once. Because ranks may get different numbers of batches
    (and a rank may get none), evaluation must not run a collective per step (no per-batch
    all-reduce, no DDP forward): run the bare model, keep results locally, and gather them
    once at the end on every rank. `group` is the batch the dataset's rectangular shapes were
    computed with (the global one), `batch` the loader's.
    """

    def __init__(self, dataset_len: int, ctx: DistContext, group: int, batch: int) -> None:
        self.batches = inference_batches(dataset_len, ctx.rank, ctx.world_size, group, batch)

    def __iter__(self) -> Iterator[list[int]]:
        return (list(indices) for indices in self.batches)

    def __len__(self) -> int:
        return len(self.batches)
