"""Tests for utils/data/scan.py, the scan across ranks: rounds, joining, one cache write, same files on every rank."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import train
import utils.data.scan as scan_module
from tests.dist_helpers import captured, check_parts, run_distributed
from utils.config import DEFAULT_HYP
from utils.data.data_config import load_data_config
from utils.data.image_files import image_to_label_path, list_image_files
from utils.data.labels import (
    ANY_CLASS_ID,
    LabelIndex,
    build_index,
    label_cache_path,
    load_label_cache,
    verify_image_label,
)
from utils.data.scan import (
    VerifierPool,
    concatenate_indices,
    differing_ranks_message,
    files_hash,
    scan_labels,
    scan_pool_size,
    scan_workers,
)
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.hyp import load_hyp
from utils.tasks import DETECT
from utils.train.config import TrainConfig
from utils.train.setup import build_datasets

SIZES_WH = [(40, 30), (30, 40), (50, 20), (32, 32), (20, 45), (45, 35), (35, 20), (32, 24), (24, 40), (40, 24)]
SIZES_WH += [(36, 36)]
BOX, POLYGON, DUPLICATES = "0 0.5 0.5 0.4 0.2\n", "1 0.1 0.2 0.6 0.2 0.6 0.8 0.1 0.8\n", "0 0.5 0.5 0.2 0.2\n" * 2
LABELS = [BOX, POLYGON, "", None, DUPLICATES]  # None: no label file (background)
GROUP_TIMEOUT_S = 60.0  # the 2-rank job's collective timeout


def _folder(root: Path, sizes: list[tuple[int, int]] = SIZES_WH) -> Path:
    """Images of several aspect ratios; box, polygon, empty, missing and duplicate-row labels; one corrupt file."""
    images = root / "images" / "train"
    images.mkdir(parents=True)
    for i, (width, height) in enumerate(sizes):
        cv2.imwrite(str(images / f"{i:02d}.png"), np.full((height, width, 3), 20 * i, np.uint8))
        label = LABELS[i % len(LABELS)]
        if label is not None:
            path = Path(image_to_label_path(images / f"{i:02d}.png"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(label)
    (images / "99_corrupt.jpg").write_bytes(b"not an image")
    return images


def _assert_same_index(a: LabelIndex, b: LabelIndex) -> None:
    assert a.im_files == b.im_files and a.counts == b.counts and a.messages == b.messages
    assert a.num_degenerate == b.num_degenerate and a.problems == b.problems
    for name in ("shapes", "labels", "label_offsets", "seg_points", "seg_offsets"):
        first, second = getattr(a, name), getattr(b, name)
        assert first.dtype == second.dtype, name
        np.testing.assert_array_equal(first, second, err_msg=name)


def _reference_index(files: list[str]) -> LabelIndex:
    """The index one build_index over every record gives: what every scan must reproduce."""
    return build_index([verify_image_label(f, image_to_label_path(f)) for f in files])


def test_joined_runs_equal_one_index_even_with_empty_runs(tmp_path: Path) -> None:
    files = list_image_files(_folder(tmp_path))
    records = [verify_image_label(f, image_to_label_path(f)) for f in files]
    whole = build_index(records)
    assert whole.counts["corrupt"] == 1 and whole.counts["missing"] > 0 and len(whole.seg_points) > 0
    for cuts in ([0, 3, 3, 7, 12], [0, 12, 12], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]):
        parts = [build_index(records[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        _assert_same_index(concatenate_indices(parts), whole)


def test_scan_in_rounds_in_one_process_matches_one_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "SCAN_ROUND_FILES", 5)  # 12 files: rounds of 5, 5 and 2
    files = list_image_files(_folder(tmp_path))
    index = scan_labels(files, 2, DistContext(), num_workers=2)
    _assert_same_index(index, _reference_index(files))
    _assert_same_index(load_label_cache(label_cache_path(files), _digest(files)), index)


def _digest(files: list[str]) -> str:
    return files_hash(files, [image_to_label_path(f) for f in files], DistContext())


def test_differing_ranks_message_names_ranks_counts_and_digests() -> None:
    same = [(10, "a" * 64)] * 3
    assert differing_ranks_message("train set", same) is None
    message = differing_ranks_message("train set", [(1000, "1a2b3c4d" + "0" * 56), (998, "5e6f7a8b" + "0" * 56)])
    assert message == (
        "train set differs across ranks: rank 0 has 1000 images (digest 1a2b3c4d), rank 1 has 998 (digest 5e6f7a8b); "
        "every rank must see the same files (shared or identical copies)"
    )
    many = differing_ranks_message("val set", [(5, "a" * 64)] + [(6, "b" * 64)] * 5)
    assert "\n" not in many and "rank 3 has 6" in many and "rank 4" not in many and "and 2 more rank(s)" in many


# ------------------------------------------------------------------------------ worker processes, the label cache


def _many_polygons(count: int, points: int, seed: int) -> str:
    """A label file of `count` star-shaped polygons of `points` vertices, inside the image, classes 0-2."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(count):
        angles = np.linspace(0, 2 * np.pi, points, endpoint=False)
        radii = rng.uniform(0.02, 0.08) * np.where(np.arange(points) % 2, 0.5, 1.0)
        centre = rng.uniform(0.1, 0.9, size=2)
        xy = np.stack([centre[0] + radii * np.cos(angles), centre[1] + radii * np.sin(angles)], 1)
        lines.append(" ".join([str(i % 3), *(f"{v:.6f}" for v in xy.reshape(-1))]))
    return "\n".join(lines) + "\n"


