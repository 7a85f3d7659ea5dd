"""The file digest of label caches and shm segments: what it notices, and ranks of one node splitting its stat calls."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import utils.data.file_digest as file_digest
from tests.dist_helpers import captured, check_parts, run_distributed
from utils.data.file_digest import mount_identity, stat_digest
from utils.distributed import DistContext

NUM_FILES = 10
SMALL_CHUNK = 3  # 10 files and 4 labels: chunks of 3, 3, 3, 1 and 3, 1 share out unevenly between 2 ranks


def _files(root: Path) -> tuple[list[str], list[str]]:
    """Ten small "images" and four "labels" (two of them missing), as paths."""
    root.mkdir(parents=True, exist_ok=True)
    images = []
    for i in range(NUM_FILES):
        path = root / f"{i:02d}.jpg"
        path.write_bytes(b"x" * (i + 1))
        images.append(str(path))
    labels = [str(root / f"{i:02d}.txt") for i in range(4)]
    for path in labels[:2]:
        Path(path).write_text("0 0.5 0.5 0.1 0.1\n")
    return images, labels


def _digest(images: list[str], labels: list[str]) -> bytes:
    return stat_digest([images, labels], b"prefix", DistContext())


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, file_digest.STAT_CHUNK_PATHS])
def test_the_digest_changes_with_any_size_time_name_order_or_presence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(file_digest, "STAT_CHUNK_PATHS", chunk)
    images, labels = _files(tmp_path)
    before = _digest(images, labels)
    assert _digest(images, labels) == before and len(before) == 32
    assert stat_digest([images, labels], b"other prefix", DistContext()) != before
    assert _digest(images[::-1], labels) != before
    assert _digest(images, labels[:3]) != before  # a missing label counts too, by name
    assert stat_digest([images, labels], b"prefix", DistContext(), with_names=False) != before
    stat = os.stat(images[7])
    os.utime(images[7], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # one nanosecond later
    touched = _digest(images, labels)
    assert touched != before
    Path(images[7]).write_bytes(b"y" * 8)  # the same size
    os.utime(images[7], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # and the same time as just now
    assert _digest(images, labels) == touched  # content is not read: size and time stand for it
    Path(labels[2]).write_text("0 0.5 0.5 0.1 0.1\n")  # a label appears
    assert _digest(images, labels) != touched


def test_without_names_only_sizes_and_times_count() -> None:
    missing = ["/no/such/a.jpg", "/no/such/b.jpg"]
    other = ["/no/such/c.jpg", "/no/such/d.jpg"]
    assert stat_digest([missing], b"", DistContext(), with_names=False) == stat_digest(
        [other], b"", DistContext(), with_names=False
    )
    assert stat_digest([missing], b"", DistContext()) != stat_digest([other], b"", DistContext())


def test_where_each_group_ends_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_digest, "STAT_CHUNK_PATHS", 2)
    a, b, c = (str(tmp_path / name) for name in "abc")
    assert stat_digest([[a, b], [c]], b"p", DistContext()) != stat_digest([[a, b, c], []], b"p", DistContext())
    assert stat_digest([[], []], b"p", DistContext()) != stat_digest([[]], b"p", DistContext())


def test_a_name_stat_cannot_take_is_hashed_as_missing(tmp_path: Path) -> None:
    # A .txt image list may carry a NUL: os.stat raises ValueError, which must not stop one rank alone.
    names = [str(tmp_path / "a.jpg"), str(tmp_path / "b\0c.jpg")]
    assert len(stat_digest([names], b"", DistContext())) == 32
    assert mount_identity(str(tmp_path / "b\0c")) is None


def test_the_mount_identity_names_this_host_and_folder(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    here = mount_identity(tmp_path)
    assert here is not None and here == mount_identity(tmp_path)
    assert mount_identity(tmp_path / "a") != here  # another folder (inode)
    assert mount_identity(tmp_path / "missing") is None


def _digest_on_rank(ctx: DistContext, root: str, hosts: str) -> dict[str, Any]:
    """stat_digest of _files(root) on this rank, with small chunks; which of the files this rank statted.

    `hosts`: "one" (as the machine is), "separate" (as if each rank ran on its own machine), or
    "folder missing" (each on its own machine, the first image's folder missing on both).
    """
    file_digest.STAT_CHUNK_PATHS = SMALL_CHUNK
    if hosts == "separate":
        file_digest.mount_identity = lambda folder, rank=ctx.rank: f"host-{rank}"
    elif hosts == "folder missing":
        file_digest.mount_identity = lambda folder: None
    images = sorted(str(path) for path in Path(root).glob("*.jpg"))
    labels = [str(Path(root) / f"{i:02d}.txt") for i in range(4)]
    statted: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith(root):
            statted.append(str(path))
        return real_stat(path, *args, **kwargs)

    os.stat = counting_stat  # type: ignore[assignment]  # this spawned rank only
    try:
        digest = stat_digest([images, labels], b"prefix", ctx)
    finally:
        os.stat = real_stat  # type: ignore[assignment]
    return {"digest": digest, "statted": [path for path in statted if path.endswith((".jpg", ".txt"))]}


# The machines _digest_on_rank's ranks act out, in the order one job runs them: "one" first, as the machine is.
HOSTS = ("one", "separate", "folder missing")


def _digests_on_rank(ctx: DistContext, root: str) -> dict[str, Any]:
    """_digest_on_rank for each of HOSTS in turn: one spawned job (seconds of torch imports) for all three."""
    return {hosts: captured(_digest_on_rank, ctx, root, hosts) for hosts in HOSTS}


@dataclass(frozen=True)
class RankDigests:
    """Both ranks' _digests_on_rank results, and the _files images and labels they digested (left unchanged)."""

    results: list[dict[str, Any]]
    images: list[str]
    labels: list[str]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> RankDigests:
    """One spawned job digesting one _files folder on 2 ranks as each of HOSTS."""
    root = tmp_path_factory.mktemp("digest_ranks")
    images, labels = _files(root / "data")
    return RankDigests(run_distributed(_digests_on_rank, 2, root / "dist", str(root / "data")), images, labels)


@pytest.mark.distributed
def test_ranks_of_one_node_stat_each_file_once_and_agree_with_one_process(
    rank_results: RankDigests, monkeypatch: pytest.MonkeyPatch
) -> None:
    images, labels = rank_results.images, rank_results.labels
    monkeypatch.setattr(file_digest, "STAT_CHUNK_PATHS", SMALL_CHUNK)
    alone = _digest(images, labels)
    rank0, rank1 = check_parts(rank_results.results, "one")
    assert rank0["digest"] == rank1["digest"] == alone  # the value does not depend on the number of ranks
    # Chunks 0, 2, 4 (images 0-2, 6-8; labels 0-2) on rank 0; chunks 1, 3, 5 (images 3-5, 9; label 3) on rank 1.
    assert rank0["statted"] == images[0:3] + images[6:9] + labels[0:3]
    assert rank1["statted"] == images[3:6] + images[9:] + labels[3:]


@pytest.mark.distributed
def test_ranks_on_separate_hosts_each_stat_every_file(
    rank_results: RankDigests, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Separate machines may hold separate copies: each node's digest must come from its own files.
    images, labels = rank_results.images, rank_results.labels
    monkeypatch.setattr(file_digest, "STAT_CHUNK_PATHS", SMALL_CHUNK)
    alone = _digest(images, labels)
    for hosts in ("separate", "folder missing"):  # a missing folder names no mount: no pooling either
        rank0, rank1 = check_parts(rank_results.results, hosts)
        assert rank0["digest"] == rank1["digest"] == alone
        assert rank0["statted"] == rank1["statted"] == images + labels
