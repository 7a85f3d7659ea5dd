"""Small constant tensors a loss needs at every step, made on the device once per input shape."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def filled_table(rows: list[list[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor filled in place on `device`: no host-to-device copy, which waits on a GPU."""
    table = torch.empty((len(rows), len(rows[0])), dtype=dtype, device=device)
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            table[i, j].fill_(value)
    return table


class ShapeCache(Generic[T]):
    """Values built once per key (grid shapes, device, dtype) and reused: a step then launches no kernel for them.

    Holds at most `size` keys (training's shape, the epoch's short last batch, validation's rect
    shapes); when full, it starts again empty, so multi-scale training cannot grow it.
    """

    def __init__(self, build: Callable[..., T], size: int = 8) -> None:
        self.build = build
        self.size = size
        self.values: dict[Hashable, T] = {}

    def __call__(self, *key: Hashable) -> T:
        """The value for `key`, built by `build(*key)` the first time."""
        if key not in self.values:
            if len(self.values) >= self.size:
                self.values.clear()
            self.values[key] = self.build(*key)
        return self.values[key]