def _varied_folder(root: Path) -> Path:
    """_folder's files, plus JPEGs (EXIF-rotated, truncated, empty) and many-polygon, repaired and corrupt labels."""
    images = _folder(root)
    rng = np.random.default_rng(0)
    labels = {
        "j00": _many_polygons(30, 24, seed=1),
        "j01": _many_polygons(5, 40, seed=2),
        "j02": "0 0.5 0.5\n",  # 3 columns: corrupt
        "j03": "-1 0.5 0.5 0.2 0.2\n",  # a negative class: corrupt (class 5 of 3 would stop the run)
        "j04": "0 0.5 0.5 0.2 0.204\n1 0.3 0.3 0.1 0.1\n",  # a coordinate 0.004 past the edge: clipped
        "j05": "0 0.1 0.1 0.5 0.5 0.9 0.9\n",  # collinear: dropped, the file becomes empty
        "j06": "0 x 0.5 0.2 0.2\n",  # non-numeric: corrupt
        "j07": "2 0.5 0.5 0.2 0.2\n" * 3 + "1 0.5 0.5 0.9 0.9\n",  # duplicates removed
        "j08": _many_polygons(12, 8, seed=3),  # the image is truncated: corrupt whatever the label says
        "j09": "1 0.5 0.5 0.2 0.2\n",  # EXIF-rotated image
    }
    for stem, text in labels.items():
        width, height = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        cv2.imwrite(str(images / f"{stem}.jpg"), rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        Path(image_to_label_path(images / f"{stem}.jpg")).write_text(text)
    truncated = images / "j08.jpg"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated by 90 degrees
    Image.new("RGB", (60, 30)).save(images / "j09.jpg", exif=exif.tobytes())
    (images / "j10_empty.jpg").write_bytes(b"")
    return images


def _varied_reference(root: Path) -> tuple[list[str], LabelIndex]:
    files = list_image_files(_varied_folder(root))
    reference = _reference_index(files)
    assert all(reference.counts[status] for status in ("found", "missing", "empty", "corrupt")), reference.counts
    assert len(reference.messages) >= 9 and reference.num_degenerate == 1 and len(reference.seg_points) > 900
    return files, reference


@pytest.mark.distributed  # starts worker processes
def test_worker_processes_give_exactly_the_in_process_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "CHUNK_FILES", 4)  # 23 files: 6 jobs over 2 workers
    files, reference = _varied_reference(tmp_path)
    with VerifierPool(2) as pool:
        assert pool.num_workers == 2
        _assert_same_index(pool.verify(files, True), reference)  # order, counts, messages, arrays and dtypes
        _assert_same_index(pool.verify(files[5:6], True), _reference_index(files[5:6]))  # more jobs, same workers
        workers = list(pool.workers)
    assert [worker.returncode for worker in workers] == [0, 0]  # closing the pool let each worker exit by itself
    _assert_same_index(VerifierPool(1).verify(files, True), reference)  # one worker: verified in this process


