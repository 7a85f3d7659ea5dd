"""Tests for utils/data/packed_strings.py: the image paths as two arrays, read as a list of str, shared when forked."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from utils.data.packed_strings import PackedStrings

# A name that is not UTF-8 (Latin-1 bytes) as Python holds it, a name with non-ASCII letters, and an empty string.
NAMES = ["images/a.jpg", os.fsdecode(b"images/caf\xe9.jpg"), "images/\u732b \u0436.png", ""]


def test_strings_come_back_as_they_went_in() -> None:
    packed = PackedStrings.pack(NAMES)
    assert len(packed) == 4 and list(packed) == NAMES
    assert [packed[i] for i in range(4)] == NAMES and packed[-1] == "" and packed[-4] == NAMES[0]
    assert packed[1:3] == NAMES[1:3] and packed[::-1] == NAMES[::-1]
    assert os.fsencode(packed[1]) == b"images/caf\xe9.jpg"  # the file system's bytes, not a replacement character
    with pytest.raises(IndexError):
        packed[4]
    with pytest.raises(IndexError):
        packed[-5]
    assert PackedStrings.pack([]) == [] and list(PackedStrings.pack([])) == []


def test_equality_take_concatenate_and_pickle() -> None:
    packed = PackedStrings.pack(NAMES)
    assert packed == NAMES and packed == tuple(NAMES) and packed == PackedStrings.pack(NAMES)
    assert packed != NAMES[:3] and packed != [*NAMES[:3], "x"] and packed != "images/a.jpg"
    assert PackedStrings.pack(packed) is packed
    assert packed.take(np.array([3, 0, 2, 0])) == [NAMES[3], NAMES[0], NAMES[2], NAMES[0]]
    assert packed.take([]) == []
    joined = PackedStrings.concatenate([packed, PackedStrings.pack([]), PackedStrings.pack(["b"])])
    assert joined == [*NAMES, "b"] and PackedStrings.concatenate([]) == []
    assert pickle.loads(pickle.dumps(packed)) == NAMES


def test_offsets_that_do_not_fit_the_data_are_refused() -> None:
    data = np.frombuffer(b"abc", np.uint8)
    with pytest.raises(ValueError, match="offsets"):
        PackedStrings(data, np.array([0, 2], np.int64))
    with pytest.raises(ValueError, match="offsets"):
        PackedStrings(data, np.array([1, 3], np.int64))
    with pytest.raises(ValueError, match="uint8"):
        PackedStrings(data.astype(np.int32), np.array([0, 3], np.int64))


def _private_kb() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Dirty", "Private_Clean")))


def _private_growth_reading_all(paths: list[str] | PackedStrings, order: np.ndarray) -> int:
    """kB of private memory a forked child gains by reading every path in `order` (as a loader worker would)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running the parent's exit handlers
        try:
            before = _private_kb()
            for i in order:
                len(paths[i])
            os.write(write_end, str(_private_kb() - before).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as answer:
        return int(answer.read())


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup") or not hasattr(os, "fork"), reason="Linux only")
def test_a_forked_worker_reading_every_path_copies_none_of_them() -> None:
    paths = [f"/datasets/train/images/{i:012d}.jpg" for i in range(200_000)]
    order = np.random.default_rng(0).permutation(len(paths))
    as_list = _private_growth_reading_all(paths, order)
    packed = _private_growth_reading_all(PackedStrings.pack(paths), order)
    assert as_list > 10_000  # the list's string objects are copied page by page: the measurement sees copies
    assert packed < 1_000, f"the child copied {packed} kB of packed paths"
