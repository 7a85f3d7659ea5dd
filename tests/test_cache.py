"""Tests for utils/data/cache.py: rank shards (also on 2 gloo processes) and the RAM/disk image cache (round trip)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import cv2
import numpy as np
import pytest

import utils.data.cache as cache_module
from tests.dist_helpers import run_distributed
from utils.data.cache import (
    ImageCache,
    available_memory_bytes,
    disk_cache_path,
    rank_shard,
    read_resized,
    resize_long_side,
    resized_hw,
)
from utils.distributed import DistContext

CTX = DistContext()
SIZES_WH = [(40, 30), (64, 64), (20, 50), (100, 10), (33, 77), (16, 16)]


def _images(root: Path) -> tuple[list[str], np.ndarray]:
    """Write noisy images of SIZES_WH; return (paths, shapes (N, 2) w, h)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, (width, height) in enumerate(SIZES_WH):
        path = root / f"{i}.png"
        assert cv2.imwrite(str(path), rng.integers(0, 256, (height, width, 3), np.uint8))
        paths.append(str(path))
    return paths, np.array(SIZES_WH, np.int32)


@pytest.mark.parametrize(("num_items", "world_size"), [(103, 2), (10, 3), (7, 8), (0, 2), (64, 4)])
def test_rank_shards_partition_items(num_items: int, world_size: int) -> None:
    shards = [rank_shard(num_items, DistContext(rank=r, world_size=world_size), seed=5) for r in range(world_size)]
    flat = np.concatenate(shards)
    assert sorted(flat.tolist()) == list(range(num_items))  # disjoint and complete
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(np.all(np.diff(s) > 0) and s.dtype == np.int64 for s in shards)
    again = rank_shard(num_items, DistContext(rank=0, world_size=world_size), seed=5)
    np.testing.assert_array_equal(again, shards[0])


def test_rank_shard_depends_on_seed_and_covers_all_in_one_process() -> None:
    a = rank_shard(100, DistContext(rank=0, world_size=2), seed=0)
    b = rank_shard(100, DistContext(rank=0, world_size=2), seed=1)
    assert a.tolist() != b.tolist()
    np.testing.assert_array_equal(rank_shard(9, CTX, seed=3), np.arange(9))


def _shards_on_rank(ctx: DistContext, num_items: int) -> tuple[list[int], list[list[int]]]:
    """Own shard, plus every rank's shard as this process computes it."""
    table = [rank_shard(num_items, DistContext(rank=r, world_size=ctx.world_size), 11).tolist() for r in range(2)]
    return rank_shard(num_items, ctx, 11).tolist(), table


@pytest.mark.distributed
def test_rank_shards_agree_across_gloo_processes(tmp_path: Path) -> None:
    results = run_distributed(_shards_on_rank, 2, tmp_path, 101)
    (own0, table0), (own1, table1) = results
    assert table0 == table1  # every rank derives the same split
    assert [own0, own1] == table0
    assert sorted(own0 + own1) == list(range(101)) and not set(own0) & set(own1)


def test_resize_long_side_uses_area_to_shrink_for_eval_and_linear_otherwise() -> None:
    image = np.random.default_rng(0).integers(0, 256, (30, 60, 3), np.uint8)
    assert resized_hw(30, 60, 40) == (20, 40) and resized_hw(1000, 3, 64) == (64, 1)
    np.testing.assert_array_equal(
        resize_long_side(image, 40), cv2.resize(image, (40, 20), interpolation=cv2.INTER_AREA)
    )
    np.testing.assert_array_equal(
        resize_long_side(image, 90), cv2.resize(image, (90, 45), interpolation=cv2.INTER_LINEAR)
    )
    assert resize_long_side(image, 60) is image
    # Training (augment) shrinks with INTER_LINEAR too: ~10x faster, and the random affine resamples anyway.
    np.testing.assert_array_equal(
        resize_long_side(image, 40, augment=True), cv2.resize(image, (40, 20), interpolation=cv2.INTER_LINEAR)
    )
    assert resize_long_side(image, 60, augment=True) is image


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_round_trip_every_image_equals_its_decoded_and_resized_source(tmp_path: Path, mode: str, augment: bool) -> None:
    paths, shapes = _images(tmp_path)  # shrunk and enlarged to 32, so both interpolations are exercised
    cache = ImageCache(paths, shapes, np.arange(6), 32, mode, CTX, num_threads=2, augment=augment)
    assert cache.mode == mode and len(cache) == 6
    assert cache.nbytes == sum(3 * int(np.prod(resized_hw(h, w, 32))) for w, h in shapes)
    for index, path in enumerate(paths):
        np.testing.assert_array_equal(cache.get(index), read_resized(path, 32, augment))