@pytest.mark.distributed  # starts worker processes
def test_scan_labels_verifies_in_worker_processes_round_by_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, reference = _varied_reference(tmp_path)
    monkeypatch.setattr(scan_module, "SCAN_ROUND_FILES", 10)  # 23 files: rounds of 10, 10 and 3
    monkeypatch.setattr(scan_module, "CHUNK_FILES", 3)
    monkeypatch.setattr(scan_module, "MIN_POOL_FILES", 23)  # just enough files for the pool
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    blocks: list[tuple[int, int]] = []
    verify = VerifierPool.verify

    def recording_verify(pool: VerifierPool, image_files: list[str], read_labels: bool) -> LabelIndex:
        blocks.append((len(image_files), pool.num_workers))
        return verify(pool, image_files, read_labels)

    monkeypatch.setattr(VerifierPool, "verify", recording_verify)
    _assert_same_index(scan_labels(files, 3, DistContext(), num_workers=8), reference)
    assert blocks == [(10, 2), (10, 2), (3, 2)]  # one pool for the whole scan, capped at the CPUs


@pytest.mark.distributed  # starts worker processes
def test_a_worker_that_died_is_an_error_naming_it_not_a_hang(tmp_path: Path) -> None:
    files = list_image_files(_folder(tmp_path))
    with VerifierPool(2) as pool:
        victim = pool.workers[0]  # the first job goes to the first idle worker
        victim.kill()
        victim.wait()
        with pytest.raises(RuntimeError, match=rf"label scan worker {victim.pid} stopped \(exit status -9\)"):
            pool.verify(files, True)
    assert all(worker.returncode is not None for worker in pool.workers)


def test_pool_size_is_the_cpus_of_this_process_shared_by_the_ranks_of_its_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [scan_pool_size(DistContext(local_world_size=n)) for n in (1, 3, 8, 16, 32)] == [16, 5, 2, 1, 1]
    two_ranks = DistContext(rank=1, local_rank=1, world_size=2, local_world_size=2)
    enough = 2 * scan_module.MIN_POOL_FILES  # a share of MIN_POOL_FILES per rank
    assert [scan_workers(enough, two_ranks), scan_workers(enough - 2, two_ranks)] == [8, 0]
    assert scan_workers(enough, two_ranks, max_workers=3) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert scan_pool_size(DistContext(local_world_size=1)) == 1


def test_small_scans_and_a_single_cpu_start_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(scan_module.subprocess, "Popen", no_process)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    files = list_image_files(_folder(tmp_path))
    reference = _reference_index(files)
    _assert_same_index(scan_labels(files, 2, DistContext(), num_workers=8), reference)  # 12 files: too few
    monkeypatch.setattr(scan_module, "MIN_POOL_FILES", 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    cache = tmp_path / "one_cpu.cache"
    _assert_same_index(scan_labels(files, 2, DistContext(), num_workers=8, cache_path=cache), reference)


def test_unchanged_dataset_rereads_the_cache_without_opening_an_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, reference = _varied_reference(tmp_path)
    _assert_same_index(scan_labels(files, 3, DistContext()), reference)
    # Garbage of the same size and modification time: the cache key still matches, and only a scan
    # that opened the images would see that none of them is an image any more.
    for path in files:
        stat = os.stat(path)
        Path(path).write_bytes(b"\0" * stat.st_size)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    opened: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        opened.append(args[0])
        raise AssertionError("an image was opened although the label cache is current")

    monkeypatch.setattr(Image, "open", refuse)
    monkeypatch.setattr(scan_module, "_scan_in_rounds", refuse)
    _assert_same_index(scan_labels(files, 3, DistContext()), reference)
    assert opened == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no usable images"):  # what a scan that read them would have found
        scan_labels(files, 3, DistContext(), cache_path=tmp_path / "fresh.cache")


# ------------------------------------------------------------------------------ two ranks, real gloo


def _scan_on_rank(ctx: DistContext, folder: str) -> dict[str, Any]:
    """Scan with no cache (rounds of 3 files, 2 worker processes per rank), then again from the cache.

    Records the blocks this rank's pool verified, its worker count, and the cache writes.
    """
    scan_module.SCAN_ROUND_FILES = 3  # 12 files on 2 ranks: 2 rounds of 6, each rank 3 per round
    scan_module.CHUNK_FILES = 2  # a block of 3 files is two jobs, one per worker
    scan_module.MIN_POOL_FILES = 1  # processes even for 6 files per rank
    scan_module.scan_pool_size = lambda ctx: 2  # 2 ranks on a 2-core machine would otherwise get 1 each
    verified: list[str] = []
    workers: list[int] = []
    writes: list[str] = []
    verify, save = scan_module.VerifierPool.verify, scan_module.save_label_cache

    def recording_verify(pool: scan_module.VerifierPool, image_files: list[str], read_labels: bool) -> LabelIndex:
        verified.extend(image_files)
        workers.append(pool.num_workers)
        return verify(pool, image_files, read_labels)

    def recording_save(path: Path, index: LabelIndex, digest: str) -> bool:
        writes.append(str(path))
        return save(path, index, digest)

    scan_module.VerifierPool.verify = recording_verify  # type: ignore[method-assign]
    scan_module.save_label_cache = recording_save  # patched where the scan looks it up
    files = list_image_files(folder)
    scanned = scan_labels(files, 2, ctx)
    verified_when_scanning = list(verified)
    cached = scan_labels(files, 2, ctx)
    return {
        "scanned": scanned,
        "cached": cached,
        "verified": verified_when_scanning,
        "verified_again": verified[len(verified_when_scanning) :],
        "workers": workers,
        "writes": writes,
    }


@pytest.mark.distributed
def test_two_ranks_scan_their_blocks_build_one_index_and_write_the_cache_once(rank_results: RankResults) -> None:
    folder = rank_results.folders["scan"]
    rank0, rank1 = check_parts(rank_results.results, "scan")
    files = list_image_files(folder)
    reference = _reference_index(files)
    for rank in (rank0, rank1):
        _assert_same_index(rank["scanned"], reference)  # file order, corrupt file counted and left out
        _assert_same_index(rank["cached"], reference)
        assert rank["verified_again"] == []  # the second call read the cache
        assert rank["workers"] == [2, 2]  # each round's block went to this rank's two worker processes
    # Each rank verified its own contiguous blocks of every round; together each file exactly once.
    assert rank0["verified"] and rank1["verified"]
    assert sorted(rank0["verified"] + rank1["verified"]) == sorted(files)
    assert sorted(rank0["verified"]) == files[0:3] + files[6:9]
    assert rank0["writes"] == [str(label_cache_path(files))] and rank1["writes"] == []  # local rank 0 alone
    _assert_same_index(load_label_cache(label_cache_path(files), _digest(files)), reference)


def _write_yaml(root: Path, name: str, train: str) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump({"path": str(root), "train": train, "val": "images/train", "names": ["a", "b"]}))
    return path


