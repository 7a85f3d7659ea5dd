"""Per-rank image shards, image decoding/resizing, and the RAM/disk cache of resized images for this rank's shard.

`--cache shm` (one copy per node in shared memory, every rank reads every image) is in shm_cache.py.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from utils.data.image_check import decodes_without_end_marker
from utils.distributed import DistContext
from utils.logs import tqdm_disabled
from utils.memory import memory_headroom

LOGGER = logging.getLogger(__name__)

CACHE_MODES = ("auto", "none", "ram", "shm", "disk")
MEMORY_SAFETY_MARGIN = 0.1  # keep this fraction of available memory free for the rest of training
AUTO_CACHE_FRACTION = 0.1  # "auto" caches in RAM only when the node's shards need at most this much of it
GB = 1 << 30
JPEG_START, JPEG_END = b"\xff\xd8", b"\xff\xd9"  # start- and end-of-image markers


def rank_shard(num_items: int, ctx: DistContext, seed: int) -> np.ndarray:
    """Return the dataset indices this rank owns, for caching and for sampling.

    All ranks draw the same permutation from `seed` and each keeps every
    `world_size`-th entry from its rank on, so shards are disjoint, cover every
    item and differ in length by at most one. The dataset caches only these
    images and the sampler draws only from them; both call this function so
    they cannot disagree. Returns a sorted (n,) int64 array.
    """
    permutation = np.random.default_rng(seed).permutation(num_items)
    return np.sort(permutation[ctx.rank :: ctx.world_size]).astype(np.int64)


def resized_hw(height: int, width: int, img_size: int | tuple[int, int]) -> tuple[int, int]:
    """Return (h, w) after scaling so the long side equals `img_size` (aspect ratio kept, at least 1 px).

    `img_size` (h, w): scaled to fit that box instead (one side equals the box's, the other fits).
    """
    box_h, box_w = (img_size, img_size) if isinstance(img_size, int) else img_size
    ratio = min(box_h / height, box_w / width)  # the same float as img_size / max(height, width) for a square
    return max(1, round(height * ratio)), max(1, round(width * ratio))


def resized_table(shapes_wh: np.ndarray, img_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the resized (h, w) of each image, (N, 2) int64, and its byte offsets in one packed buffer, (N + 1,) int64.

    `shapes_wh`: (N, 2) original (w, h). Image i occupies bytes offsets[i]:offsets[i + 1] as
    (h, w, 3) uint8; offsets[-1] is the total. The RAM and shared-memory caches both lay out
    their buffers with it, so a size computed here is the size they hold.
    """
    sizes = [resized_hw(int(h), int(w), img_size) for w, h in np.asarray(shapes_wh).reshape(-1, 2)]
    hw = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    offsets = np.zeros(len(hw) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(hw[:, 0] * hw[:, 1] * 3)
    return hw, offsets


def resize_long_side(image: np.ndarray, img_size: int | tuple[int, int], augment: bool = False) -> np.ndarray:
    """Resize an HxWx3 image so its long side equals `img_size` (or so it fits an (h, w) box: resized_hw).

    Enlarging uses INTER_LINEAR. Shrinking uses INTER_AREA (no aliasing) for evaluation, and
    INTER_LINEAR when `augment`: about 10x faster (1.4 ms vs 0.14 ms for 450x400 -> 224), and
    training's random affine resamples the image again anyway.
    """
    height, width = image.shape[:2]
    new_h, new_w = resized_hw(height, width, img_size)
    if (new_h, new_w) == (height, width):
        return image
    interpolation = cv2.INTER_AREA if new_h < height and not augment else cv2.INTER_LINEAR
    return cv2.resize(image, (new_w, new_h), interpolation=interpolation)


def opencv_can_name(path: str | os.PathLike) -> bool:
    """Whether OpenCV's own file functions (VideoCapture, VideoWriter, imwrite) can take `path`.

    They pass it to C++ as UTF-8; a name that is not valid UTF-8 (Python holds it with surrogate
    escapes) crashes the process there instead of failing.
    """
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_image(path: str) -> np.ndarray | None:
    """Decode an image file as HxWx3 BGR uint8 with its EXIF orientation applied; None if unreadable.

    Python reads the bytes and cv2.imdecode decodes them: cv2.imread passes the name to C++ as
    UTF-8, and a file name that is not valid UTF-8 (Python holds it with surrogate escapes)
    crashes the process there instead of failing. A JPEG without its end-of-image marker whose
    image data is complete, which the label scan keeps, is decoded with the marker appended:
    OpenCV 5 returns None for it where 4.x only warned. A truncated one stays None.
    """
    try:
        data = np.fromfile(path, dtype=np.uint8)
        image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
        if image is None and data[:2].tobytes() == JPEG_START and decodes_without_end_marker(path):
            image = cv2.imdecode(np.concatenate([data, np.frombuffer(JPEG_END, np.uint8)]), cv2.IMREAD_COLOR)
        return image
    except (OSError, ValueError, cv2.error):  # some truncated files make the decoder raise instead of return None
        return None


def read_resized(path: str, img_size: int, augment: bool = False) -> np.ndarray | None:
    """Decode an image as BGR (EXIF orientation applied) resized to `img_size`; None if unreadable."""
    image = read_image(path)
    return None if image is None else resize_long_side(image, img_size, augment)


def available_memory_bytes() -> int:
    """Return the bytes this process may still allocate: the least of MemAvailable, the cgroup limit and RLIMIT_AS.

    See utils/memory.py; a container's limit is invisible in /proc/meminfo.
    """
    headroom = memory_headroom()
    if headroom.limited_by != "MemAvailable":
        LOGGER.debug(f"memory headroom {headroom.available / GB:.2f} GB, limited by {headroom.limited_by}")
    return headroom.available


def disk_cache_path(image_path: str, img_size: int, augment: bool) -> Path:
    """Return the .npy file that holds the image resized for `img_size`: next to it, `x.jpg.640.npy`.

    The whole name, not the stem: x.jpg and x.png in one folder would otherwise share x.npy, and
    the one cached second would train on the other's pixels. The size, and the resize of evaluation
    (`-eval`: INTER_AREA, see resize_long_side), are in the name: runs at other sizes on the same images
    would otherwise rewrite each other's files while they train.
    """
    path = Path(image_path)
    return path.with_name(f"{path.name}.{img_size}{'' if augment else '-eval'}.npy")


class ImageCache:
    """Resized images (long side = img_size, BGR uint8) for the given dataset indices, in RAM or on disk.

    mode "ram": one contiguous uint8 buffer sized exactly for the shard plus an offsets/(h, w)
    table, so forked DataLoader workers share its pages (no per-image Python objects for
    reference counting to copy). Skipped with one warning when the shard, times the ranks on
    this node (they all cache at once), does not fit in available memory.
    mode "auto": "ram" when the shards of this node's ranks need at most AUTO_CACHE_FRACTION of
    the available memory (small datasets: decoding then stops competing with training for the
    CPUs), else nothing is cached; either way one info line says which.
    mode "disk": a .npy per image next to it, written atomically with the image's modification
    time, reused when present with that time and the right shape. Every rank fills its own
    indices with a thread pool, in parallel with the others. An image that cannot be read or
    written is left out (counted, warned) and read from its file later. `shapes_wh`: (N, 2) (w, h)
    of every dataset image after EXIF rotation.
    """

    def __init__(
        self,
        image_files: Sequence[str],
        shapes_wh: np.ndarray,
        indices: np.ndarray,
        img_size: int,
        mode: str,
        ctx: DistContext,
        num_threads: int = 8,
        augment: bool = False,
    ) -> None:
        if mode not in ("auto", "ram", "disk"):
            raise ValueError(f"cache mode must be 'auto', 'ram' or 'disk', got '{mode}'")
        self.mode = "ram" if mode == "auto" else mode
        self.image_files = image_files
        self.img_size = img_size
        self.augment = augment  # resize as the dataset does (see resize_long_side)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.hw, self.offsets = resized_table(np.asarray(shapes_wh)[self.indices], img_size)
        self.slot_of = np.full(len(shapes_wh), -1, dtype=np.int64)  # dataset index -> slot, -1 = not held
        self.is_filled = np.zeros(len(self.indices), dtype=bool)
        self.buffer = np.zeros(0, dtype=np.uint8)
        fits = self._fits_automatically(ctx) if mode == "auto" else mode == "disk" or self._fits_in_memory(ctx)
        if not fits:
            self.indices = self.indices[:0]
            return
        if self.mode == "ram":
            self.buffer = np.empty(int(self.offsets[-1]), dtype=np.uint8)
        self._fill(ctx, num_threads)

    @property
    def nbytes(self) -> int:
        """Bytes of image data this rank holds (RAM buffer, or the .npy payloads on disk)."""
        return int(np.diff(self.offsets)[self.is_filled].sum())

    def __contains__(self, index: int) -> bool:
        slot = self.slot_of[index]
        return bool(slot >= 0 and self.is_filled[slot])

    def __len__(self) -> int:
        return int(self.is_filled.sum())

    def get(self, index: int) -> np.ndarray | None:
        """Return the cached (h, w, 3) BGR image of dataset item `index`, or None when it is not cached.

        In RAM mode the array is a view into the shared buffer: copy it before changing it.
        """
        if index not in self:
            return None
        slot = self.slot_of[index]
        height, width = self.hw[slot]
        if self.mode == "ram":
            return self.buffer[self.offsets[slot] : self.offsets[slot + 1]].reshape(height, width, 3)
        image = np.load(self._npy(index), allow_pickle=False)
        return image if image.shape == (height, width, 3) else None  # a file replaced since: read the image

    def _npy(self, index: int) -> Path:
        """The disk-mode .npy of dataset item `index`."""
        return disk_cache_path(self.image_files[index], self.img_size, self.augment)

    def _fits_automatically(self, ctx: DistContext) -> bool:
        """`--cache auto`: whether this node's shards need at most AUTO_CACHE_FRACTION of available memory."""
        needed = int(self.offsets[-1]) * max(ctx.local_world_size, 1)
        available = available_memory_bytes()
        fits = needed <= AUTO_CACHE_FRACTION * available
        if ctx.is_main:
            verdict = "caching them in RAM" if fits else f"over {AUTO_CACHE_FRACTION:.0%}: reading from disk"
            LOGGER.info(
                f"--cache auto: the node's {ctx.local_world_size} rank(s) need {needed / GB:.2f} GB for their "
                f"resized images of {available / GB:.1f} GB available; {verdict} (--cache none|ram to choose)"
            )
        return fits

    def _fits_in_memory(self, ctx: DistContext) -> bool:
        """Return whether this node has room for every local rank's shard; warn once with the numbers if not."""
        needed = int(self.offsets[-1]) * max(ctx.local_world_size, 1)
        available = available_memory_bytes()
        if needed * (1 + MEMORY_SAFETY_MARGIN) < available:
            return True
        LOGGER.warning(
            f"RAM image cache skipped: {len(self.indices)} images/rank x {ctx.local_world_size} ranks on this node "
            f"need {needed / GB:.2f} GB (+{MEMORY_SAFETY_MARGIN:.0%} margin) but only {available / GB:.2f} GB "
            "is available; reading images from disk instead"
        )
        return False

    def _store(self, slot: int) -> str | None:
        """Fill one slot (decode + resize into the buffer, or into a .npy); None once cached, else why not."""
        path = self.image_files[self.indices[slot]]
        expected = (*self.hw[slot], 3)
        if self.mode == "disk":
            try:  # before the decode: an image replaced meanwhile leaves a .npy that the next run redoes
                image_mtime_ns = os.stat(path).st_mtime_ns
            except OSError:
                return "unreadable"
            if _is_current_npy(self._npy(self.indices[slot]), image_mtime_ns, expected):
                return None
        image = read_resized(path, self.img_size, self.augment)
        if image is None:
            return "unreadable"
        if image.shape != expected:
            return f"decoded as {image.shape[1]}x{image.shape[0]}, the label scan found {expected[1]}x{expected[0]}"
        if self.mode == "ram":
            self.buffer[self.offsets[slot] : self.offsets[slot + 1]] = image.reshape(-1)
            return None
        return _write_npy(self._npy(self.indices[slot]), image, image_mtime_ns)

    def _fill(self, ctx: DistContext, num_threads: int) -> None:
        """Fill every slot with a thread pool (decoding releases the GIL), then log what this rank holds."""
        desc = f"Caching images ({self.mode})"
        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            results = pool.map(self._store, range(len(self.indices)))
            reasons = list(tqdm(results, total=len(self.indices), desc=desc, disable=tqdm_disabled(ctx)))
            self.is_filled[:] = [reason is None for reason in reasons]
        self.slot_of[self.indices] = np.arange(len(self.indices))
        failed = int((~self.is_filled).sum())
        if failed:
            slot = int(np.flatnonzero(~self.is_filled)[0])
            first = f"{self.image_files[self.indices[slot]]}: {reasons[slot]}"
            LOGGER.warning(
                f"rank {ctx.rank}: {failed} image(s) could not be cached (first: {first}); they are read from disk"
            )
        node_gb = self.nbytes * max(ctx.local_world_size, 1) / GB
        message = (
            f"rank {ctx.rank} cached {len(self)} images ({self.nbytes / GB:.2f} GB, {self.mode}); "
            f"about {node_gb:.2f} GB over the {ctx.local_world_size} rank(s) of this node"
        )
        (LOGGER.info if ctx.is_main else LOGGER.debug)(message)


def _is_current_npy(target: Path, image_mtime_ns: int, expected_shape: tuple[int, ...]) -> bool:
    """Return whether the .npy `target` exists, carries its image's modification time and holds `expected_shape`.

    `_write_npy` stamps each .npy with its image's time, so any other time means the image was
    replaced, also by an older file (an archive unpacked or a folder synced with their times kept).
    """
    try:
        if target.stat().st_mtime_ns != image_mtime_ns:
            return False
        return np.load(target, mmap_mode="r", allow_pickle=False).shape == expected_shape  # reads the header only
    except (OSError, ValueError, EOFError):
        return False


def _write_npy(target: Path, image: np.ndarray, image_mtime_ns: int) -> str | None:
    """Save `image` to `target` atomically (unique temp file, then rename) with its image's modification time.

    Returns None, or why the folder refused.
    """
    tmp: Path | None = None
    try:
        handle, tmp_name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp", dir=target.parent)
        tmp = Path(tmp_name)
        with os.fdopen(handle, "wb") as file:
            np.save(file, image, allow_pickle=False)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the other ranks' users must read it
        os.utime(tmp, ns=(time.time_ns(), image_mtime_ns))  # what _is_current_npy compares
        os.replace(tmp, target)
        return None
    except OSError as error:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        return f"cannot write {target} ({error.strerror or error})"
