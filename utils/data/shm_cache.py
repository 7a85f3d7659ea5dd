"""--cache shm: one copy per node of every resized training image, in a /dev/shm segment all local ranks fill and read.

Why: the RAM cache holds each rank's shard only, so a rank may only draw (and mosaic) images of
its shard. A segment in shared memory is mapped by every rank and DataLoader worker of the node
(the pages are the same physical pages, never copied), so every rank can read every image and
the sampler shuffles the whole dataset each epoch, while the node still holds the dataset once.
The file, its name, key and layout, and the rules for reusing or replacing one are in
shm_segment.py.

Who does what: the lowest rank of the ranks that see the same shm folder (the node's leader)
claims the segment (`claim_segment`). If it must be filled, every rank of the node stores a
disjoint slice of the images (a thread pool per rank), all ranks meet, and the leader marks the
segment complete. When any node cannot have a segment (too little room in the folder or in
memory, the folder missing, a segment held by another live run) every rank falls back to
`--cache ram` with one warning, so all ranks sample the same way.

Removal: the leader owns the segment and unlinks it when its training run ends normally
(`release`, so a script calling train.run again does not keep it), or when its process exits by
an exception, unless torchrun still has restarts left after a failure (TORCHELASTIC_MAX_RESTARTS
minus the job's start number, counted alike on every node): then the segment stays for the
restart to reuse. A process killed
outside Python (SIGKILL, os._exit) cannot clean up; the next run on the node with the same data
reuses or replaces what it left. Other ranks never unlink; an unlinked segment stays readable by
whoever still maps it, until they exit.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from utils.data.cache import GB, read_resized, resized_table
from utils.data.file_digest import mount_identity
from utils.data.shm_segment import (
    FORMAT_VERSION,
    HEADER,
    SHM_DIR,
    NodePlan,
    SegmentLayout,
    claim_segment,
    content_key,
    mark_complete,
    parse_header,
    segment_path,
)
from utils.distributed import DistContext, all_gather_objects, job_start_number
from utils.logs import tqdm_disabled

LOGGER = logging.getLogger(__name__)


def restarts_left(restart_count: int) -> int:
    """How many more times torchrun would restart the workers after a failure (0 outside torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count)
    except ValueError:
        return 0


@dataclass(frozen=True)
class FillJob:
    """What one rank stores into a new segment: every `step`-th image from `first` on."""

    path: Path
    layout: SegmentLayout
    image_files: Sequence[str]
    hw: np.ndarray
    offsets: np.ndarray
    img_size: int
    augment: bool
    first: int
    step: int


def fill_share(job: FillJob, num_threads: int, ctx: DistContext) -> str | None:
    """Decode, resize and write this rank's images into the segment; return None, or what went wrong.

    Written with pwrite rather than through a writable mapping: each thread writes its own
    disjoint bytes, and an error is an OSError here instead of a signal. An image that cannot be
    read keeps status 0 and is read from its file later.
    """
    slots = range(job.first, job.layout.num_items, job.step)
    try:
        fd = os.open(job.path, os.O_RDWR)
    except OSError as error:
        return f"rank {ctx.rank} cannot open {job.path}: {error.strerror}"

    def store(slot: int) -> None:
        image = read_resized(job.image_files[slot], job.img_size, job.augment)
        if image is None or image.shape != (*job.hw[slot], 3):
            return
        image = np.ascontiguousarray(image)
        if os.pwrite(fd, image, job.layout.data_offset + int(job.offsets[slot])) != image.nbytes:
            raise OSError(errno.EIO, "short write")
        os.pwrite(fd, b"\1", job.layout.status_offset + slot)  # only once its pixels are in place

    try:
        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            desc = f"Caching images (shm, {job.step} rank(s) of this node)"
            for _ in tqdm(pool.map(store, slots), total=len(slots), desc=desc, disable=tqdm_disabled(ctx)):
                pass
    except OSError as error:
        return f"rank {ctx.rank} cannot write {job.path}: {error.strerror}"
    finally:
        os.close(fd)
    return None


