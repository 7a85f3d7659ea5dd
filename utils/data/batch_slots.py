"""Reused shared-memory buffers for the images of the train batches that loader workers build.

A DataLoader worker normally stacks each batch's images into a NEW shared-memory segment that the
training process maps and drops again: at 16 x 3 x 640 x 640 that is 20 MB of fresh tmpfs pages
to fault in and zero per batch, about 5 ms, more than a third of a worker's hand-over cost and
as much as one mosaic image. `BatchSlots` gives every worker a ring of slots it allocates once;
a batch's images are stacked into a free slot, the training process copies them out (the
pin-memory thread's copy into page-locked memory on CUDA, a plain copy elsewhere) and marks the
slot free again in a small flag array all processes share. A worker that finds all its slots in
use (batches it sent that were never taken, e.g. an epoch abandoned half-way) falls back to a
new segment, as before: slower, never wrong.
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
    frees them, after its copy, so a slot is never written while its data is still needed.
    """

    def __init__(self, num_workers: int, slots_per_worker: int, slot_shape: tuple[int, ...]) -> None:
        self.slots_per_worker = slots_per_worker
        self.slot_numel = math.prod(slot_shape)
        self.busy = torch.zeros(num_workers * slots_per_worker, dtype=torch.uint8).share_memory_()
        self._ring: torch.Tensor | None = None  # a worker's own slots, allocated on its first batch
        self._mapped: dict[int, torch.UntypedStorage] = {}  # training process: rings kept mapped (no re-mmap)

    def __getstate__(self) -> dict[str, Any]:
        """What a worker started by pickling gets: the shared flags, no buffers."""
        return {**self.__dict__, "_ring": None, "_mapped": {}}

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
            self._ring = torch.empty((self.slots_per_worker, self.slot_numel), dtype=torch.uint8).share_memory_()
        slot = free[0]
        self.busy[slot] = 1
        out = self._ring[slot - first, :numel].view(len(images), *images[0].shape)
        return torch.stack(images, out=out), slot

    def take(self, batch: dict[str, Any]) -> dict[str, Any]:
        """In the training process: give the batch's slot back, after copying its images out unless already pinned."""
        slot = batch.pop("slot", None)
        if slot is None:
            return batch
        images = batch["images"]
        if not images.is_pinned():  # still the worker's buffer: copy before the worker may overwrite it
            worker = slot // self.slots_per_worker
            if worker not in self._mapped:  # keeping the storage keeps torch's mapping of the ring for later batches
                self._mapped[worker] = images.untyped_storage()
            batch["images"] = images.clone()
        self.busy[slot] = 0
        return batch
