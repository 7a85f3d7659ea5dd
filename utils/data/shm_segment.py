"""The /dev/shm segment file of `--cache shm`: its name, key, layout and header, and how a node's leader claims one.

Segment file `<directory>/yolo-shm-cache-<uid>-<digest>`: the digest covers the image paths, the
image size and the resize mode, so a later run on the same data finds it by name. Layout:
  header (HEADER_BYTES): magic, format version, state (filling / complete), key, owner (pid and
      process start time of the rank that owns it), item count, data bytes
  status (one byte per image, page padded): 1 once the image is stored, 0 if it could not be read
  data: the images as (h, w, 3) BGR uint8, packed in dataset order (`resized_table` gives offsets)
The key is a digest of the paths, every file's size and mtime, the image size and FORMAT_VERSION.

`claim_segment` (the node's leader only) reuses a complete segment with the same key whose owner
is gone (an elastic restart of this run, or a run killed earlier: no refill), leaves alone one
whose owner is alive (another run), replaces a stale one (another key, or left incomplete by a
process that is gone) with a one-line warning, and otherwise creates and reserves a new one when
the folder and the memory have room for it.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.data.cache import GB, MEMORY_SAFETY_MARGIN, available_memory_bytes
from utils.data.file_digest import stat_digest
from utils.distributed import DistContext

LOGGER = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "yolo-shm-cache-"
FORMAT_VERSION = 1
MAGIC = b"YOLOSHM\0"
HEADER_BYTES = 4096  # one page: the status table and the data start page aligned
# magic, version, state, key (sha256), owner pid, owner start time (clock ticks after boot), items, data bytes
HEADER = struct.Struct("<8sII32sQQQQ")
FILLING, COMPLETE = 0, 1
STATE_OFFSET = 12  # byte offset of `state` in HEADER


@dataclass(frozen=True)
class SegmentLayout:
    """Where the parts of a segment of `num_items` images totalling `data_bytes` pixels lie."""

    num_items: int
    data_bytes: int

    @property
    def status_offset(self) -> int:
        """Byte offset of the per-image status table."""
        return HEADER_BYTES

    @property
    def data_offset(self) -> int:
        """Byte offset of the first image (page aligned)."""
        return HEADER_BYTES + -(-self.num_items // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def total_bytes(self) -> int:
        """Size of the whole segment file."""
        return self.data_offset + self.data_bytes


@dataclass(frozen=True)
class SegmentHeader:
    """The decoded header of a segment file."""

    version: int
    state: int
    key: bytes
    owner_pid: int
    owner_start: int
    num_items: int
    data_bytes: int


@dataclass(frozen=True)
class NodePlan:
    """A node leader's decision, gathered by every rank: "fill", "reuse", or "ram" (no segment, with `reason`)."""

    action: str
    reason: str = ""


def _name_digest(image_files: Sequence[str], img_size: int, augment: bool) -> Any:
    """sha256 over the format version, image size, resize mode and every path (a hashlib object)."""
    digest = hashlib.sha256(f"{FORMAT_VERSION}:{img_size}:{int(augment)}".encode())
    for path in image_files:
        digest.update(os.fsencode(path) + b"\n")  # fsencode: names need not be UTF-8
    return digest


def segment_path(image_files: Sequence[str], img_size: int, augment: bool, directory: Path = SHM_DIR) -> Path:
    """Return the segment file of these images at this size: the same name for every run on the same data."""
    digest = _name_digest(image_files, img_size, augment).hexdigest()[:24]
    return Path(directory) / f"{SEGMENT_PREFIX}{os.getuid()}-{digest}"


def content_key(image_files: Sequence[str], img_size: int, augment: bool, ctx: DistContext) -> bytes:
    """Return the 32-byte key a segment must carry: the name's digest plus every file's size and mtime.

    Every rank must call it with the same files: the ranks of a node split the stat calls
    (file_digest.stat_digest), and the node's leader checks or writes the key.
    """
    name = _name_digest(image_files, img_size, augment).digest()
    return stat_digest([image_files], name, ctx, with_names=False)  # the names are in `name` already


def room_for_segment(directory: Path) -> int:
    """Bytes a new segment may take: the least of the folder's free space and the memory headroom.

    /dev/shm is memory (tmpfs): its pages count against the machine's and the job's cgroup memory.
    """
    stat = os.statvfs(directory)
    return min(stat.f_bavail * stat.f_frsize, available_memory_bytes())