def open_shm_cache(
    image_files: Sequence[str],
    shapes_wh: np.ndarray,
    img_size: int,
    ctx: DistContext,
    num_threads: int = 8,
    augment: bool = False,
    directory: Path = SHM_DIR,
) -> ShmImageCache | None:
    """Give every rank the node's shared segment of all resized images; None on every rank to fall back to RAM.

    Every rank must call it with the same files (five small all-gathers). `shapes_wh`: (N, 2)
    (w, h) of every image after EXIF rotation; `augment` selects the resize of training (see
    `resize_long_side`). See the module doc for who fills, reuses, replaces and removes.
    """
    hw, offsets = resized_table(shapes_wh, img_size)
    layout = SegmentLayout(len(image_files), int(offsets[-1]))
    path = segment_path(image_files, img_size, augment, directory)
    identities = all_gather_objects(mount_identity(directory), ctx)
    peers = [rank for rank, identity in enumerate(identities) if identity == identities[ctx.rank]]
    is_leader = peers[0] == ctx.rank
    key = content_key(image_files, img_size, augment, ctx)
    plan = None
    if is_leader and identities[ctx.rank] is None:
        plan = NodePlan("ram", f"{directory} does not exist on rank {ctx.rank}")
    elif is_leader:
        try:
            plan = claim_segment(path, layout, key, ctx)
        except OSError as error:  # e.g. a folder this user may not write: the other ranks wait for this answer
            plan = NodePlan("ram", f"cannot use {path}: {error}")
    plans: list[NodePlan | None] = all_gather_objects(plan, ctx)
    action = plans[peers[0]].action
    refusal = next((p.reason for p in plans if p is not None and p.action == "ram"), None)
    if refusal is None and any(p is not None and p.action == "fill" for p in plans):  # the same on every rank
        job = FillJob(path, layout, image_files, hw, offsets, img_size, augment, peers.index(ctx.rank), len(peers))
        problem = fill_share(job, num_threads, ctx) if action == "fill" else None
        refusal = next((p for p in all_gather_objects(problem, ctx) if p), None)  # also the barrier before marking
        if refusal is None and is_leader and action == "fill":
            mark_complete(path)
    if refusal is not None:
        if is_leader and action != "ram":
            path.unlink(missing_ok=True)  # claimed by this node, of no use now
        if ctx.is_main:
            LOGGER.warning(f"--cache shm: {refusal}; caching each rank's shard in RAM instead (--cache ram)")
        return None
    # The job's start number, not this agent's own restart count: an agent whose workers did not fail counts fewer
    # restarts, and would keep the segment for a restart the job no longer has.
    starts = job_start_number(ctx)
    cache = ShmImageCache(path, layout, hw, offsets, image_files, is_owner=is_leader, restart_count=starts)
    _report(cache, action, len(peers), len(set(identities)), ctx)
    return cache


def _report(cache: ShmImageCache, action: str, node_ranks: int, nodes: int, ctx: DistContext) -> None:
    """Rank 0: one line on what is cached and how it got there; one warning for images that could not be read."""
    if not ctx.is_main:
        return
    how = "reused from an earlier start, no refill" if action == "reuse" else f"filled by its {node_ranks} rank(s)"
    LOGGER.info(
        f"--cache shm: {len(cache)} images ({cache.nbytes / GB:.2f} GB) in {cache.path}, {how}; one copy per node "
        f"({nodes} node(s)), every rank samples the whole dataset"
    )
    missing = np.flatnonzero(cache.status == 0)
    if len(missing):
        LOGGER.warning(
            f"--cache shm: {len(missing)} image(s) could not be cached (first: {cache.image_files[missing[0]]}); "
            "they are read from disk"
        )


