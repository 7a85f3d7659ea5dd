"""A read-only list of strings held in two flat arrays: the dataset's image paths, shared by forked workers."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np


class PackedStrings(Sequence[str]):
    """Strings stored as one uint8 buffer of their file-system bytes and (n + 1,) int64 offsets into it.

    String i is `data[offsets[i]:offsets[i + 1]]`, decoded by os.fsdecode on access, so any name
    the file system holds comes back as it went in (os.fsencode). A Python list of a million
    paths is a million objects (about 110 bytes each at 60 characters) that a forked loader worker
    copies page by page as reference counting touches them; packed, the paths are two arrays the
    processes share (memory maps of the label cache when read from it). Indexing and iteration
    give `str`; a slice gives a list. Equal to any sequence of the same strings in order.
    """

    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray) -> None:
        if data.ndim != 1 or data.dtype != np.uint8:
            raise ValueError(f"packed string data must be 1-D uint8, not {data.dtype} of shape {data.shape}")
        if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(data):
            raise ValueError("packed string offsets must run from 0 to the length of the data")
        self.data = data
        self.offsets = offsets.astype(np.int64, copy=False)

    @classmethod
    def pack(cls, strings: Iterable[str]) -> PackedStrings:
        """Pack `strings` (a PackedStrings is returned as it is: it is read-only)."""
        if isinstance(strings, PackedStrings):
            return strings
        encoded = [os.fsencode(string) for string in strings]
        return cls._from_bytes(encoded)

    @classmethod
    def concatenate(cls, parts: Sequence[PackedStrings]) -> PackedStrings:
        """Return the strings of `parts` one part after another."""
        offsets = [np.zeros(1, np.int64)]
        size = 0
        for part in parts:  # each part's offsets start at 0: shift them past the parts before it
            offsets.append(part.offsets[1:] + size)
            size += len(part.data)
        data = np.concatenate([np.zeros(0, np.uint8), *(part.data for part in parts)])
        return cls(data, np.concatenate(offsets))

    def take(self, order: Sequence[int] | np.ndarray) -> PackedStrings:
        """Return the strings at `order`, in that order, packed afresh."""
        data = self.data.tobytes()
        starts, ends = self.offsets[:-1].tolist(), self.offsets[1:].tolist()
        return self._from_bytes([data[starts[i] : ends[i]] for i in np.asarray(order, np.int64).tolist()])

    @classmethod
    def _from_bytes(cls, encoded: list[bytes]) -> PackedStrings:
        offsets = np.zeros(len(encoded) + 1, np.int64)
        offsets[1:] = np.cumsum([len(item) for item in encoded])
        return cls(np.frombuffer(b"".join(encoded), np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        i = int(index) + count if index < 0 else int(index)
        if not 0 <= i < count:
            raise IndexError(f"index {index} is out of range for {count} strings")
        return os.fsdecode(self.data[self.offsets[i] : self.offsets[i + 1]].tobytes())

    def __iter__(self) -> Iterator[str]:
        data = self.data.tobytes()
        bounds = self.offsets.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            yield os.fsdecode(data[start:end])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedStrings):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.data, other.data)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, like a list

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings, {len(self.data)} bytes)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedStrings, (self.data, self.offsets))
