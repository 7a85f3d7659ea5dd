"""Data loaders: per-rank train/val DataLoaders (the train one streams epochs), workers, unreadable images."""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any, TypedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from utils.data.batch import Batch, collate_batch
from utils.data.batch_slots import BatchSlots
from utils.data.sampler import EpochStream, ShardedInferenceSampler, SmartDistributedSampler
from utils.data.workers import resolve_num_workers, worker_init, worker_start_method
from utils.distributed import DistContext

LOGGER = logging.getLogger(__name__)


class UnreadableImages:
    """What a loader's batches reported as unreadable on this rank: warned once per file, counted, summarised.

    Lives in the process that iterates the loader (the training process), so the warnings and
    counts cover every DataLoader worker: each worker only marks its items (`Batch.unreadable`).
    `files` holds every unreadable path seen, `count` every image replaced or left out so far.
    """

    def __init__(self, consequence: str) -> None:
        self.consequence = consequence  # what happened to such an image, for the messages
        self.files: set[str] = set()
        self.count = 0

    def note(self, batch: Batch) -> int:
        """Warn once about each new unreadable path in `batch`; count them all and return how many it had."""
        paths = batch.get("unreadable", [])
        for path in paths:
            if path not in self.files:
                self.files.add(path)
                LOGGER.warning(
                    f"cannot read image {path} (deleted or failing since the label scan); {self.consequence}"
                )
        self.count += len(paths)
        return len(paths)

    def summarise(self, count: int, during: str) -> None:
        """Log one warning with the number of unreadable images met `during` a pass, if there were any."""
        if count:
            LOGGER.warning(
                f"{count} unreadable image(s) during {during} ({len(self.files)} file(s) so far, named above); "
                f"{self.consequence}"
            )


class LoaderGeometry(TypedDict):
    """What a batch position in an epoch depends on besides (seed, epoch): mid-epoch checkpoints record it.

    `dataset` is a digest of the image paths in index order ("" for a dataset without them), so a
    train set edited to the same length is still told apart.
    """

    world_size: int
    per_rank_batch: int
    shared_order: bool
    dataset_len: int
    dataset: str


def paths_digest(paths: Iterable[str]) -> str:
    """The SHA-1 of the paths joined by newlines, each as its file-system bytes (a name need not be UTF-8)."""
    return hashlib.sha1("\n".join(paths).encode(errors="surrogateescape")).hexdigest()


