"""Tests for utils/data/mapped_npz.py: atomic .npz writes read back as shared read-only memory maps."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from utils.data.mapped_npz import load_npz_mapped, save_npz_atomic


def test_every_array_reads_back_equal_as_a_read_only_map(tmp_path: Path) -> None:
    arrays = {
        "points": np.arange(20, dtype=np.float32).reshape(10, 2),
        "offsets": np.arange(5, dtype=np.int64),
        "names": np.array(["a", "bcd"]),
        "scalar": np.array(3),
        "empty": np.zeros((0, 5), np.float32),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    }
    path = tmp_path / "x.cache"
    save_npz_atomic(path, arrays)
    assert [p.name for p in tmp_path.iterdir()] == ["x.cache"]  # no temporary file left behind
    loaded = load_npz_mapped(path)
    assert loaded.keys() == arrays.keys()
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(loaded[name], array)
        assert not loaded[name].flags.writeable
    save_npz_atomic(path, {"points": np.zeros(3)})  # replacing the file leaves the mapped arrays as they were
    np.testing.assert_array_equal(loaded["points"], arrays["points"])


def test_compressed_members_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "z.npz"
    np.savez_compressed(path, a=np.arange(3))
    with pytest.raises(ValueError, match="not a stored .npy"):
        load_npz_mapped(path)
    with pytest.raises(zipfile.BadZipFile):
        (tmp_path / "bad").write_bytes(b"not a zip")
        load_npz_mapped(tmp_path / "bad")