def _build_on_rank(ctx: DistContext, root: str) -> dict[str, Any]:
    """build_datasets: rank 1 lists one extra image; rank 1 trains --rect (same files, other order); one image."""
    outcome: dict[str, Any] = {}
    hyp = load_hyp(DEFAULT_HYP)
    bundle = SimpleNamespace(model=SimpleNamespace(stride=torch.tensor([8.0, 16.0, 32.0])))
    cases = {
        "extra_image": ("train.txt" if ctx.rank == 0 else "train_plus_one.txt", False),
        "rect_on_rank_1": ("train.txt", ctx.rank == 1),
        "one_image": ("train_one.txt", False),  # fewer training images than ranks: a shard would be empty
    }
    for case, (train_list, rect) in cases.items():
        data = load_data_config(Path(root) / f"{train_list}.yaml", ctx)
        cfg = TrainConfig(hyp=hyp, batch_size=4, imgsz=64, workers=0, cache="none", rect=rect, epochs=1)
        start = time.monotonic()
        try:
            build_datasets(cfg, DETECT, data, bundle, ctx)  # type: ignore[arg-type]  # only model.stride is read
            outcome[case] = ("built", time.monotonic() - start)
        except ConfigError as error:
            outcome[case] = (str(error), time.monotonic() - start)
    return outcome


def _lists_folder(root: Path) -> Path:
    """The _folder dataset with train lists of 8, 9 and 1 of its images and a YAML for each; returns `root`."""
    images = _folder(root)
    files = sorted(p.name for p in images.iterdir())
    (root / "train.txt").write_text("".join(f"images/train/{name}\n" for name in files[:-2]))
    (root / "train_plus_one.txt").write_text("".join(f"images/train/{name}\n" for name in files[:-1]))
    (root / "train_one.txt").write_text(f"images/train/{files[0]}\n")
    for name in ("train.txt", "train_plus_one.txt", "train_one.txt"):
        _write_yaml(root, f"{name}.yaml", name)
    return root