class TrainLoader:
    """This rank's training batches: a DataLoader over an `EpochStream`, handed out one epoch at a time.

    `len()` is the number of batches of the epoch `set_epoch` selected, identical on every rank.
    Call `set_epoch(epoch)` before iterating. The DataLoader's iteration runs on across epochs:
    when the epoch asked for is the one the running iteration reaches next (the usual next epoch,
    or the rest of an epoch left part-way), it continues, and its workers have been building that
    epoch's first batches since they finished the last one's; any other position restarts it there
    (workers drop what they built ahead). Either way batch b of epoch e is the same.
    """

    def __init__(self, loader: DataLoader, stream: EpochStream, slots: BatchSlots | None = None) -> None:
        self.loader = loader
        self.stream = stream
        self.sampler = stream.sampler
        self.slots = slots
        self.unreadable = UnreadableImages("another training image this rank may read is used in its place")
        self._iteration: Iterator[Batch] | None = None  # the DataLoader's iteration, kept across epochs
        self._reached = (0, 0)  # (epoch, batch) that `_iteration` yields next
        self._wanted = (0, 0)  # (epoch, batch) the next epoch's iteration starts at (`set_epoch`)
        self._files_digest: str | None = None  # of the dataset's image paths, in order (`geometry`)

    @property
    def dataset(self) -> Dataset:
        """The dataset the batches come from."""
        return self.loader.dataset

    @property
    def num_workers(self) -> int:
        """Worker processes actually used (after `resolve_num_workers`)."""
        return self.loader.num_workers

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch whose sample order and keys the next iteration uses, from batch `start_batch` on.

        Every rank calls it with the same values; `start_batch` > 0 continues an interrupted epoch
        with exactly the batches the uninterrupted run would have had next.
        """
        # After the epoch's last batch (shorter than the others when the shard does not divide evenly)
        # the position is its end, length_of(epoch), not batches x batch size.
        start = min(start_batch * self.stream.batch_size, self.sampler.length_of(epoch))
        self.sampler.set_epoch(epoch, start=start)
        self._wanted = self._position(epoch, start_batch)

    def start(self, epoch: int, start_batch: int = 0, seen: np.ndarray | None = None) -> int:
        """`set_epoch`, and start the workers building that epoch's first batches now rather than at the first batch.

        For set-up: forking the workers and building their first batches then overlaps the work the
        training process still does before its first step (model summary, optimizer, EMA, callbacks).
        `seen` (dataset indices `epoch` already trained, from a mid-epoch checkpoint) makes the rest of
        that epoch the images not in it (`SmartDistributedSampler.plan_remainder`), starting no earlier
        than the batch the plan's rest begins at; every rank must pass it. Returns the batch it starts at.
        """
        if seen is not None:
            start_batch = max(start_batch, self.sampler.plan_remainder(epoch, seen, self.stream.batch_size))
        self.set_epoch(epoch, start_batch)
        self._iteration_at(self._wanted)
        return start_batch

    @property
    def geometry(self) -> LoaderGeometry:
        """What makes a position in an epoch name the same images: a mid-epoch checkpoint records it."""
        if self._files_digest is None:  # once: hashing a million paths takes a moment
            files = getattr(getattr(self.dataset, "index", None), "im_files", None)
            self._files_digest = paths_digest(files) if files is not None else ""
        sampler = self.sampler
        return LoaderGeometry(
            world_size=sampler.world_size,
            per_rank_batch=self.stream.batch_size,
            shared_order=sampler.is_global,
            dataset_len=sampler.dataset_len,
            dataset=self._files_digest,
        )

    def seen_after(self, epoch: int, batches_done: int) -> np.ndarray:
        """Dataset indices of `epoch` trained by its first `batches_done` batches here, and any its plan had seen."""
        trained = self.sampler.indices_of(epoch)[: batches_done * self.stream.batch_size]
        before = self.sampler.plan_seen if epoch == self.sampler.plan_epoch else trained[:0]
        return np.union1d(before, trained)

    def close(self) -> None:
        """Stop the workers now (a second call does nothing); the loader may be started again after.

        The workers stream batches across epochs, so no epoch's end stops them. Left to the garbage
        collector, the loader's reference cycles may be finalised queues first: the workers then never
        hear the stop and the DataLoader kills each after a 5 s wait (10 s more at the end of a
        preempted run with 2 workers).
        """
        iteration, self._iteration = self._iteration, None
        self.loader._iterator = None  # the DataLoader's own reference to its persistent workers' iteration
        _stop_workers(iteration)

    def __len__(self) -> int:
        """The batches the next iteration yields: after a mid-epoch start, only those left in that epoch."""
        return self.stream.batches_in(self.sampler.epoch, self.sampler.start)

    @property
    def batches_per_epoch(self) -> int:
        """The batches of a whole epoch, whatever batch this loader was started at (what step counts are on)."""
        return self.stream.batches_per_epoch()

    def __iter__(self) -> Iterator[Batch]:
        """Yield the epoch's batches; unreadable images they report are warned about once each and counted."""
        return self._batches(lend=False)

    def lent(self) -> Iterator[Batch]:
        """Yield the epoch's batches as `__iter__` does, with images valid only until the next batch is drawn.

        They are read in place from the worker's buffer (`BatchSlots`) instead of copied: for a
        loop that has moved or converted each batch's images before it asks for the next, as
        `train_one_epoch` does. A batch kept longer may see its pixels overwritten.
        """
        return self._batches(lend=True)

    def _position(self, epoch: int, batch: int) -> tuple[int, int]:
        """(epoch, batch) with the position just past an epoch's last batch written as the next epoch's first."""
        return (epoch + 1, 0) if batch >= self.stream.batches_in(epoch) else (epoch, batch)

    def _iteration_at(self, position: tuple[int, int]) -> Iterator[Batch]:
        """The DataLoader's iteration, continued when it is at `position`, else (re)started there."""
        past_end = self.stream.end_epoch is not None and position[0] >= self.stream.end_epoch  # the iteration ended
        if self._iteration is None or self._reached != position or past_end:
            self.stream.begin(*position)
            self._iteration = iter(self.loader)  # persistent workers: the same workers, reset
            self._reached = position
        return self._iteration

    def _batches(self, lend: bool) -> Iterator[Batch]:
        count, epoch = 0, self.sampler.epoch
        iteration = self._iteration_at(self._wanted)
        try:
            # islice asks for no batch past this epoch's: those stay with the workers for the next one.
            for batch in itertools.islice(iteration, len(self)):
                self._reached = self._position(self._reached[0], self._reached[1] + 1)
                if self.slots is not None:
                    batch = self.slots.take(batch, lend)
                count += self.unreadable.note(batch)
                yield batch
        finally:
            if self.slots is not None:
                self.slots.release()
        self.unreadable.summarise(count, f"training epoch {epoch + 1}")


