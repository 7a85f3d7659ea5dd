"""Tests for utils/data/shm_cache.py and shm_segment.py: the node-shared /dev/shm image cache."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import cv2
import numpy as np
import pytest

import tests.test_elastic as elastic
import utils.data.shm_cache as shm_module
import utils.data.shm_segment as segment_module
from tests.conftest import make_tiny_dataset
from tests.dist_helpers import PROCESS_TIMEOUT_S, run_distributed
from tests.test_cache import _images
from utils.data.cache import read_resized, resized_hw
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.data.sampler import SmartDistributedSampler
from utils.data.shm_cache import ShmImageCache, open_shm_cache
from utils.data.shm_segment import (
    COMPLETE,
    FILLING,
    HEADER,
    MAGIC,
    SHM_DIR,
    process_start_time,
    read_header,
    segment_path,
)
from utils.distributed import DistContext

CTX = DistContext()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder on /dev/shm (tmpfs, as in training) or, without one, under tmp_path; removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="yolo-shm-test-", dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    folder = folder or tmp_path / "shm"
    folder.mkdir(exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _pixel_bytes(shapes: np.ndarray, img_size: int) -> int:
    return sum(3 * int(np.prod(resized_hw(int(h), int(w), img_size))) for w, h in shapes)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("augment", [False, True])
def test_round_trip_every_image_equals_its_decoded_and_resized_source(
    tmp_path: Path, shm_dir: Path, augment: bool
) -> None:
    paths, shapes = _images(tmp_path / "images")
    cache = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, augment=augment, directory=shm_dir)
    assert isinstance(cache, ShmImageCache) and cache.mode == "shm" and cache.is_owner
    assert list(shm_dir.iterdir()) == [cache.path] and read_header(cache.path).state == COMPLETE
    assert len(cache) == 6 and cache.nbytes == _pixel_bytes(shapes, 32)
    for index, path in enumerate(paths):
        image = cache.get(index)
        np.testing.assert_array_equal(image, read_resized(path, 32, augment))
        assert np.shares_memory(image, cache.buffer) and not image.flags.writeable  # a view of the mapping
    # A spawned worker gets the cache by pickle: it maps the file again, no pixel is serialised.
    copy = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < cache.nbytes and not copy.is_owner
    assert not np.shares_memory(copy.buffer, cache.buffer)  # its own mapping of the file
    np.testing.assert_array_equal(copy.get(5), cache.get(5))
    copy.release()  # not the owner: the segment stays
    assert cache.path.exists()
    cache.release()
    assert not cache.path.exists() and cache.get(0) is None and 0 not in cache


def test_unreadable_image_is_left_out_and_read_from_disk_later(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _images(tmp_path / "images")
    Path(paths[1]).write_bytes(b"gone bad after the scan")
    cache = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    try:
        assert len(cache) == 5 and 1 not in cache and cache.get(1) is None and cache.get(2) is not None
        assert cache.nbytes == _pixel_bytes(np.delete(shapes, 1, axis=0), 32)
        (warning,) = _warnings(caplog)
        assert "1 image(s) could not be cached" in warning and paths[1] in warning
    finally:
        cache.release()


def _labelled_images(root: Path) -> tuple[list[str], np.ndarray]:
    """`_images`, each with one box in the labels folder beside `root`: a train set needs labels."""
    paths, shapes = _images(root)
    labels = root.parent / "labels"
    labels.mkdir(exist_ok=True)
    for path in paths:
        (labels / f"{Path(path).stem}.txt").write_text("0 0.5 0.5 0.25 0.25\n")
    return paths, shapes


def test_dataset_with_shm_draws_from_every_image_and_copies_what_it_serves(tmp_path: Path) -> None:
    _labelled_images(tmp_path / "images")
    options = DatasetOptions(img_size=32, num_classes=3, workers=2, augment=True, cache_mode="shm")
    dataset = LoadImagesAndLabels(tmp_path / "images", options, CTX)  # the real /dev/shm: a name unique to tmp_path
    try:
        assert isinstance(dataset.cache, ShmImageCache) and dataset.shard.tolist() == list(range(6))
        plain = LoadImagesAndLabels(tmp_path / "images", dataclasses.replace(options, cache_mode="none"), CTX)
        for index in range(6):
            cached, decoded = dataset.load_image(index), plain.load_image(index)
            assert cached[1:] == decoded[1:] and np.array_equal(cached[0], decoded[0])
        image = dataset.load_image(0)[0]
        with pytest.raises(ValueError, match="read-only"):  # a view of the shared copy, not a copy: not writable
            image[:] = 0
        assert dataset.cache.get(0).max() > 0
        assert dataset[(3, 1)]["image"].shape == (32, 32, 3)
    finally:
        dataset.cache.release()
    assert not dataset.cache.path.exists()


def test_too_little_room_falls_back_to_ram_in_one_line(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _labelled_images(tmp_path / "images")
    monkeypatch.setattr(
        segment_module, "room_for_segment", lambda directory: _pixel_bytes(shapes, 32)
    )  # no margin left
    assert open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir) is None
    (warning,) = _warnings(caplog)
    assert warning.startswith("--cache shm: 6 resized images need") and "GB" in warning and "RAM" in warning
    assert not list(shm_dir.iterdir())
    # The dataset then caches in RAM like --cache ram (its shard; one process: every image).
    options = DatasetOptions(img_size=32, num_classes=3, workers=2, augment=True, cache_mode="shm")
    dataset = LoadImagesAndLabels(tmp_path / "images", options, CTX)
    assert dataset.cache.mode == "ram" and len(dataset.cache) == 6


def _write_segment_header(path: Path, owner_pid: int, owner_start: int, state: int) -> None:
    """Overwrite a segment's owner and state, as another process would have left them."""
    raw = bytearray(path.read_bytes()[: HEADER.size])
    _, version, _, key, _, _, num_items, data_bytes = HEADER.unpack(raw)
    with open(path, "r+b") as file:
        file.write(HEADER.pack(MAGIC, version, state, key, owner_pid, owner_start, num_items, data_bytes))