def test_ram_cache_holds_only_its_indices_in_one_buffer(tmp_path: Path) -> None:
    paths, shapes = _images(tmp_path)
    indices = np.array([0, 2, 3, 5])
    cache = ImageCache(paths, shapes, indices, 32, "ram", CTX, num_threads=2)
    expected = sum(np.prod(resized_hw(h, w, 32)) * 3 for w, h in shapes[indices])
    assert cache.nbytes == expected == cache.buffer.nbytes
    assert cache.buffer.ndim == 1 and cache.buffer.flags.c_contiguous
    assert len(cache) == 4 and cache.indices.tolist() == [0, 2, 3, 5]
    for i in range(len(paths)):
        image = cache.get(i)
        if i in (1, 4):
            assert image is None and i not in cache
            continue
        assert i in cache and np.shares_memory(image, cache.buffer)
        assert image.shape == (*resized_hw(shapes[i][1], shapes[i][0], 32), 3) and max(image.shape) == 32
        np.testing.assert_array_equal(image, read_resized(paths[i], 32))


def test_ram_cache_skipped_when_node_memory_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _images(tmp_path)
    needed = sum(np.prod(resized_hw(h, w, 32)) * 3 for w, h in shapes)
    monkeypatch.setattr(cache_module, "available_memory_bytes", lambda: int(needed * 1.5))
    one_rank = ImageCache(paths, shapes, np.arange(6), 32, "ram", CTX, num_threads=2)
    # No warning (an entry point run earlier in the session may have left INFO records switched on).
    assert len(one_rank) == 6 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    two_ranks = DistContext(rank=0, world_size=2, local_world_size=2)  # both ranks of the node cache at once
    skipped = ImageCache(paths, shapes, np.arange(6), 32, "ram", two_ranks, num_threads=2)
    assert len(skipped) == 0 and skipped.nbytes == 0 and skipped.get(0) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 ranks" in warnings[0] and "GB" in warnings[0]


def test_auto_cache_takes_ram_only_for_a_small_share_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _images(tmp_path)
    needed = sum(np.prod(resized_hw(h, w, 32)) * 3 for w, h in shapes)
    monkeypatch.setattr(cache_module, "available_memory_bytes", lambda: int(needed / cache_module.AUTO_CACHE_FRACTION))
    with caplog.at_level(logging.INFO):
        cached = ImageCache(paths, shapes, np.arange(6), 32, "auto", CTX, num_threads=2)
        assert cached.mode == "ram" and len(cached) == 6 and cached.nbytes == needed
        np.testing.assert_array_equal(cached.get(3), read_resized(paths[3], 32))
        # Two ranks on the node double the need: over the fraction, so nothing is cached, without a warning
        # (the RAM would fit: "ram" mode would still cache here).
        two_ranks = DistContext(rank=0, world_size=2, local_world_size=2)
        skipped = ImageCache(paths, shapes, np.arange(6), 32, "auto", two_ranks, num_threads=2)
        assert len(skipped) == 0 and skipped.get(0) is None and skipped.nbytes == 0
        assert len(ImageCache(paths, shapes, np.arange(6), 32, "ram", two_ranks, num_threads=2)) == 6
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--cache auto")]
    assert len(lines) == 2 and "caching them in RAM" in lines[0] and "reading from disk" in lines[1]


def test_unreadable_image_falls_back_to_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths, shapes = _images(tmp_path)
    Path(paths[1]).write_bytes(b"gone bad after the scan")
    cache = ImageCache(paths, shapes, np.arange(6), 32, "ram", CTX, num_threads=2)
    assert len(cache) == 5 and 1 not in cache and cache.get(1) is None and cache.get(2) is not None
    assert any(
        "1 image(s) could not be cached" in r.getMessage() and f"{paths[1]}: unreadable" in r.getMessage()
        for r in caplog.records
    )


def test_a_disk_cache_it_cannot_write_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _images(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache_module.tempfile, "mkstemp", refuse)  # a read-only folder (the tests run as root)
    cache = ImageCache(paths, shapes, np.arange(2), 32, "disk", CTX, num_threads=1)
    assert len(cache) == 0
    assert (
        f"(first: {paths[0]}: cannot write {disk_cache_path(paths[0], 32, False)} (Permission denied))" in caplog.text
    )