@pytest.mark.distributed
def test_ranks_with_different_datasets_fail_fast_with_one_line(rank_results: RankResults) -> None:
    root = rank_results.folders["build"]
    timeout_s = GROUP_TIMEOUT_S  # the group's: a rank that waited for the other would sit it out
    rank0, rank1 = check_parts(rank_results.results, "build")
    for rank in (rank0, rank1):
        listing, seconds = rank["extra_image"]
        assert "differs across ranks: rank 0 has 10 images" in listing and "rank 1 has 11 (digest" in listing
        assert listing.endswith("every rank must see the same files (shared or identical copies)")
        assert "\n" not in listing and seconds < timeout_s  # failed at once, not by the collective's timeout
        order, seconds = rank["rect_on_rank_1"]
        # The same 10 files, in aspect-ratio order on rank 1: the listing agrees, build_datasets' own check does not.
        assert order.startswith("train set differs across ranks: rank 0 has 10 images (digest "), order
        assert "rank 1 has 10 (digest" in order and seconds < timeout_s
        one, seconds = rank["one_image"]  # every rank stops alike, naming the file, before the sampler would raise
        assert (
            one == f"{root / 'train_one.txt'}: 1 usable training image(s) for 2 processes; every rank needs "
            "at least one (use fewer processes or more images)"
        ), one
        assert seconds < timeout_s
    assert rank0 == {case: (rank1[case][0], rank0[case][1]) for case in rank0}  # the same line on both ranks


def _short_names_dataset(root: Path) -> Path:
    """The _folder dataset with class ids 3 and 5 in the last two label files, and a YAML whose names list 2."""
    images = _folder(root)
    for name, content in (("09", "5 0.5 0.5 0.2 0.2\n3 0.2 0.2 0.1 0.1\n"), ("10", "5 0.4 0.4 0.2 0.2\n")):
        Path(image_to_label_path(images / f"{name}.png")).write_text(content)
    return _write_yaml(root, "short_names.yaml", "images/train")


def _build_short_names(ctx: DistContext, yaml_file: str) -> list[str]:
    """build_datasets on the short-names YAML twice (scanned, then from the label cache): each error line."""
    hyp = load_hyp(DEFAULT_HYP)
    bundle = SimpleNamespace(model=SimpleNamespace(stride=torch.tensor([8.0, 16.0, 32.0])))
    cfg = TrainConfig(hyp=hyp, batch_size=2 * ctx.world_size, imgsz=64, workers=0, cache="none", epochs=1)
    errors = []
    for _ in range(2):
        with pytest.raises(ConfigError) as caught:
            build_datasets(cfg, DETECT, load_data_config(Path(yaml_file), ctx), bundle, ctx)  # type: ignore[arg-type]
        errors.append(str(caught.value))
    return errors


SHORT_NAMES_ERROR = (
    "short_names.yaml declares 2 classes ('names') but the labels use class ids up to 5 (2 labels with class 5; "
    "3 labels in all use ids >= 2)"
)


def test_names_shorter_than_the_labels_stop_the_run_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yaml_file = _short_names_dataset(tmp_path)
    scanned, cached = _build_short_names(DistContext(), str(yaml_file))
    assert SHORT_NAMES_ERROR in scanned and str(yaml_file) in scanned and "\n" not in scanned
    first = image_to_label_path(tmp_path / "images" / "train" / "09.png")
    assert scanned.endswith(
        f"; first in {first} (2 label file(s) in all); list every class in 'names', or fix the labels"
    )
    assert cached == scanned  # the check runs on the cached labels: a rerun stops the same way
    # Names corrected, or --single-cls: the same cache serves them, nothing is scanned again.
    monkeypatch.setattr(scan_module, "_scan_in_rounds", lambda *args: pytest.fail("scanned again"))
    files = list_image_files(tmp_path / "images" / "train")
    for num_classes in (6, ANY_CLASS_ID):
        assert scan_labels(files, num_classes, DistContext()).labels[:, 0].max() == 5


@pytest.mark.slow
def test_a_run_stopped_by_its_labels_leaves_no_run_folder(tmp_path: Path) -> None:
    yaml_file = _short_names_dataset(tmp_path / "data")
    project = tmp_path / "runs"
    args = ["--data", str(yaml_file), "--cfg", "yolov8n", "--imgsz", "64", "--epochs", "1", "--batch-size", "2"]
    with pytest.raises(ConfigError, match="declares 2 classes"):
        train.main([*args, "--device", "cpu", "--workers", "0", "--project", str(project), "--noplots"])
    assert not project.exists() or not any(project.iterdir())


@pytest.mark.distributed
def test_two_ranks_stop_alike_when_only_one_rank_scanned_the_out_of_range_ids(rank_results: RankResults) -> None:
    rank0, rank1 = check_parts(rank_results.results, "short_names")  # files 09 and 10: rank 1's block of the scan
    assert rank0 == rank1 and SHORT_NAMES_ERROR in rank0[0]


