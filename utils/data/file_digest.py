"""Digest of many files' sizes and modification times, the stat calls split among the ranks that see the same files."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from utils.distributed import DistContext, all_gather_objects

# Paths per chunk: each rank stats whole chunks and sends one 32-byte digest per chunk, so the gather stays
# small (about 9 KB pickled per million paths) while the chunks still spread evenly over 8 ranks from ~30k paths up.
STAT_CHUNK_PATHS = 4096


def mount_identity(folder: str | Path) -> str | None:
    """Name the mount `folder` is on as this host sees it (host, boot, device, inode); None if it is missing.

    Ranks with the same identity see the same files there: they may split the stat calls on them, and
    on /dev/shm they share one segment (shm_cache). Host names alone could merge two containers'
    separate mounts; device and inode numbers alone could match across machines, and a network file
    system's attributes are each client's own.
    """
    try:
        stat = os.stat(folder)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}:{boot_id}:{stat.st_dev}:{stat.st_ino}"


def _chunks(groups: Sequence[Sequence[str]]) -> list[tuple[int, int, int]]:
    """Cut each group of paths into runs of STAT_CHUNK_PATHS: (group, start, stop), in order."""
    return [
        (number, start, min(start + STAT_CHUNK_PATHS, len(paths)))
        for number, paths in enumerate(groups)
        for start in range(0, len(paths), STAT_CHUNK_PATHS)
    ]


def stat_chunk(paths: Sequence[str], with_names: bool = True) -> bytes:
    """Return the sha256 of each path's size and modification time in order (and name, `with_names`)."""
    digest = hashlib.sha256()
    for path in paths:
        name = os.fsencode(path) if with_names else b""  # fsencode: names need not be UTF-8
        try:
            stat = os.stat(path)
            digest.update(name + f"\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        except (OSError, ValueError):  # ValueError: a NUL in a listed name; the scan counts it as corrupt
            digest.update(name + b"\0missing\n")
    return digest.digest()


def stat_digest(groups: Sequence[Sequence[str]], prefix: bytes, ctx: DistContext, with_names: bool = True) -> bytes:
    """Return the sha256 of `prefix` and every path's size and modification time, groups and paths in order.

    Every rank must call it with the same `groups` (two small all-gathers). The value does not
    depend on how many ranks there are: it is the digest of `prefix` and one digest per chunk of
    STAT_CHUNK_PATHS paths. The ranks that see the files the same way (`mount_identity` of the first
    path's folder: the same host and mount) stat an interleaved share of the chunks each and pool
    the chunk digests, so a node of 8 ranks makes each stat call once, not 8 times: at a million
    images with their labels, 2 million metadata calls per node instead of 16 million, which on a
    network file system is most of a restart's wait. A rank whose folder is missing, or a hand-built
    context without a process group, stats every chunk itself. A path that cannot be statted
    (missing, unreadable, a NUL in its name) is hashed as missing, never raised on one rank alone.
    """
    chunks = _chunks(groups)
    first = next((paths[0] for paths in groups if len(paths)), ".")
    views = all_gather_objects(mount_identity(Path(first).parent), ctx)
    own = views[ctx.rank] if len(views) == ctx.world_size else None  # one entry: no process group
    # A missing folder names no mount: such ranks may be on any machine, so each stats everything itself.
    peers = [rank for rank, view in enumerate(views) if view == own] if own is not None else [ctx.rank]
    share = range(peers.index(ctx.rank), len(chunks), len(peers))
    mine = {i: stat_chunk(groups[chunks[i][0]][chunks[i][1] : chunks[i][2]], with_names) for i in share}
    gathered = all_gather_objects(mine, ctx)  # every rank calls it; only peers' parts are used
    pooled = dict(mine)
    for rank in peers:  # more than this rank only when the process group is up: `gathered` holds every rank
        if rank != ctx.rank:
            pooled.update(gathered[rank])
    digest = hashlib.sha256(prefix + f"{[len(paths) for paths in groups]}".encode())  # where each group ends
    for i in range(len(chunks)):
        digest.update(pooled[i])
    return digest.digest()