def process_start_time(pid: int) -> int | None:
    """Return when process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22); None if it is gone.

    Together with the pid it names a process for good: a recycled pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def write_header(fd: int, layout: SegmentLayout, key: bytes, state: int) -> None:
    """Write the header of a segment open as `fd`, with this process as its owner."""
    pid = os.getpid()
    header = HEADER.pack(
        MAGIC, FORMAT_VERSION, state, key, pid, process_start_time(pid) or 0, layout.num_items, layout.data_bytes
    )
    os.pwrite(fd, header, 0)


def read_header(path: Path) -> SegmentHeader | None:
    """Return the header of segment `path`; None when the file is missing, raise ValueError when it is not ours."""
    try:
        with open(path, "rb") as file:
            return parse_header(file.read(HEADER.size), path)
    except FileNotFoundError:
        return None


def parse_header(raw: bytes, path: Path) -> SegmentHeader:
    """Decode the first HEADER.size bytes of segment `path`; raise ValueError when they are not a segment header."""
    if len(raw) < HEADER.size or not raw.startswith(MAGIC):
        raise ValueError(f"{path} is not a cache segment")
    return SegmentHeader(*HEADER.unpack(raw[: HEADER.size])[1:])


def _verdict(path: Path, layout: SegmentLayout, key: bytes) -> tuple[str, str]:
    """Judge the file at `path`: ("missing" | "reusable" | "busy" | "stale", why)."""
    try:
        header = read_header(path)
    except ValueError:
        return "stale", "not a segment of this format"
    if header is None:
        return "missing", ""
    start = process_start_time(header.owner_pid)
    owner_alive = start is not None and start == header.owner_start
    if owner_alive and header.owner_pid != os.getpid():
        return "busy", f"{path} belongs to live process {header.owner_pid} (another training run on this node)"
    if header.version != FORMAT_VERSION or header.key != key or path.stat().st_size != layout.total_bytes:
        return "stale", "made for other image files, sizes or times, or another image size"
    if header.state != COMPLETE:
        return "stale", "left incomplete by a process that is gone"
    return "reusable", ""


def _create(path: Path, layout: SegmentLayout, key: bytes) -> None:
    """Create segment `path` and reserve all its pages now; raise OSError (nothing left behind) if it cannot.

    posix_fallocate makes a full tmpfs fail here with ENOSPC; a merely truncated file would
    instead kill a rank with SIGBUS in the middle of filling it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
        write_header(fd, layout, key, FILLING)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def claim_segment(path: Path, layout: SegmentLayout, key: bytes, ctx: DistContext) -> NodePlan:
    """Node leader: reuse, replace or create segment `path`, and say how the node goes on (see the module doc)."""
    verdict, why = _verdict(path, layout, key)
    if verdict == "busy":
        return NodePlan("ram", why)
    if verdict == "reusable":
        fd = os.open(path, os.O_RDWR)
        try:
            write_header(fd, layout, key, COMPLETE)  # this process owns it now
        finally:
            os.close(fd)
        return NodePlan("reuse")
    if verdict == "stale":
        LOGGER.warning(f"rank {ctx.rank}: --cache shm: replacing stale segment {path} ({why})")
        path.unlink(missing_ok=True)
    room = room_for_segment(path.parent)
    if layout.total_bytes * (1 + MEMORY_SAFETY_MARGIN) > room:
        return NodePlan(
            "ram",
            f"{layout.num_items} resized images need {layout.total_bytes / GB:.2f} GB "
            f"(+{MEMORY_SAFETY_MARGIN:.0%} margin) but {path.parent} and memory have room for {room / GB:.2f} GB",
        )
    try:
        _create(path, layout, key)
    except FileExistsError:
        return NodePlan("ram", f"{path} was created by another run at the same moment")
    except OSError as error:
        return NodePlan("ram", f"cannot reserve {layout.total_bytes / GB:.2f} GB for {path}: {error.strerror}")
    return NodePlan("fill")


def mark_complete(path: Path) -> None:
    """Set the segment's state to complete (node leader, after every rank of the node has filled its share)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<I", COMPLETE), STATE_OFFSET)
    finally:
        os.close(fd)
