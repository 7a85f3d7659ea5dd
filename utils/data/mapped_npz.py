"""Cache files as .npz: written atomically, read back as read-only memory maps that a node's processes share."""

from __future__ import annotations

import io
import mmap
import os
import struct
import tempfile
import zipfile
from pathlib import Path

import numpy as np

LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: signature, ..., name length, extra length


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` to `path` as an uncompressed, pickle-free .npz: a temporary sibling, then a rename.

    mkstemp names are unique, so the local main ranks of several nodes may write the same file in
    a shared folder at once; readers see the old file or the new one, never half of one. The file
    is made readable by everyone (other ranks may run as other users). Raises OSError.
    """
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_npz_mapped(path: Path) -> dict[str, np.ndarray]:
    """Return every array of an .npz that np.savez wrote, as read-only views of one memory map of the file.

    Nothing is read until used, and the pages are the page cache's: every rank and loader worker
    of a node that maps the same file shares one copy (np.load would give each process its own).
    A file replaced later stays mapped as it was. Raises ValueError for a compressed or foreign
    member (callers treat the file as absent) and OSError when it cannot be opened.
    """
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                raise ValueError(f"{path}: member {info.filename} is not a stored .npy array")
            signature, name_length, extra_length = LOCAL_HEADER.unpack_from(mapped, info.header_offset)
            if signature != b"PK\x03\x04":
                raise ValueError(f"{path}: member {info.filename} has no local header")
            start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
            arrays[info.filename[:-4]] = _mapped_array(mapped, start, info.file_size)
    return arrays


def _mapped_array(mapped: mmap.mmap, start: int, size: int) -> np.ndarray:
    """The .npy array stored at mapped[start:start + size], as a read-only view of the map."""
    header = io.BytesIO(mapped[start : start + min(size, 1 << 16)])
    version = np.lib.format.read_magic(header)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(header)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(header)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    if dtype.hasobject:
        raise ValueError("object arrays are not stored in caches")
    count = int(np.prod(shape, dtype=np.int64))
    array = np.frombuffer(mapped, dtype=dtype, count=count, offset=start + header.tell())
    return array.reshape(shape, order="F" if fortran_order else "C")