def test_stale_segments_are_replaced_and_complete_ones_reused(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths, shapes = _images(tmp_path / "images")
    first = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    first.release(keep=True)  # as a run that died and left its segment behind
    path = first.path
    gone = (os.getpid(), process_start_time(os.getpid()) + 1)  # a pid whose process is not the one that started then
    # Complete, same key, owner gone (an elastic restart): reused as it is, nothing decoded.
    _write_segment_header(path, *gone, COMPLETE)
    with mock.patch.object(shm_module, "read_resized", side_effect=AssertionError("refilled")):
        reused = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    assert len(reused) == 6 and read_header(path).owner_pid == os.getpid() and not _warnings(caplog)
    reused.release(keep=True)
    # Incomplete and its owner gone: replaced, with one warning.
    _write_segment_header(path, *gone, FILLING)
    refilled = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    (warning,) = _warnings(caplog)
    assert "replacing stale segment" in warning and "incomplete" in warning
    refilled.release(keep=True)
    # An image changed since (another key under the same name): replaced, and the new pixels are served.
    caplog.clear()
    cv2.imwrite(paths[0], np.full((shapes[0][1], shapes[0][0], 3), 77, np.uint8))
    os.utime(paths[0], ns=(1, 1))
    changed = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    (warning,) = _warnings(caplog)
    assert "replacing stale segment" in warning and "other image files" in warning
    assert changed.path == path and np.all(changed.get(0) == 77) and list(shm_dir.iterdir()) == [path]
    changed.release()


def test_segment_of_a_live_run_is_left_alone(tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths, shapes = _images(tmp_path / "images")
    first = open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir)
    first.release(keep=True)
    parent = os.getppid()  # alive for the whole test: stands for another training run on this node
    _write_segment_header(first.path, parent, process_start_time(parent), FILLING)
    assert open_shm_cache(paths, shapes, 32, CTX, num_threads=2, directory=shm_dir) is None
    (warning,) = _warnings(caplog)
    assert f"live process {parent}" in warning and "RAM" in warning
    assert read_header(first.path).owner_pid == parent  # untouched
    first.path.unlink()


def _open_on_rank(ctx: DistContext, paths: list[str], shapes: np.ndarray, shm_dir: str) -> dict[str, object]:
    """Open the shared cache on this rank; report what it holds, who decoded what, and the sampler's deal."""
    decoded: list[str] = []

    def counting(path: str, img_size: int, augment: bool = False) -> np.ndarray | None:
        decoded.append(path)
        return read_resized(path, img_size, augment)

    with mock.patch.object(shm_module, "read_resized", side_effect=counting):
        cache = open_shm_cache(paths, shapes, 32, ctx, num_threads=2, augment=True, directory=Path(shm_dir))
    with open("/proc/self/maps") as maps:
        mapped = str(cache.path) in maps.read()
    sampler = SmartDistributedSampler(np.arange(len(paths)), ctx, seed=3, dataset_len=len(paths))
    sampler.set_epoch(2)
    return {
        "images": [cache.get(i).copy() for i in range(len(paths))],
        "decoded": decoded,
        "segments": sorted(os.listdir(shm_dir)),
        "owner": cache.is_owner,
        "mapped": mapped,
        "deal": list(sampler),
    }


@pytest.mark.distributed
def test_two_gloo_ranks_fill_one_segment_together_and_read_the_same_pixels(tmp_path: Path, shm_dir: Path) -> None:
    paths, shapes = _images(tmp_path / "images")
    # Spawned, as torchrun starts ranks: the owner's segment goes at its interpreter's exit (atexit), which a
    # forked child skips (it ends with os._exit).
    rank0, rank1 = run_distributed(
        _open_on_rank, 2, tmp_path / "dist", paths, shapes, str(shm_dir), start_method="spawn"
    )
    expected_name = segment_path(paths, 32, True, shm_dir).name
    assert rank0["segments"] == rank1["segments"] == [expected_name]  # one segment for the node
    assert rank0["owner"] and not rank1["owner"] and rank0["mapped"] and rank1["mapped"]
    assert len(rank0["decoded"]) == len(rank1["decoded"]) == 3  # each rank filled half of it
    assert sorted(rank0["decoded"] + rank1["decoded"]) == sorted(paths)
    for index, path in enumerate(paths):
        np.testing.assert_array_equal(rank0["images"][index], rank1["images"][index])
        np.testing.assert_array_equal(rank0["images"][index], read_resized(path, 32, True))
    assert sorted(rank0["deal"] + rank1["deal"]) == list(range(6))  # one shared permutation, dealt out
    assert not list(shm_dir.iterdir())  # the owner removed it when its process ended


def _open_per_node(ctx: DistContext, paths: list[str], shapes: np.ndarray, shm_dir: str) -> dict[str, object]:
    """Each rank has its own shm folder (a node of its own); then rank 1's node runs short of room."""
    own = Path(shm_dir) / f"node{ctx.rank}"
    own.mkdir()
    cache = open_shm_cache(paths, shapes, 32, ctx, num_threads=2, directory=own)
    report: dict[str, object] = {"owner": cache.is_owner, "images": [cache.get(i).copy() for i in range(len(paths))]}
    room = 0 if ctx.rank == 1 else 1 << 40
    with mock.patch.object(segment_module, "room_for_segment", return_value=room):
        report["short"] = open_shm_cache(paths, shapes, 48, ctx, num_threads=2, directory=own)  # another size
    report["segments"] = sorted(os.listdir(own))
    return report


@pytest.mark.distributed
def test_every_node_fills_its_own_segment_and_one_short_node_sends_all_to_ram(tmp_path: Path, shm_dir: Path) -> None:
    paths, shapes = _images(tmp_path / "images")
    rank0, rank1 = run_distributed(_open_per_node, 2, tmp_path / "dist", paths, shapes, str(shm_dir))
    assert rank0["owner"] and rank1["owner"]  # each node's leader
    for index in range(len(paths)):
        np.testing.assert_array_equal(rank0["images"][index], rank1["images"][index])
    # Rank 1's node had no room: every rank fell back, and rank 0's node removed the segment it had made.
    assert rank0["short"] is None and rank1["short"] is None
    name = segment_path(paths, 32, False, shm_dir).name
    assert rank0["segments"] == rank1["segments"] == [name]


EXIT_SCRIPT = """
import logging, os, sys
from pathlib import Path
import numpy as np
from utils.data.shm_cache import open_shm_cache
from utils.distributed import DistContext
logging.basicConfig(level=logging.INFO, format="%(message)s")
paths = sys.argv[3:]
shapes = np.array([(int(w), int(h)) for w, h in (s.split("x") for s in sys.argv[2].split(","))])
ctx = DistContext(restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                  generation=int(os.environ.get("GENERATION", "0")))  # the job's start number (rendezvous)
cache = open_shm_cache(paths, shapes, 32, ctx, num_threads=2, directory=Path(sys.argv[1]))
print(cache.path, flush=True)
if os.environ.get("FAIL"):
    raise RuntimeError("training failed")
"""


def _run_and_exit(shm_dir: Path, paths: list[str], shapes: np.ndarray, **env: str) -> subprocess.CompletedProcess:
    sizes = ",".join(f"{w}x{h}" for w, h in shapes)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(shm_dir), sizes, *paths],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )


@pytest.mark.distributed
def test_segment_removed_at_exit_unless_torchrun_will_restart(tmp_path: Path, shm_dir: Path) -> None:
    paths, shapes = _images(tmp_path / "images")
    # An exception with no restart left (or outside torchrun) is final: the segment goes.
    final = _run_and_exit(shm_dir, paths, shapes, FAIL="1")
    assert final.returncode == 1 and "training failed" in final.stderr and not list(shm_dir.iterdir())
    # With restarts left it stays for the restart...
    restarts = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    failed = _run_and_exit(shm_dir, paths, shapes, FAIL="1", **restarts)
    assert failed.returncode == 1 and "keeping" in failed.stderr
    assert [p.name for p in shm_dir.iterdir()] == [Path(failed.stdout.strip()).name]
    # ...which reuses it without refilling, ends normally, and removes it.
    restart = _run_and_exit(shm_dir, paths, shapes, **{**restarts, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert restart.returncode == 0 and "reused from an earlier start, no refill" in restart.stderr
    assert not list(shm_dir.iterdir())
    # Two nodes: the other node's agent spent the job's last restart (this is start 1 of at most 2), while this
    # agent, whose worker did not fail, counts none. The job ends with this failure: the segment must go.
    last = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0", "GENERATION": "1"}
    final_start = _run_and_exit(shm_dir, paths, shapes, FAIL="1", **last)
    assert final_start.returncode == 1 and "keeping" not in final_start.stderr and not list(shm_dir.iterdir())


@pytest.mark.slow  # a training run in this process
def test_train_run_frees_the_segment_when_it_returns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A notebook or sweep calling train.run again must not keep every earlier run's images in /dev/shm.
    import train

    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm on this machine")
    data = make_tiny_dataset(tmp_path, elastic.TINY)
    with caplog.at_level(logging.INFO, logger="utils.data.shm_cache"):
        train.run(
            cfg="yolov5n", data=str(data), device="cpu", workers=0, imgsz=64, batch_size=4, epochs=1, noval=True,
            noplots=True, cache="shm", project=str(tmp_path / "runs"), name="a", seed=3,
        )  # fmt: skip
    segments = set(re.findall(r"in (/\S*yolo-shm-cache-\S+),", caplog.text))
    assert len(segments) == 1, caplog.text
    assert not Path(next(iter(segments))).exists()


# A torchrun restart that reuses the segment, and the finished run removing it: tests/test_elastic.py's
# killed-rank test runs under --cache shm and checks both.