class ShmImageCache:
    """Read-only view of a node's shared-memory segment of every resized image (BGR uint8, long side img_size).

    The same interface as `ImageCache` (`get`, `in`, `len`, `nbytes`, `mode`), over every dataset
    index. The segment is mapped read-only and shared: ranks and forked DataLoader workers read
    the same physical pages. Pickling (spawned workers) drops the mapping and the copy maps the
    file again by name, so no pixel is ever serialised. Built by `open_shm_cache`; the node
    leader's instance owns the segment and removes it at exit (see the module doc).
    """

    mode = "shm"

    def __init__(
        self,
        path: Path,
        layout: SegmentLayout,
        hw: np.ndarray,
        offsets: np.ndarray,
        image_files: Sequence[str],
        is_owner: bool,
        restart_count: int = 0,
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.hw, self.offsets = hw, offsets
        self.image_files = image_files
        self.indices = np.arange(layout.num_items, dtype=np.int64)
        self.restart_count = restart_count
        self.status = np.zeros(layout.num_items, dtype=np.uint8)
        self.buffer = np.zeros(0, dtype=np.uint8)
        self._file_id = (0, 0)
        self._map()
        self._owner_pid = os.getpid() if is_owner else None
        if is_owner:
            atexit.register(self._release_at_exit)

    def _map(self) -> None:
        """Map the segment read-only; raise ValueError when the file is not the segment this cache expects."""
        with open(self.path, "rb") as file:
            header = parse_header(file.read(HEADER.size), self.path)
            stat = os.fstat(file.fileno())
            expected = (FORMAT_VERSION, self.layout.num_items, self.layout.data_bytes, self.layout.total_bytes)
            if (header.version, header.num_items, header.data_bytes, stat.st_size) != expected:
                raise ValueError(f"{self.path} is not the cache segment of these images")
            mapping = mmap.mmap(file.fileno(), self.layout.total_bytes, access=mmap.ACCESS_READ)
        self._file_id = (stat.st_dev, stat.st_ino)
        whole = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive; it is unmapped with the last view
        self.status = whole[self.layout.status_offset : self.layout.status_offset + self.layout.num_items]
        self.buffer = whole[self.layout.data_offset : self.layout.total_bytes]

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("status", "buffer")}
        state["_owner_pid"] = None  # a copy never removes the segment
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.status = np.zeros(self.layout.num_items, dtype=np.uint8)
        self.buffer = np.zeros(0, dtype=np.uint8)
        try:
            self._map()
        except (OSError, ValueError) as error:
            LOGGER.warning(f"--cache shm: cannot map {self.path} in this process ({error}); reading images from disk")

    @property
    def nbytes(self) -> int:
        """Bytes of image data the segment holds (the node's one copy)."""
        return int(np.diff(self.offsets)[self.status.astype(bool)].sum())

    def __contains__(self, index: int) -> bool:
        return bool(0 <= index < len(self.status) and self.status[index])

    def __len__(self) -> int:
        return int(np.count_nonzero(self.status))

    def get(self, index: int) -> np.ndarray | None:
        """Return item `index`'s (h, w, 3) BGR image as a read-only view of the segment, or None if not cached."""
        if index not in self:
            return None
        height, width = self.hw[index]
        return self.buffer[self.offsets[index] : self.offsets[index + 1]].reshape(height, width, 3)

    @property
    def is_owner(self) -> bool:
        """Whether this process removes the segment (the node leader that built this instance)."""
        return self._owner_pid == os.getpid()

    def release(self, keep: bool = False) -> None:
        """Stop serving images; the owner also unlinks the segment unless `keep`.

        Only the file this cache mapped is unlinked, never a newer one at the same path.
        Mappings elsewhere stay readable until those processes drop them.
        """
        if self.is_owner and not keep:
            try:
                stat = os.stat(self.path)
                if (stat.st_dev, stat.st_ino) == self._file_id:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.is_owner:
            atexit.unregister(self._release_at_exit)
            self._owner_pid = None
        self.status = np.zeros(self.layout.num_items, dtype=np.uint8)
        self.buffer = np.zeros(0, dtype=np.uint8)

    def _release_at_exit(self) -> None:
        """At interpreter exit: remove the segment unless this process fails and torchrun will restart it.

        An uncaught exception leaves `sys.last_value` set before atexit handlers run; a normal end,
        sys.exit (one-line errors, preemption) and an exception with no restart left remove it.
        """
        if not self.is_owner:
            return
        left = restarts_left(self.restart_count)
        if getattr(sys, "last_value", None) is not None and left > 0:
            LOGGER.warning(f"--cache shm: keeping {self.path} for torchrun's restart ({left} left), which reuses it")
            self.release(keep=True)
            return
        self.release()