def test_disk_cache_keeps_images_that_share_a_stem_apart(tmp_path: Path) -> None:
    left, right = np.zeros((32, 32, 3), np.uint8), np.zeros((32, 32, 3), np.uint8)
    left[:, :16], right[:, 16:] = 255, 255
    paths = [str(tmp_path / "x.jpg"), str(tmp_path / "x.png")]
    for path, image in zip(paths, (left, right), strict=True):
        assert cv2.imwrite(path, image)
    cache = ImageCache(paths, np.array([[32, 32], [32, 32]], np.int32), np.arange(2), 32, "disk", CTX, num_threads=1)
    assert disk_cache_path(paths[0], 32, False) != disk_cache_path(paths[1], 32, False)
    for index, path in enumerate(paths):  # each image its own pixels
        assert np.abs(cache.get(index).astype(int) - read_resized(path, 32).astype(int)).max() == 0
    assert cache.get(1)[:, :8].mean() < 10 and cache.get(1)[:, 24:].mean() > 245


def test_disk_cache_writes_npy_and_reuses_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, shapes = _images(tmp_path)
    cache = ImageCache(paths, shapes, np.array([0, 1, 4]), 32, "disk", CTX, num_threads=2)
    written = [disk_cache_path(paths[i], 32, False) for i in (0, 1, 4)]
    assert all(p.is_file() for p in written) and not disk_cache_path(paths[2], 32, False).exists()
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temporaries
    np.testing.assert_array_equal(cache.get(4), read_resized(paths[4], 32))
    assert cache.get(2) is None and cache.nbytes == sum(np.load(p).nbytes for p in written)
    stamps = [p.stat().st_mtime_ns for p in written]
    monkeypatch.setattr(cache_module, "read_resized", lambda *a: pytest.fail("decoded although the .npy is current"))
    again = ImageCache(paths, shapes, np.array([0, 1, 4]), 32, "disk", CTX, num_threads=2)
    assert len(again) == 3 and [p.stat().st_mtime_ns for p in written] == stamps
    monkeypatch.undo()
    np.save(written[0], np.zeros((36, 48, 3), np.uint8))  # the right time, the wrong size: rewritten
    os.utime(written[0], ns=(stamps[0], stamps[0]))
    again = ImageCache(paths, shapes, np.array([0]), 32, "disk", CTX, num_threads=2)
    np.testing.assert_array_equal(again.get(0), read_resized(paths[0], 32))


def test_disk_caches_at_two_sizes_keep_apart_and_a_changed_npy_is_not_trained_on(tmp_path: Path) -> None:
    # Two runs on the same images at other sizes (or train and val resizes) each keep their own files; a .npy
    # that changed under a running cache (another version's run rewrote it) is passed over for the image.
    paths, shapes = _images(tmp_path)
    small = ImageCache(paths, shapes, np.array([0]), 32, "disk", CTX, num_threads=1)
    large = ImageCache(paths, shapes, np.array([0]), 48, "disk", CTX, num_threads=1, augment=True)
    assert small.get(0).shape == (24, 32, 3) and large.get(0).shape == (36, 48, 3)
    assert {path.name for path in tmp_path.glob("*.npy")} >= {"0.png.32-eval.npy", "0.png.48.npy"}
    np.save(disk_cache_path(paths[0], 32, False), large.get(0))
    assert small.get(0) is None


def test_disk_cache_redoes_an_image_replaced_by_an_older_file_of_the_same_size(tmp_path: Path) -> None:
    paths, shapes = _images(tmp_path)
    ImageCache(paths, shapes, np.array([0]), 32, "disk", CTX, num_threads=1)
    before = Path(paths[0]).stat()
    # The corrected image arrives as an unpacked archive or `rsync -a` delivers it: same size, an older time.
    replacement = 255 - cv2.imread(paths[0])
    assert cv2.imwrite(paths[0], replacement)
    os.utime(paths[0], ns=(before.st_atime_ns, before.st_mtime_ns - 3600 * 10**9))
    again = ImageCache(paths, shapes, np.array([0]), 32, "disk", CTX, num_threads=1)
    np.testing.assert_array_equal(again.get(0), read_resized(paths[0], 32))
    assert disk_cache_path(paths[0], 32, False).stat().st_mtime_ns == Path(paths[0]).stat().st_mtime_ns


def test_available_memory_is_read_and_bad_mode_rejected(tmp_path: Path) -> None:
    assert 0 < available_memory_bytes() < 1 << 50
    paths, shapes = _images(tmp_path)
    with pytest.raises(ValueError, match="'ram' or 'disk'"):
        ImageCache(paths, shapes, np.arange(6), 32, "gpu", CTX)