def _rank_checks(ctx: DistContext, folders: dict[str, str]) -> dict[str, Any]:
    """This module's 2-rank checks in one spawned job (a job costs seconds of torch imports), the same order on both
    ranks. _scan_on_rank comes last: it sets the scan's module constants for the rest of the rank's life."""
    return {
        "build": captured(_build_on_rank, ctx, folders["build"]),
        "short_names": captured(_build_short_names, ctx, folders["short_names"]),
        "scan": captured(_scan_on_rank, ctx, folders["scan"]),
    }


@dataclass(frozen=True)
class RankResults:
    """Both ranks' results of _rank_checks, and the dataset folder (or YAML) each check read."""

    results: list[dict[str, Any]]
    folders: dict[str, Path]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> RankResults:
    """Each check's own dataset under one folder, and one spawned job running them all."""
    root = tmp_path_factory.mktemp("scan_ranks")
    folders = {
        "build": _lists_folder(root / "build"),
        "short_names": _short_names_dataset(root / "short_names"),
        "scan": _folder(root / "scan"),
    }
    results = run_distributed(_rank_checks, 2, root / "dist", {k: str(v) for k, v in folders.items()},
                              timeout_s=GROUP_TIMEOUT_S)  # fmt: skip
    return RankResults(results, folders)


def _unlabelled_folder(root: Path, num_images: int = 3) -> Path:
    """Images under root/images/train and no labels folder at all."""
    images = root / "images" / "train"
    images.mkdir(parents=True)
    for i in range(num_images):
        cv2.imwrite(str(images / f"{i}.png"), np.full((24, 32, 3), 40 * i, np.uint8))
    return images


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_train_set_without_any_label_stops_with_the_labels_folder_and_a_val_set_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = list_image_files(_unlabelled_folder(tmp_path))
    labels = tmp_path / "labels" / "train"
    with pytest.raises(ConfigError) as caught:
        scan_labels(files, 2, DistContext(), require_labels=True)
    assert str(caught.value) == (
        f"{labels}: none of the 3 train images has a label (3 label files missing, 0 empty); "
        "a train set needs labels: check that the labels folder is there and filled"
    )
    caplog.clear()
    index = scan_labels(files, 2, DistContext())  # a val set: the run goes on, with one line saying why
    assert index.counts["missing"] == 3 and len(index) == 3
    assert [w for w in _warnings(caplog) if "has a label" in w] == [
        f"{labels}: none of the 3 images has a label (3 label files missing, 0 empty); its metrics will be zero"
    ]
    # Label files that are all empty are no better; one labelled image is enough.
    labels.mkdir(parents=True)
    (labels / "0.txt").write_text("")
    with pytest.raises(ConfigError, match=r"\(2 label files missing, 1 empty\)"):
        scan_labels(files, 2, DistContext(), require_labels=True)
    (labels / "1.txt").write_text("1 0.5 0.5 0.2 0.2\n")
    caplog.clear()
    assert scan_labels(files, 2, DistContext(), require_labels=True).counts["found"] == 1
    assert not [w for w in _warnings(caplog) if "has a label" in w]


def test_the_class_id_error_names_the_first_file_even_when_its_warning_is_not_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    images = _unlabelled_folder(tmp_path, 3)
    for i in range(12):  # sorted before 1.png and 2.png, these fill the MAX_LOGGED_MESSAGES warnings shown
        (images / f"0_bad{i:02d}.jpg").write_bytes(b"not an image")
    for name in ("1", "2"):
        Path(image_to_label_path(images / f"{name}.png")).parent.mkdir(parents=True, exist_ok=True)
        Path(image_to_label_path(images / f"{name}.png")).write_text("5 0.5 0.5 0.2 0.2\n")
    files = list_image_files(images)
    first = image_to_label_path(images / "1.png")
    errors = []
    for _ in range(2):  # scanned, then from the label cache
        caplog.clear()
        with pytest.raises(ConfigError) as caught:
            scan_labels(files, 2, DistContext(), names_file=Path("d.yaml"))
        errors.append(str(caught.value))
        assert not any(first in w for w in _warnings(caplog))  # its warning was cut off
    assert errors[0] == errors[1]
    assert f"(2 labels with class 5); first in {first} (2 label file(s) in all); list every class" in errors[0]
