"""Reused shared-memory buffers for the images of the train batches that loader workers build.

A DataLoader worker normally stacks each batch's images into a NEW shared-memory segment that the
training process maps and drops again: at 16 x 3 x 640 x 640 that is 20 MB of fresh tmpfs pages
to fault in and zero per batch, about 5 ms, more than a third of a worker's hand-over cost and
as much as one mosaic image. `BatchSlots` gives every worker a ring of slots it allocates once;
a batch's images are stacked into a free slot, the training process copies them out (the
pin-memory thread's copy into page-locked memory on CUDA, a plain copy elsewhere) and marks the
slot free again in a small flag array all processes share. The training loop itself takes no copy
on CPU: it borrows the slot (`take(..., lend=True)`) until it draws the next batch, having turned
the images into the model's float input by then. On 2 cores that copy (a fresh 20 MB buffer per
batch) held the 2-worker loader to 250-480 images/s against 525-540 without it. A worker that
finds all its slots in use (batches it sent that were never taken, e.g. an epoch abandoned
half-way) falls back to a new segment, as before: slower, never wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info


class BatchSlots:
    """`slots_per_worker` buffers of `slot_shape` uint8 for each of `num_workers` loader workers.

    Build it in the training process before the workers start (the flags are shared memory the
    workers inherit); `stack` runs in a worker (the collate), `take` in the training process on
    every batch the loader yields. A worker only claims its own slots; the training process only
    frees them, after its copy or when a lent batch is done with, so a slot is never written while
    its data is still needed.
    """

    def __init__(self, num_workers: int, slots_per_worker: int, slot_shape: tuple[int, ...]) -> None:
        self.slots_per_worker = slots_per_worker
        self.slot_numel = math.prod(slot_shape)
        self.busy = torch.zeros(num_workers * slots_per_worker, dtype=torch.uint8).share_memory_()
        self._ring: torch.Tensor | None = None  # a worker's own slots, allocated on its first batch
        self._mapped: dict[int, torch.UntypedStorage] = {}  # training process: rings kept mapped (no re-mmap)
        self._lent: int | None = None  # training process: the slot the last batch taken still reads

    def __getstate__(self) -> dict[str, Any]:
        """What a worker started by pickling gets: the shared flags, no buffers."""
        return {**self.__dict__, "_ring": None, "_mapped": {}, "_lent": None}

    def stack(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        """Stack `images` into a free slot of this worker: (batch, slot id), or (new tensor, None) when none is free.

        Outside a worker, or for a batch larger than a slot, the images are stacked as usual.
        """
        info = get_worker_info()
        numel = len(images) * images[0].numel()
        if info is None or numel > self.slot_numel or images[0].dtype != torch.uint8:
            return torch.stack(images), None
        first = info.id * self.slots_per_worker
        free = [slot for slot in range(first, first + self.slots_per_worker) if not self.busy[slot]]
        if not free:
            return default_collate(images), None  # a new shared segment, as a DataLoader worker always makes
        if self._ring is None:
            self._ring = _new_shared_ring(self.slots_per_worker, self.slot_numel)
        slot = free[0]
        self.busy[slot] = 1
        out = self._ring[slot - first, :numel].view(len(images), *images[0].shape)
        return torch.stack(images, out=out), slot

    def take(self, batch: dict[str, Any], lend: bool = False) -> dict[str, Any]:
        """In the training process: the batch with its images out of the worker's slot, or lent from it.

        The slot of a batch lent before is given back first. Images already copied to page-locked
        memory (the pin-memory thread on CUDA) free their slot at once. Otherwise they are copied
        out and the slot freed, or, with `lend`, left in the slot until the next `take` or `release`:
        no copy, for a caller that is done with a batch's images before it draws the next.
        """
        self.release()
        slot = batch.pop("slot", None)
        if slot is None:
            return batch
        images = batch["images"]
        if not images.is_pinned():  # still the worker's buffer
            worker = slot // self.slots_per_worker
            if worker not in self._mapped:  # keeping the storage keeps torch's mapping of the ring for later batches
                self._mapped[worker] = images.untyped_storage()
            if lend:
                self._lent = slot
                return batch
            batch["images"] = images.clone()
        self.busy[slot] = 0
        return batch

    def release(self) -> None:
        """Give back the slot of the batch last lent: its images may be overwritten from now on."""
        if self._lent is not None:
            self.busy[self._lent] = 0
            self._lent = None


def _new_shared_ring(num_slots: int, slot_numel: int) -> torch.Tensor:
    """A (num_slots, slot_numel) uint8 tensor in new shared memory, its pages untouched until a slot is written.

    `torch.empty(...).share_memory_()` would allocate private memory and copy it into the shared
    segment, faulting in every page of every slot before a worker's first batch: 3 slots of
    16 x 640 x 640 x 3 took 0.45 s that way against 0.13 s here on a loaded 2-core machine, and
    each worker pays it on its first batch. `_new_shared` is the allocation `share_memory_` itself
    makes (torch's multiprocessing uses it too).
    """
    storage = torch.UntypedStorage._new_shared(num_slots * slot_numel)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(num_slots, slot_numel)
