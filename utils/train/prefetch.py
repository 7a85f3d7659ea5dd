"""Batches moved to the device ahead of use (on CUDA the next batch's copy overlaps the current step), and timed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

B = TypeVar("B")
OnDevice = dict[str, torch.Tensor]


class DevicePrefetcher:
    """Iterate `(batch, to_device(batch))` pairs, with `to_device` run one batch ahead on CUDA.

    `to_device` moves what the step needs (images as float, `utils.data.batch.images_on_device`; targets, masks) to the
    device and returns it as a dict of tensors; the host `batch` is passed along untouched for
    whatever reads it on the host (plots, the progress bar). On CUDA, batch i + 1 is taken from
    the loader and its copy and normalisation are queued on a side stream before batch i is
    handed out, so they run while the model trains on batch i; the host memory must be pinned
    (the train loader pins on CUDA) for the copy to be asynchronous. The training stream waits
    for the side stream before it uses a batch, and every tensor is marked as used by it
    (`record_stream`), so the caching allocator does not hand its memory out early. Elsewhere
    `to_device` runs inline, which is the plain path.
    """

    def __init__(self, batches: Iterable[B], to_device: Callable[[B], OnDevice], device: torch.device) -> None:
        self.batches = batches
        self.to_device = to_device
        self.device = device

    def __iter__(self) -> Iterator[tuple[Any, OnDevice]]:
        if self.device.type != "cuda":
            for batch in self.batches:
                yield batch, self.to_device(batch)
            return
        side = torch.cuda.Stream(self.device)
        training = torch.cuda.current_stream(self.device)
        iterator = iter(self.batches)
        pending = self._start(iterator, side)
        while pending is not None:
            batch, on_device = pending
            training.wait_stream(side)
            for tensor in on_device.values():
                tensor.record_stream(training)
            pending = self._start(iterator, side)
            yield batch, on_device

    def _start(self, iterator: Iterator[B], side: torch.cuda.Stream) -> tuple[B, OnDevice] | None:
        """Take the next batch and queue its move to the device on `side`; None when the loader is done."""
        batch = next(iterator, None)
        if batch is None:
            return None
        with torch.cuda.stream(side):
            return batch, self.to_device(batch)


class WaitTimer:
    """Iterate `items`, adding up the seconds spent inside their `next()`: how long the consumer waited for each.

    Around a `DevicePrefetcher` over the train loader, that is the time the training loop stood
    waiting for its next batch (plus, on CPU, converting it): the loader's share of a step, which
    should be near zero when enough workers feed it. On CUDA the loop reads the loss once per
    optimizer step, which keeps the host in step with the GPU, so a wait there is mostly GPU time lost.
    """

    def __init__(self, items: Iterable[B]) -> None:
        self.items = items
        self.seconds = 0.0

    def __iter__(self) -> Iterator[B]:
        iterator = iter(self.items)
        while True:
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - start
            yield item