def build_train_loader(
    dataset: Any,
    per_rank_batch: int,
    num_workers: int,
    ctx: DistContext,
    seed: int,
    prefetch_factor: int = 2,
    shuffle: bool = True,
    epochs: int | None = None,
) -> TrainLoader:
    """Build this rank's training loader over `dataset.shard`, with equal batches per epoch on every rank.

    `dataset` must have `shard` (its `rank_shard` indices), `__len__`, and a `__getitem__` that
    accepts an `(index, epoch)` tuple. The batch is `per_rank_batch` images (global batch //
    world size), the last batch of an epoch may be short (drop_last=False). `num_workers` is
    capped by `resolve_num_workers`; workers start by `worker_start_method` (forked on Linux: they
    share the dataset) and persist across epochs (no re-fork, cache pages and file handles stay
    warm), run at WORKER_NICENESS lower priority than training and are seeded by `seed_worker`
    from (seed, rank, worker id).
    Memory is pinned when the device is CUDA. `shuffle=False` (rectangular training) walks the
    shard in dataset order, which is aspect-ratio order there, so each batch holds similar shapes.
    The workers build batches across epoch boundaries (`EpochStream`, `TrainLoader`), through epoch
    `epochs` - 1 (the run's last) or, when None, without end.
    """
    sampler = SmartDistributedSampler(dataset.shard, ctx, seed, dataset_len=len(dataset), shuffle=shuffle)
    stream = EpochStream(sampler, per_rank_batch, end_epoch=epochs)
    workers = resolve_num_workers(num_workers, ctx, per_rank_batch)
    slots = None
    if workers > 0 and hasattr(dataset, "options"):  # LoadImagesAndLabels: batches of at most img_size squares
        side = dataset.options.img_size
        # A worker has at most `prefetch_factor` batches in flight (built or being built); one slot to spare.
        slots = BatchSlots(workers, prefetch_factor + 1, (per_rank_batch, side, side, 3))
    loader = DataLoader(
        dataset,
        batch_sampler=stream,
        num_workers=workers,
        collate_fn=functools.partial(collate_batch, slots=slots),
        pin_memory=ctx.device.type == "cuda",
        worker_init_fn=worker_init(seed, ctx.rank),
        multiprocessing_context=worker_start_method() if workers > 0 else None,
        generator=torch.Generator().manual_seed(seed + ctx.rank),
        persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
    )
    if ctx.is_main:
        LOGGER.info(
            "train loader: %d images/rank/epoch, %d batches of %d per rank, %d workers per rank",
            len(sampler),
            stream.batches_per_epoch(),
            per_rank_batch,
            workers,
        )
    return TrainLoader(loader, stream, slots)


class EvalLoader(DataLoader):
    """A DataLoader for evaluation that leaves out batches with no readable image and reports unreadable ones.

    Items of images that cannot be read are left out by `collate_batch`; a batch left with no image
    is not yielded at all (a model and loss given zero images would not agree on what that means).
    Each unreadable file is warned about once on this rank and the pass ends with a count.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unreadable = UnreadableImages("left out of validation")

    def close(self) -> None:
        """Stop the persistent workers now (a second call does nothing); the next pass starts new ones."""
        iteration, self._iterator = self._iterator, None
        _stop_workers(iteration)

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]  # a generator over DataLoader's iterator
        """Yield the pass's batches that hold an image; unreadable images are warned about once each and counted."""
        count = 0
        for batch in super().__iter__():
            count += self.unreadable.note(batch)
            if batch["paths"]:
                yield batch
        self.unreadable.summarise(count, "validation")


def _stop_workers(iteration: Any) -> None:
    """Shut down the workers of a DataLoader iteration now (nothing for None or one without workers)."""
    shutdown = getattr(iteration, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def build_val_loader(dataset: Any, per_rank_batch: int, num_workers: int, ctx: DistContext) -> EvalLoader:
    """Build this rank's evaluation loader: contiguous batches of `per_rank_batch`, no padding, no shuffling.

    The dataset must have computed its rectangular shapes with the global batch, `per_rank_batch` x
    the world size. Each rank reads its `ShardedInferenceSampler` batches, none crossing a global
    batch, so every image is letterboxed as one process with the global batch letterboxes it and the
    metrics do not depend on the number of ranks; batch counts differ by at most one between ranks.
    Evaluation gathers results once at the end (never per step). Items are fetched with plain int
    indices. Images that cannot be read are left out and reported (`EvalLoader`).
    """
    batches = ShardedInferenceSampler(len(dataset), ctx, per_rank_batch * ctx.world_size, per_rank_batch)
    workers = resolve_num_workers(num_workers, ctx, per_rank_batch) if len(batches) else 0
    return EvalLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate_batch,
        pin_memory=ctx.device.type == "cuda",
        worker_init_fn=worker_init(0, ctx.rank),
        multiprocessing_context=worker_start_method() if workers > 0 else None,
        persistent_workers=workers > 0,
    )
