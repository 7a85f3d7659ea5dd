"""Tests for utils/train/device_constants.py: constant tables made on the device, built once per shape."""

from __future__ import annotations

import torch

from utils.train.device_constants import ShapeCache, filled_table


def test_filled_table_holds_the_rows_in_the_dtype() -> None:
    table = filled_table([[1, 2, 3], [4, 5, 6]], torch.int64, torch.device("cpu"))
    assert table.dtype == torch.int64 and torch.equal(table, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(filled_table([[0.5], [2.0]], torch.float32, torch.device("cpu")), torch.tensor([[0.5], [2.0]]))


def test_shape_cache_builds_once_per_key_and_starts_again_when_full() -> None:
    built = []

    def build(*key: object) -> tuple:
        built.append(key)
        return key

    cache = ShapeCache(build, size=2)
    assert cache((8, 8), "cpu") == ((8, 8), "cpu")
    assert cache((8, 8), "cpu") == ((8, 8), "cpu") and built == [((8, 8), "cpu")]
    cache((4, 4), "cpu")
    assert len(built) == 2 and len(cache.values) == 2
    cache((2, 2), "cpu")  # a third key: the cache starts again and holds only it
    assert list(cache.values) == [((2, 2), "cpu")]
    cache((8, 8), "cpu")
    assert len(built) == 4
