"""Label scan across ranks: verify in rounds split between ranks, join the parts, check ranks list the same files."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import queue
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from tqdm import tqdm

from utils.data.file_digest import stat_digest
from utils.data.image_files import ImageFiles, image_to_label_paths
from utils.data.labels import (
    CACHE_VERSION,
    STATUSES,
    LabelIndex,
    label_cache_path,
    load_label_cache,
    save_label_cache,
    verify_files,
)
from utils.data.packed_strings import PackedStrings
from utils.data.scan_report import check_class_ids, check_labelled, report_scan
from utils.distributed import DistContext, all_gather_objects, barrier, local_cpu_share
from utils.errors import ConfigError
from utils.logs import tqdm_disabled

LOGGER = logging.getLogger(__name__)

# Files each rank verifies per round of a scan; each round ends in one all-gather of the packed results, so a
# collective waits for one round (seconds, even at 50 ms per file on a slow network file system), never the scan.
SCAN_ROUND_FILES = 2048
MAX_RANKS_NAMED = 3  # ranks named in a "differs across ranks" error besides rank 0
CHUNK_FILES = 32  # files per job sent to a worker process: small enough to balance a round, large enough to batch
# A rank starts worker processes only when it verifies at least this many files: a worker takes ~0.2 s to start
# (Python, numpy and PIL imports), and on 2 CPUs, at 0.28 ms per file (640-1280 px JPEG, a few boxes), this
# many files are where 2 workers start to win it back (at 1000 files: 3140 images/s against 3590 in-process).
MIN_POOL_FILES = 1500
REPO_ROOT = Path(__file__).resolve().parents[2]  # where a worker finds the `utils` package
WORKER_COMMAND = "from utils.data.labels import serve_verification; serve_verification()"
WORKER_EXIT_SECONDS = 10  # how long a worker may take to exit once its stdin is closed before it is killed


def scan_pool_size(ctx: DistContext) -> int:
    """Return how many processes one rank verifies files with: its share of the CPUs, at least 1.

    CPUs are those this process may run on (affinity: SLURM, taskset), divided among the ranks
    on this node, which all scan at the same time. 1 means verifying in the rank's own process.
    """
    return max(1, local_cpu_share(ctx))


def scan_workers(num_files: int, ctx: DistContext, max_workers: int | None = None) -> int:
    """Return how many worker processes each rank starts to verify `num_files` files; 0 or 1: none.

    scan_pool_size (capped at `max_workers` when given) once a rank's share reaches
    MIN_POOL_FILES, else 0: for fewer files the workers' start-up costs about what they save,
    and the rank verifies its files itself.
    """
    share = -(-num_files // ctx.world_size)  # the most files one rank verifies in the whole scan
    if share < MIN_POOL_FILES:
        return 0
    return scan_pool_size(ctx) if max_workers is None else min(max_workers, scan_pool_size(ctx))


class VerifierPool:
    """Worker processes that verify runs of image/label files (labels.verify_files); with none, this process does.

    A worker is a fresh interpreter running labels.serve_verification, which imports only
    numpy, PIL and yaml (~0.2 s to start), launched by subprocess (fork and exec at once, safe in a
    process that runs torch and gloo threads) rather than multiprocessing: a 'spawn' or
    'forkserver' child first imports the main script (train.py: torch, 1.5-2.5 s of CPU per
    worker on this machine; Python 3.11's forkserver does not preload it), and a 'fork' child
    would be a copy of those threads' process. Jobs of CHUNK_FILES files go to whichever worker
    is idle, from one thread per worker (waiting on a pipe releases the GIL), and come back in
    order. Use it as a context manager: leaving closes the workers' stdin, waits for them to
    finish their job and exit, and kills any still running after WORKER_EXIT_SECONDS.
    """

    def __init__(self, num_workers: int) -> None:
        self.workers: list[subprocess.Popen[bytes]] = []
        self.idle: queue.SimpleQueue[subprocess.Popen[bytes]] = queue.SimpleQueue()
        self.threads: ThreadPoolExecutor | None = None
        if num_workers < 2:
            return  # one worker would do the same serial work after its start-up
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path}
        try:
            for _ in range(num_workers):
                command = [sys.executable, "-c", WORKER_COMMAND]
                self.workers.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
        except BaseException:
            self.close()  # do not leave the workers started so far behind
            raise
        for worker in self.workers:
            self.idle.put(worker)
        self.threads = ThreadPoolExecutor(num_workers, thread_name_prefix="label-scan")

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @property
    def num_workers(self) -> int:
        """Worker processes in use; 0 when files are verified in this process."""
        return len(self.workers)

    def verify(self, image_files: Sequence[str], read_labels: bool) -> LabelIndex:
        """Return exactly verify_files(image_files, read_labels), computed in jobs of CHUNK_FILES files."""
        if self.threads is None:
            return verify_files(image_files, read_labels)
        chunks = [image_files[i : i + CHUNK_FILES] for i in range(0, len(image_files), CHUNK_FILES)]
        job = functools.partial(self._verify_chunk, read_labels=read_labels)
        return concatenate_indices(list(self.threads.map(job, chunks)))

    def _verify_chunk(self, image_files: Sequence[str], read_labels: bool) -> LabelIndex:
        """Send one job to an idle worker and return its answer; a worker that stopped is a RuntimeError."""
        worker = self.idle.get()  # as many threads as workers: one is idle whenever a thread gets here
        assert worker.stdin is not None and worker.stdout is not None  # both are pipes
        try:
            pickle.dump((list(image_files), read_labels), worker.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            worker.stdin.flush()
            return pickle.load(worker.stdout)  # our own worker's answer: trusted data
        except (EOFError, OSError, pickle.UnpicklingError) as error:
            worker.kill()  # no-op if it has exited; its exit status says how it ended
            raise RuntimeError(
                f"label scan worker {worker.pid} stopped (exit status {worker.wait()}) while verifying "
                f"{len(image_files)} files from {image_files[0]}; its traceback, if any, is above"
            ) from error
        finally:
            self.idle.put(worker)

    def close(self) -> None:
        """Stop the workers: they exit when their stdin closes, after the job in hand; kill any that do not."""
        if self.threads is not None:
            self.threads.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers:
            with contextlib.suppress(OSError):  # a dead worker's pipe
                worker.stdin.close()  # type: ignore[union-attr]  # a pipe
        for worker in self.workers:
            try:
                worker.wait(timeout=WORKER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            worker.stdout.close()  # type: ignore[union-attr]  # a pipe


def _start_pool(num_workers: int, ctx: DistContext) -> VerifierPool:
    """Return a VerifierPool of `num_workers`; if processes cannot be started, warn and verify in this process.

    Falling back instead of raising keeps this rank in step with the others, which are about to
    wait for it in the first round's all-gather.
    """
    try:
        return VerifierPool(num_workers)
    except OSError as error:
        LOGGER.warning(f"rank {ctx.rank}: label scan workers did not start ({error}); verifying in this process")
        return VerifierPool(0)


def _scan_in_rounds(image_files: Sequence[str], read_labels: bool, ctx: DistContext, num_workers: int) -> LabelIndex:
    """Verify every image/label pair, split across ranks in rounds, and return the same index on every rank.

    Every rank must call it with the same `image_files`. Each round covers the next world_size x
    SCAN_ROUND_FILES files; every rank verifies its contiguous block of them with its VerifierPool
    of `num_workers` processes (scan_workers; 0 or 1: in this process), packs the result (a
    LabelIndex: a few arrays, not an object per polygon) and the blocks are all-gathered.
    Gathered in rank order the blocks are in file order, so concatenating them gives exactly the
    single-process index. A failure on one rank is raised on every rank after that round's gather
    instead of leaving the others in the next collective until the timeout.

    Processes, not threads: verifying a file is Python and numpy work under the GIL (0.28 ms for a
    640-1280 px JPEG with up to 8 polygons: ~60% label parsing and checks, ~38% PIL's header, EXIF
    and structure reads; 0.82 ms with ~20 polygons of ~30 points: ~83% labels), and threads only
    contend for the lock. Medians of 6 alternating runs on 2 CPUs, files in the page cache,
    images/s: 3000 such JPEGs listed twice, 2 worker processes 5650 (start-up included), this
    process 3590, 2 threads 2020, 8 threads (the old default) 1500; 1000 many-polygon files listed
    twice 1960 / 1220 / 855 / 600; the 3000 JPEGs evicted from the page cache (local disk) 2100 /
    1550 / 8 threads 1170. Blocks travel packed: a many-polygon file's LabelIndex rows pickle in
    0.014 ms, its LabelRecord in 0.20 ms.
    """
    span = SCAN_ROUND_FILES * ctx.world_size
    parts: list[LabelIndex] = []
    bar = tqdm(total=len(image_files), desc="Scanning labels", disable=tqdm_disabled(ctx))
    with _start_pool(num_workers, ctx) as pool, bar:
        for start in range(0, len(image_files), span):
            stop = min(start + span, len(image_files))
            error: Exception | None = None
            try:
                part: LabelIndex | str = pool.verify(image_files[_block_of_rank(start, stop, ctx)], read_labels)
            except Exception as exc:  # re-raised below, after the other ranks have been told
                part, error = f"{type(exc).__name__}: {exc}", exc
            gathered = all_gather_objects(part, ctx)
            if error is not None:
                raise error
            failed = [(rank, text) for rank, text in enumerate(gathered) if isinstance(text, str)]
            if failed:
                raise RuntimeError(f"label scan failed on rank {failed[0][0]}: {failed[0][1]}")
            parts += gathered
            bar.update(stop - start)
    return concatenate_indices(parts)


def scan_in_rounds(
    image_files: Sequence[str], read_labels: bool, ctx: DistContext, num_gathered: int, num_workers: int | None
) -> LabelIndex:
    """Verify every image (and, with `read_labels`, its YOLO label file) split across ranks in rounds.

    Every rank must call it with the same list and the number of entries its last all-gather
    returned (`num_gathered`): a hand-built context (tests) without a process group gathers from
    this rank alone, which then scans everything. Returns the same index on every rank.
    """
    scan_ctx = ctx if num_gathered == ctx.world_size else dataclasses.replace(ctx, rank=0, world_size=1)
    workers = scan_workers(len(image_files), scan_ctx, num_workers)
    return _scan_in_rounds(image_files, read_labels, scan_ctx, workers)


def _block_of_rank(start: int, stop: int, ctx: DistContext) -> slice:
    """Return this rank's contiguous share of positions [start, stop); in rank order the shares tile the range."""
    size = -(-(stop - start) // ctx.world_size)  # ceil: the last ranks' blocks may be shorter or empty
    first = min(start + ctx.rank * size, stop)
    return slice(first, min(first + size, stop))


def concatenate_indices(parts: Sequence[LabelIndex]) -> LabelIndex:
    """Join indices of consecutive runs of files into one, as if they had been built from one list of records."""
    label_offsets, seg_offsets = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    num_labels = num_points = 0
    for part in parts:  # each part's offsets start at 0: shift them past the parts before it
        label_offsets.append(part.label_offsets[1:] + num_labels)
        seg_offsets.append(part.seg_offsets[1:] + num_points)
        num_labels, num_points = num_labels + len(part.labels), num_points + len(part.seg_points)
    return LabelIndex(
        PackedStrings.concatenate([part.im_files for part in parts]),
        np.concatenate([np.zeros((0, 2), np.int32), *(part.shapes for part in parts)]),
        np.concatenate([np.zeros((0, 5), np.float32), *(part.labels for part in parts)]),
        np.concatenate(label_offsets),
        np.concatenate([np.zeros((0, 2), np.float32), *(part.seg_points for part in parts)]),
        np.concatenate(seg_offsets),
        {status: sum(part.counts[status] for part in parts) for status in STATUSES},
        [message for part in parts for message in part.messages],
        sum(part.num_degenerate for part in parts),
        _summed([part.problems for part in parts]),
    )


def _summed(counts: Sequence[dict[Any, int]]) -> dict[Any, int]:
    """Add up per-reason (or per-class) counts, keeping the keys in the order they first appear."""
    total: dict[Any, int] = {}
    for part in counts:
        for reason, count in part.items():
            total[reason] = total.get(reason, 0) + count
    return total


def files_hash(image_files: Sequence[str], label_files: Sequence[str], ctx: DistContext, salt: object = "") -> str:
    """Return the digest of every path, size and modification time a label index depends on (and `salt`).

    Every rank must call it with the same files: the ranks of a node split the stat calls
    (file_digest.stat_digest). The cache version is hashed in, so a cache of another version never matches.
    """
    return stat_digest([image_files, label_files], f"{CACHE_VERSION}:{salt}".encode(), ctx).hex()


def image_list_digest(image_files: Sequence[str]) -> str:
    """Return the sha256 of the image paths in order (bytes as the file system holds them, NUL-separated)."""
    digest = hashlib.sha256()
    for path in image_files:
        digest.update(os.fsencode(path) + b"\0")
    return digest.hexdigest()


def differing_ranks_message(what: str, facts: Sequence[tuple[int, str]]) -> str | None:
    """Describe in one line how ranks' (image count, list digest) differ from rank 0's; None when all agree."""
    differing = [rank for rank, fact in enumerate(facts) if fact != facts[0]]
    if not differing:
        return None
    named = [f"rank {rank} has {facts[rank][0]} (digest {facts[rank][1][:8]})" for rank in differing[:MAX_RANKS_NAMED]]
    more = f", and {len(differing) - MAX_RANKS_NAMED} more rank(s)" if len(differing) > MAX_RANKS_NAMED else ""
    return (
        f"{what} differs across ranks: rank 0 has {facts[0][0]} images (digest {facts[0][1][:8]}), "
        f"{', '.join(named)}{more}; every rank must see the same files (shared or identical copies)"
    )


def check_same_image_files(image_files: Sequence[str], what: str, ctx: DistContext) -> None:
    """Raise a one-line ConfigError on every rank unless all ranks hold the same image list (count, paths in order).

    Every rank must call it; it costs one all-gather of two small values. Nodes with separate
    copies of a dataset that differ are the usual cause: without this check each rank would
    train on its own idea of the shards, or the scan would mix up files. `what` names the list
    in the message ("train set").
    """
    facts = all_gather_objects((len(image_files), image_list_digest(image_files)), ctx)
    message = differing_ranks_message(what, facts)
    if message is not None:
        raise ConfigError(message)


def scan_labels(
    image_files: Sequence[str],
    num_classes: int,
    ctx: DistContext,
    num_workers: int | None = None,
    cache_path: Path | None = None,
    names_file: Path | None = None,
    require_labels: bool = False,
) -> LabelIndex:
    """Verify every image and label (or reuse the label cache) and return the packed index, the same on every rank.

    Every rank must call it, with the same `image_files`; a rank holding another list (count or paths)
    makes every rank raise a one-line ConfigError. When every rank finds a current label cache (default
    `label_cache_path`; current while the digest of paths, sizes and modification times matches,
    whatever `num_classes`: a corrected `names` or --single-cls scans nothing again) it is read.
    Otherwise all ranks scan together in short rounds (`_scan_in_rounds`), so no rank waits in a
    collective for the whole scan and a scan longer than the process-group timeout (--dist-timeout) is
    fine; the local main rank of each node then writes the cache, and every rank returns its memory
    map once it is written (the scanned index where it could not be written). Rank 0 logs the bad
    files and the counts. Raises a one-line ConfigError when no usable image remains. Each rank
    verifies with up to `num_workers` worker processes (default and upper bound: its share of the
    CPUs; see scan_workers); reading a current cache opens no image. Labels
    whose class ids reach `num_classes` make every rank raise a one-line ConfigError naming
    `names_file`, the dataset YAML (check_class_ids). With `require_labels` (a train set) no labelled
    image at all is a one-line ConfigError naming the labels folder; without it, one warning
    (check_labelled). Entries of .txt image lists left out by list_image_files (`image_files.skipped`)
    are warned and counted with the scan's summary.
    """
    label_files = image_to_label_paths(image_files)
    listed = image_files if isinstance(image_files, ImageFiles) else ImageFiles(image_files)
    cache_path = cache_path or label_cache_path(listed)
    check_same_image_files(image_files, f"image list under {Path(image_files[0]).parent}", ctx)
    digest = files_hash(image_files, label_files, ctx)
    index = load_label_cache(cache_path, digest)
    has_cache = all_gather_objects(index is not None, ctx)  # may every rank use its cache?
    source = f"{cache_path} (cached)"
    if not all(has_cache):
        index = scan_in_rounds(image_files, True, ctx, len(has_cache), num_workers)
        source = f"scanned the labels of {len(image_files)} images (cache {cache_path})"
        if ctx.is_local_main:
            save_label_cache(cache_path, index, digest)
        # Wait for the write (seconds), so a rank that scans the same files next (a val set equal to the
        # train set) finds the cache instead of starting a second scan for every rank.
        barrier(ctx)
        # Then hold the file's pages, which the node's ranks and their workers share, not a private copy each.
        mapped = load_label_cache(cache_path, digest)
        index = index if mapped is None else mapped
    if ctx.is_main:
        report_scan(index, source, listed.skipped, listed.notes, cache_path)
    check_class_ids(index, num_classes, names_file)  # after the gather: every rank holds the same index
    if not len(index):
        images = Path(image_files[0]).parent
        raise ConfigError(f"{images}: no usable images (all {index.counts['corrupt']} are corrupt; see the warnings)")
    check_labelled(index, label_files, require_labels, ctx)
    return index
