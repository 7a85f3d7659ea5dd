"""Tests for utils/data/labels.py: image listing, image/label verification, packing and the label cache."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import utils.data.image_files as image_files
import utils.data.scan as scan_module
import utils.data.scan_report as scan_report
from utils.data.cache import read_image
from utils.data.image_files import image_to_label_path, image_to_label_paths, list_image_files
from utils.data.labels import LabelIndex, _pack, label_cache_path, verify_image_label
from utils.data.loader import paths_digest
from utils.data.packed_strings import PackedStrings
from utils.data.scan import scan_labels
from utils.distributed import DistContext
from utils.errors import ConfigError, exit_on_user_error

CTX = DistContext()


def _image(path: Path, width: int = 32, height: int = 24, value: int = 128) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), np.full((height, width, 3), value, np.uint8))
    return path


def _label(root: Path, stem: str, content: str | bytes) -> Path:
    path = root / "labels" / f"{stem}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


BAD_LABELS = {
    "columns": "0 0.5 0.5 0.2\n",
    "six_columns": "0 0.1 0.1 0.5 0.1 0.5\n",
    "nan": "0 nan 0.5 0.2 0.2\n",
    "negative": "0 -0.2 0.5 0.2 0.2\n",
    "over_one": "0 0.5 1.3 0.2 0.2\n",
    "class_negative": "-1 0.5 0.5 0.2 0.2\n",
    "class_float": "1.5 0.5 0.5 0.2 0.2\n",
    "not_numeric": "0 0.5 abc 0.2 0.2\n",
    "not_utf8": b"\xff\xfe\x00\x810 0.5 0.5 0.2 0.2\n",
}


def _bad_folder(root: Path) -> tuple[set[str], set[str]]:
    """Build a folder of bad, fixable and good inputs; return (bad image paths, good image paths)."""
    images = root / "images"
    images.mkdir(parents=True)
    bad: set[str] = set()
    (images / "random_bytes.jpg").write_bytes(np.random.default_rng(0).integers(0, 256, 300, np.uint8).tobytes())
    full = cv2.imencode(".jpg", np.random.default_rng(1).integers(0, 256, (40, 40, 3), np.uint8))[1].tobytes()
    (images / "truncated.jpg").write_bytes(full[: len(full) - 200])
    (images / "zero.jpg").write_bytes(b"")
    (images / "text.jpg").write_text("this is a text file, not a JPEG\n")
    _image(images / "tiny.png", 8, 8)
    bad |= {str(images / n) for n in ("random_bytes.jpg", "truncated.jpg", "zero.jpg", "text.jpg", "tiny.png")}
    _image(images / "label_dir.jpg")
    (root / "labels" / "label_dir.txt").mkdir(parents=True)
    bad.add(str(images / "label_dir.jpg"))
    for stem, content in BAD_LABELS.items():
        bad.add(str(_image(images / f"{stem}.jpg")))
        _label(root, stem, content)
    good = {str(_image(images / n)) for n in ("box.jpg", "poly.png", "dup.jpg", "clip.jpg", "empty.jpg", "missing.bmp")}
    _label(root, "box", "0 0.5 0.5 0.4 0.2\n")
    _label(root, "poly", "1 0.1 0.2 0.6 0.2 0.6 0.8 0.1 0.8\n")
    _label(root, "dup", "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n2 0.3 0.3 0.1 0.1\n")
    _label(root, "clip", "2 0.1 0.1 1.004 0.1 0.5 0.9\n")
    _label(root, "empty", "\n  \n")
    return bad, good


def test_list_image_files_sources(tmp_path: Path) -> None:
    a = _image(tmp_path / "a" / "images" / "x.JPG")
    b = _image(tmp_path / "a" / "images" / "deep" / "y.png")
    c = _image(tmp_path / "c" / "z.webp")
    (tmp_path / "a" / "images" / "notes.txt").write_text("not an image")
    listing = tmp_path / "c" / "list.txt"
    listing.write_text("z.webp\n\n")
    assert list_image_files(tmp_path / "a") == sorted([str(a), str(b)])
    assert list_image_files(listing) == [str(c)]
    assert list_image_files([str(tmp_path / "a"), listing]) == sorted([str(a), str(b), str(c)])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        list_image_files(tmp_path / "nowhere")
    (tmp_path / "train.json").write_text("{}")  # there, but not a source of images: not 'does not exist'
    with pytest.raises(ConfigError, match="train.json is not a folder, a .txt image list or an image"):
        list_image_files(tmp_path / "train.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no images"):  # a user error: one line, no traceback
        list_image_files(tmp_path / "empty")


def test_image_list_entries_without_an_image_suffix_are_warned_once_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ds"
    kept = _image(root / "images" / "train" / "000001.jpg")
    _label(root, "train/000001", "0 0.5 0.5 0.2 0.2\n")  # root/labels/train/000001.txt
    listing = root / "train.txt"
    listing.write_text(
        "images/train/000001.jpg\n\nimages/train/000003.jgp\nimages/train/000004\nimages/train/gone.jpg\n"
    )
    files = list_image_files(listing)
    gone = str(root / "images" / "train" / "gone.jpg")
    assert files == [str(kept), gone]  # a listed path that is not there is left to the scan, which counts it
    assert files.skipped == [
        f"image list {listing}: line 3 'images/train/000003.jgp' left out: '.jgp' is not an image suffix "
        "(.bmp, .dng, .jpeg, .jpg, .mpo, .pfm, .png, .tif, .tiff, .webp)",
        f"image list {listing}: line 4 'images/train/000004' left out: it has no file suffix "
        "(.bmp, .dng, .jpeg, .jpg, .mpo, .pfm, .png, .tif, .tiff, .webp)",
    ]
    caplog.set_level(logging.INFO)
    index = scan_labels(files, 1, CTX)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for entry in ("000003.jgp", "000004'", f"corrupt image {gone}: file not found; skipped"):
        assert sum(entry in w for w in warnings) == 1, entry
    assert "1 found, 0 missing (background), 0 empty, 1 corrupt, 2 file(s) left out before the scan" in caplog.text
    assert index.im_files == [str(kept)]
    # Nothing usable in the list: one line naming the list and the first entry left out.
    listing.write_text("images/train/000003.jgp\n")
    with pytest.raises(ConfigError, match=r"no images .* found in .*train\.txt; 1 file\(s\) left out, first: "):
        list_image_files(listing)


def test_repeated_image_paths_are_used_once_warned_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ds"
    images = [_image(root / "images" / "train" / f"00000{i}.jpg") for i in range(2)]
    listing = root / "train.txt"
    listing.write_text("images/train/000000.jpg\nimages/train/000000.jpg\nimages/train/000000.jpg\n")
    files = list_image_files([listing, root / "images" / "train"])  # the folder holds 000000 once more
    assert files == [str(path) for path in images]
    where = f"{listing}, {root / 'images' / 'train'}"
    repeat = f"{images[0]} is listed 4 times in {where}; used once (each image is sampled once per epoch)"
    assert files.skipped == [repeat] * 3  # one line per extra entry: the summary counts entries
    caplog.set_level(logging.INFO)
    scan_labels(files, 1, CTX)
    assert "0 found, 2 missing (background), 0 empty, 0 corrupt, 3 file(s) left out before the scan" in caplog.text
    assert list_image_files(root / "images" / "train").skipped == []


def test_folders_are_searched_through_links_and_no_image_goes_unseen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ds"
    train = root / "images" / "train"
    kept = [_image(train / "a.jpg"), _image(train / "b.jpg", value=90).rename(train / "b.mpo")]  # a JPEG, as YOLOv5
    inside = _image(train / "z_real" / "e.jpg")
    elsewhere = _image(tmp_path / "store" / "c.jpg")
    (train / "linked").symlink_to(elsewhere.parent, target_is_directory=True)  # outside the split: followed
    (train / "linked" / "again").symlink_to(elsewhere.parent, target_is_directory=True)  # that folder again
    (train / "a_link").symlink_to(inside.parent, target_is_directory=True)  # inside: reached by its own path
    (train / "loop").symlink_to(train, target_is_directory=True)  # back up the tree
    (train / "up").symlink_to(root / "images", target_is_directory=True)  # holds val too: not followed
    _image(root / "images" / "val" / "v.jpg")
    (train / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (train / "d.gif").write_bytes(b"GIF89a")
    (train / "notes.json").write_text("{}")  # not an image type: not named
    _label(root, "train/a", "0 0.5 0.5 0.2 0.2\n")
    _label(root, "train/z_real/e", "0 0.5 0.5 0.2 0.2\n")
    files = list_image_files(train)
    linked, gone = str(train / "linked" / "c.jpg"), str(train / "gone.jpg")
    assert files == sorted([*map(str, kept), str(inside), linked, gone])
    holds = "which holds this split's folder"
    assert files.skipped == [
        f"{train / 'loop'}: left out: a link to {train}, {holds} {train}",
        f"{train / 'up'}: left out: a link to {root / 'images'}, {holds} {train}",
        f"{train / 'd.gif'}: left out: .gif images are not read "
        "(.bmp, .dng, .jpeg, .jpg, .mpo, .pfm, .png, .tif, .tiff, .webp); convert it to train on it",
    ]
    assert files.cache_path == root / "labels" / "train.cache"
    caplog.set_level(logging.INFO)
    index = scan_labels(files, 1, CTX)
    assert sorted(index.im_files) == sorted([*map(str, kept), str(inside), linked])  # the dangling link: corrupt
    assert f"corrupt image {gone}: file not found; skipped" in caplog.text
    assert "2 found, 2 missing (background), 0 empty, 1 corrupt, 3 file(s) left out before the scan" in caplog.text


def test_a_folder_that_cannot_be_listed_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = tmp_path / "images" / "train"
    kept = _image(train / "a.jpg")
    _image(train / "locked" / "b.jpg")
    real_scandir = os.scandir

    def scandir(path: str) -> object:
        if os.fspath(path).endswith("locked"):  # as a folder of another user's, mode 700, is to us
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    files = list_image_files(train)
    assert files == [str(kept)]
    assert files.skipped == [f"{train / 'locked'}: left out: the folder cannot be listed (Permission denied)"]


def test_images_sharing_a_label_file_are_named_and_lists_keep_caches_of_their_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ds"
    images = [_image(root / "images" / name) for name in ("x.jpg", "x.png", "y.jpg", "z.jpg")]
    _label(root, "x", "0 0.5 0.5 0.2 0.2\n")
    (root / "train.txt").write_text("images/x.jpg\nimages/x.png\nimages/y.jpg\n")
    (root / "val.txt").write_text("images/z.jpg\n")
    train = list_image_files(root / "train.txt")
    label = root / "labels" / "x.txt"
    shared = f"{label}: the label file of 2 images ({images[0]}, {images[1]}); each trains with these labels"
    assert train.notes == [shared]
    caplog.set_level(logging.INFO)
    scan_labels(train, 1, CTX)
    scan_labels(list_image_files(root / "val.txt"), 1, CTX)
    assert sum(shared in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    # YOLOv5's autosplit layout: each list's cache beside it, so alternating splits reuse theirs.
    assert (root / "train.cache").is_file() and (root / "val.cache").is_file()
    caplog.clear()
    scan_labels(list_image_files(root / "train.txt"), 1, CTX)
    assert f"{root / 'train.cache'} (cached)" in caplog.text
    # Splits of several sources are keyed on all of them: train [a, b] and val a keep a cache each.
    for name in ("a", "b"):
        _image(root / "images" / name / f"{name}.jpg")
    both = list_image_files([root / "images" / "a", root / "images" / "b"])
    first = list_image_files(root / "images" / "a")
    assert first.cache_path == root / "labels" / "a.cache"
    assert both.cache_path.parent == first.cache_path.parent and both.cache_path.name.startswith("a-")
    assert label_cache_path(both) == both.cache_path and label_cache_path(list(both)) == first.cache_path


def test_warnings_past_the_logged_ones_are_all_written_beside_the_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ds"
    count = scan_report.MAX_LOGGED_MESSAGES + 3
    for i in range(count):
        _image(root / "images" / "train" / f"{i:02d}.jpg")
        _label(root, f"train/{i:02d}", "0 0.5 7 0.2 0.2\n" if i else "0 0.5 0.5 0.2 0.2\n0.5\n")
    caplog.set_level(logging.INFO)
    with pytest.raises(ConfigError):  # every image is corrupt: after the report
        scan_labels(list_image_files(root / "images" / "train"), 1, CTX)
    written = root / "labels" / "train.warnings.txt"
    assert f"... and 3 more label/image warnings; all {count} are in {written}" in caplog.text
    lines = written.read_text().splitlines()
    assert len(lines) == count and all("corrupt" in line for line in lines) and "12.txt" in lines[-1]
    assert not list(written.parent.glob(".*.tmp"))
    for i in range(1, count):  # fixed: the next scan prints every warning, and the old file goes
        _label(root, f"train/{i:02d}", "0 0.5 0.5 0.2 0.2\n")
    scan_labels(list_image_files(root / "images" / "train"), 1, CTX)
    assert not written.exists()


def test_the_log_names_files_left_out_before_repaired_ones(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ds"
    count = scan_report.MAX_LOGGED_MESSAGES + 5
    for i in range(count):  # every label overhangs the edge a little: repaired (clipped) and kept
        _image(root / "images" / f"{i:02d}.jpg")
        _label(root, f"{i:02d}", "0 0.5 0.5 0.2 1.01\n")
    (root / "images" / "99_broken.jpg").write_bytes(b"not an image")  # last in file order
    caplog.set_level(logging.INFO)
    index = scan_labels(list_image_files(root / "images"), 1, CTX)
    assert index.counts["corrupt"] == 1 and index.counts["found"] == count
    shown = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][: scan_report.MAX_LOGGED_MESSAGES]
    assert "99_broken.jpg" in shown[0] and shown[0].endswith("skipped")
    assert all("fixed label" in line for line in shown[1:]) and "00.txt" in shown[1]  # then the repairs, in order
    assert "99_broken.jpg" in (root / "labels.warnings.txt").read_text().splitlines()[-1]  # the file: file order


def test_folder_listing_reads_suffixes_as_splitext_does() -> None:
    parts = ["", ".", "..", "a", "jpg", ".jpg", "A.JPG", "x.y"]
    for count in (1, 2, 3):
        for name in map("".join, itertools.product(parts, repeat=count)):
            assert image_files._splitext_suffix(name) == os.path.splitext(name)[1].lower(), name


def test_image_to_label_path_replaces_last_images_folder() -> None:
    assert image_to_label_path("/d/images/set/images/x.jpeg") == "/d/images/set/labels/x.txt"
    assert image_to_label_path("/d/pics/x.png") == "/d/pics/x.txt"


def test_image_to_label_path_equals_pathlibs_answer_for_odd_names() -> None:
    def by_pathlib(path: str) -> str:
        head, sep, tail = path.rpartition(f"{os.sep}images{os.sep}")
        return str(Path(f"{head}{os.sep}labels{os.sep}{tail}" if sep else path).with_suffix(".txt"))

    parts = ["a", ".", "..", "images", "x.jpg", "x.", ".x", "x..jpg", "a.b.c", "", "\u00e9 y.PNG"]
    paths = []
    for count in (1, 2, 3):
        for names in itertools.product(parts, repeat=count):
            for lead in ("", os.sep, f".{os.sep}", os.sep * 2):
                path = lead + os.sep.join(names)
                if Path(path).name:  # with_suffix refuses an empty name, as image_to_label_path does
                    assert image_to_label_path(path) == by_pathlib(path), path
                    paths.append(path)
    # The list form, which works out each folder once, gives the same answers, whatever came before in the list.
    assert image_to_label_paths(paths) == [by_pathlib(path) for path in paths]
    assert image_to_label_paths(paths[::-1]) == [by_pathlib(path) for path in paths[::-1]]


def test_scan_skips_bad_repairs_fixable_and_reports_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad, good = _bad_folder(tmp_path)
    monkeypatch.setattr(scan_report, "MAX_LOGGED_MESSAGES", 100)
    caplog.set_level(logging.INFO)
    index = scan_labels(list_image_files(tmp_path / "images"), 3, CTX, num_workers=4)
    assert set(index.im_files) == good
    assert index.counts == {"found": 4, "missing": 1, "empty": 1, "corrupt": len(bad)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for path in bad:
        label = image_to_label_path(path)
        assert sum(path in w or label in w for w in warnings) == 1, f"no single warning names {path}"
    assert any("zero.jpg" in w and "0-byte" in w for w in warnings)
    assert any("truncated.jpg" in w and "truncated JPEG" in w for w in warnings)
    assert any("dup.txt" in w and "1 duplicate" in w for w in warnings)
    assert any("clip.txt" in w and "clipped 1" in w for w in warnings)
    assert f"4 found, 1 missing (background), 1 empty, {len(bad)} corrupt" in caplog.text
    position = {Path(p).stem: i for i, p in enumerate(index.im_files)}
    np.testing.assert_allclose(index.labels_of(position["dup"])[:, 0], [0, 2])
    clipped = index.segments_of(position["clip"])[0]
    assert clipped[:, 0].max() == 1.0
    np.testing.assert_allclose(index.labels_of(position["clip"]), [[2, 0.55, 0.5, 0.9, 0.8]], atol=1e-6)
    assert len(index.labels_of(position["empty"])) == len(index.labels_of(position["missing"])) == 0


def test_scan_logs_first_ten_then_a_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad, _ = _bad_folder(tmp_path)
    caplog.set_level(logging.INFO)
    scan_labels(list_image_files(tmp_path / "images"), 3, CTX)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 11
    assert f"and {len(bad) + 2 - 10} more" in warnings[-1]  # + the two repaired files


def test_non_zero_rank_does_not_log_scan_results(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _bad_folder(tmp_path)
    caplog.set_level(logging.INFO)
    scan_labels(list_image_files(tmp_path / "images"), 3, DistContext(rank=1, local_rank=1, world_size=2))
    assert "corrupt" not in caplog.text


def test_boxes_become_corners_and_polygons_give_tight_boxes(tmp_path: Path) -> None:
    image = _image(tmp_path / "images" / "a.jpg", 50, 40)
    label = _label(tmp_path, "a", "0 0.5 0.5 0.4 0.2\n1 0.1 0.2 0.7 0.3 0.4 0.9\n2 0.95 0.5 0.2 0.2\n")
    record = verify_image_label(str(image), str(label))
    assert (record.status, record.shape_wh) == ("found", (50, 40))
    np.testing.assert_allclose(record.segments[0], [[0.3, 0.4], [0.7, 0.4], [0.7, 0.6], [0.3, 0.6]], atol=1e-6)
    np.testing.assert_allclose(record.labels[1], [1, 0.4, 0.55, 0.6, 0.7], atol=1e-6)
    # A box that overhangs the right edge keeps only its visible part, and the cut is noted as a repair.
    assert record.message == f"fixed label {label}: clipped 1 box(es) overhanging the image edge by more than 0.01"
    np.testing.assert_allclose(record.labels[2], [2, 0.925, 0.5, 0.15, 0.2], atol=1e-6)
    assert record.labels.dtype == np.float32 and record.labels.shape == (3, 5)


def test_index_is_packed_with_offsets(tmp_path: Path) -> None:
    for stem, text in (
        ("a", "0 0.5 0.5 0.2 0.2\n1 0.1 0.1 0.3 0.1 0.2 0.4 0.1 0.3\n"),
        ("b", ""),
        ("c", "2 .5 .5 .1 .1"),
    ):
        _image(tmp_path / "images" / f"{stem}.jpg")
        _label(tmp_path, stem, text)
    index = scan_labels(list_image_files(tmp_path / "images"), 3, CTX)
    assert index.shapes.dtype == np.int32 and index.shapes.shape == (3, 2)
    assert index.labels.dtype == np.float32 and index.labels.shape == (3, 5)
    assert index.label_offsets.tolist() == [0, 2, 2, 3]
    assert index.seg_offsets.tolist() == [0, 4, 8, 12]
    assert index.seg_points.shape == (12, 2) and index.seg_points.dtype == np.float32
    polygons = index.segments_of(0)
    assert [len(p) for p in polygons] == [4, 4] and np.shares_memory(polygons[1], index.seg_points)
    np.testing.assert_allclose(polygons[1][2], [0.2, 0.4])
    assert index.segments_of(1) == [] and index.labels_of(1).shape == (0, 5)


def test_label_cache_reused_then_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(3):
        _image(tmp_path / "images" / f"{i}.jpg")
        _label(tmp_path, str(i), f"{i} 0.5 0.5 0.2 0.2\n")
    files = list_image_files(tmp_path / "images")
    first = scan_labels(files, 3, CTX)
    cache = label_cache_path(files)
    assert cache == tmp_path / "labels.cache" and cache.is_file()
    assert not first.labels.flags.writeable and not first.shapes.flags.writeable  # the scan returns the file's map
    with np.load(cache, allow_pickle=False) as data:  # pickle-free on disk
        assert PackedStrings(data["im_files_data"], data["im_files_offsets"]) == files

    def must_not_verify(*args: object) -> None:
        raise AssertionError("verified again although the cache is valid")

    monkeypatch.setattr(scan_module, "verify_files", must_not_verify)
    second = scan_labels(files, 3, CTX)
    np.testing.assert_array_equal(second.labels, first.labels)
    assert second.counts == first.counts and second.im_files == first.im_files
    assert isinstance(second.im_files, PackedStrings) and not second.im_files.data.flags.writeable  # the file's map
    monkeypatch.undo()
    label = tmp_path / "labels" / "1.txt"
    label.write_text("2 0.5 0.5 0.4 0.4\n2 0.2 0.2 0.1 0.1\n")
    os.utime(label, ns=(label.stat().st_atime_ns, label.stat().st_mtime_ns + 10**9))
    third = scan_labels(files, 3, CTX)
    assert third.labels_of(1)[:, 0].tolist() == [2, 2]
    monkeypatch.setattr(scan_module, "verify_files", must_not_verify)
    # The cache serves any class count: too few classes stop the run from it, without a second scan.
    with pytest.raises(ConfigError, match="declares 2 classes"):
        scan_labels(files, 2, CTX)


def test_unwritable_cache_warns_and_continues(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _image(tmp_path / "images" / "a.jpg")
    files = list_image_files(tmp_path / "images")
    index = scan_labels(files, 1, CTX, cache_path=tmp_path / "no_such_dir" / "x.cache")
    assert len(index) == 1 and index.counts["missing"] == 1
    assert sum("not writable" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp", ".tif"])
def test_exif_rotation_swaps_width_and_height_as_the_decoder_does(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / "images" / f"rotated{suffix}"
    path.parent.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    Image.new("RGB", (40, 20)).save(path, exif=exif.tobytes())
    # What the training decoder gives (a TIFF's size Pillow may report turned already: the decoder decides).
    assert read_image(str(path)).shape[:2] == (40, 20)
    assert verify_image_label(str(path), str(tmp_path / "none.txt")).shape_wh == (20, 40)


def test_all_corrupt_is_one_line_naming_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"")
    with pytest.raises(SystemExit) as stop:  # what train.py and val.py do with it: no traceback
        exit_on_user_error(lambda: scan_labels(list_image_files(tmp_path / "images"), 1, CTX))
    assert stop.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the scan's progress bar
    assert error == f"error: {tmp_path / 'images'}: no usable images (all 1 are corrupt; see the warnings)"


def test_label_errors_name_the_line_in_the_file(tmp_path: Path) -> None:
    image = str(_image(tmp_path / "images" / "a.jpg"))

    def message(content: str) -> str:
        return verify_image_label(image, str(_label(tmp_path, "a", content))).message

    # Blank lines and a duplicate row come before the bad row: the error names its line, 5.
    box = "0 0.5 0.5 0.2 0.2\n"
    assert "line 5 has a non-finite value" in message(f"\n{box}\n{box}0 nan 0.5 0.2 0.2\n")
    assert "line 4 coordinate 7 is outside [0, 1]" in message(f"{box}{box}\n1 0.5 7 0.2 0.2\n")
    assert "line 3 class id 1.5 is not a non-negative integer" in message(f"{box}  \n1.5 0.5 0.5 0.2 0.2\n")


def test_a_box_overhanging_the_image_is_noted_beyond_the_tolerance_only(tmp_path: Path) -> None:
    image = str(_image(tmp_path / "images" / "a.jpg"))

    def verify(content: str) -> object:
        return verify_image_label(image, str(_label(tmp_path, "a", content)))

    rounding = verify("0 0.9 0.5 0.205 0.2\n1 0.0951 0.5 0.2 0.2\n")  # edges 0.0025 and 0.0049 outside: rounding
    assert rounding.status == "found" and rounding.message == ""
    overhang = verify("2 0.95 0.5 0.3 0.3\n0 0.5 0.03 0.2 0.1\n1 0.5 0.5 0.2 0.2\n")  # right by 0.1, top by 0.02
    assert overhang.message.endswith("clipped 2 box(es) overhanging the image edge by more than 0.01")
    np.testing.assert_allclose(overhang.labels[:2], [[2, 0.9, 0.5, 0.2, 0.3], [0, 0.5, 0.04, 0.2, 0.08]], atol=1e-6)


def test_degenerate_instances_are_dropped_counted_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    image = _image(tmp_path / "images" / "mixed.jpg")
    mixed = _label(
        tmp_path,
        "mixed",
        "0 0.1 0.1 0.5 0.5 0.9 0.9\n"  # collinear: zero area
        "1 0.2 0.2 0.2 0.2 0.2 0.2\n"  # one point three times
        "2 0.5 0.5 0 0.3\n"  # box of zero width
        "0 0.1 0.1 0.4 0.1 0.4 0.4\n"  # kept: triangle
        "1 0.5 0.5 0.2 0.2\n"  # kept: box
        "2 0.5 0.5 0.001 0.001\n"  # kept: tiny (1e-6 of the image) but not degenerate
        "0 0.2 0.2 0.8 0.8 0.8 0.2 0.2 0.8\n",  # kept: a figure 8, whose signed (shoelace) areas cancel to 0
    )
    record = verify_image_label(str(image), str(mixed))
    assert record.status == "found" and record.num_degenerate == 3
    assert record.labels[:, 0].tolist() == [0, 1, 2, 0] and len(record.segments) == 4
    assert record.message == f"fixed label {mixed}: dropped 3 degenerate (zero-area) instance(s)"
    _image(tmp_path / "images" / "flat.jpg")
    flat = _label(tmp_path, "flat", "0 0.3 0.3 0.6 0.6 0.9 0.9\n")
    _image(tmp_path / "images" / "good.jpg")
    _label(tmp_path, "good", "1 0.5 0.5 0.2 0.2\n")
    caplog.set_level(logging.INFO)
    files = list_image_files(tmp_path / "images")
    index = scan_labels(files, 3, CTX)
    assert index.num_degenerate == 4 and len(index.labels) == 5
    assert index.counts == {"found": 2, "missing": 0, "empty": 1, "corrupt": 0}  # all rows dropped: background
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warnings) == sorted(
        [record.message, f"fixed label {flat}: dropped 1 degenerate (zero-area) instance(s)"]
    )
    assert "2 found, 0 missing (background), 1 empty, 0 corrupt, 4 degenerate instance(s) dropped" in caplog.text
    caplog.clear()
    cached = scan_labels(files, 3, CTX)
    assert "(cached)" in caplog.text and cached.num_degenerate == 4
    assert cached.reordered(np.array([2, 1, 0])).num_degenerate == 4
    assert isinstance(cached.messages, PackedStrings) and list(cached.messages) == list(index.messages)
    with np.load(label_cache_path(files), allow_pickle=False) as data:  # the lines' bytes, none padded to the longest
        assert data["messages_data"].nbytes == sum(len(os.fsencode(message)) for message in index.messages)


def test_class_ids_say_what_is_wrong_and_any_integer_id_is_kept_for_the_class_check(tmp_path: Path) -> None:
    image = str(_image(tmp_path / "images" / "a.jpg"))

    def verify(content: str) -> object:
        return verify_image_label(image, str(_label(tmp_path, "a", content)))

    # Whether an id is among the dataset's classes is decided on the whole index (check_class_ids), not here.
    record = verify("0 0.5 0.5 0.2 0.2\n3 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n")
    assert record.status == "found" and record.labels[:, 0].tolist() == [0, 3, 1] and record.message == ""
    assert "coordinate 7 is outside [0, 1]" in verify("3 0.5 0.5 0.2 0.2\n0 0.5 7.0 0.2 0.2\n").message
    assert "is not a non-negative integer" in verify("1.5 0.5 0.5 0.2 0.2\n").message
    assert "class id -1 is not a non-negative integer" in verify("-1 0.5 0.5 0.2 0.2\n").message


def test_label_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    image = _image(tmp_path / "images" / "bom.jpg")
    label = _label(tmp_path, "bom", "\ufeff0 0.5 0.5 0.2 0.2\n".encode("utf-8"))
    record = verify_image_label(str(image), str(label))
    assert record.status == "found" and record.message == ""
    np.testing.assert_allclose(record.labels, [[0, 0.5, 0.5, 0.2, 0.2]], rtol=1e-6)


def test_jpeg_missing_only_its_end_marker_is_kept_and_a_truncated_one_is_not(tmp_path: Path) -> None:
    pixels = cv2.GaussianBlur(np.random.default_rng(2).integers(0, 256, (48, 64, 3), np.uint8), (5, 5), 0)
    full = cv2.imencode(".jpg", pixels)[1].tobytes()
    assert full.endswith(b"\xff\xd9")
    images = tmp_path / "images"
    images.mkdir()
    (images / "no_eoi.jpg").write_bytes(full[:-2])
    (images / "cut.jpg").write_bytes(full[:-40])
    kept = verify_image_label(str(images / "no_eoi.jpg"), str(tmp_path / "labels" / "no_eoi.txt"))
    assert kept.status == "missing" and kept.shape_wh == (64, 48)
    assert "without end-of-image marker" in kept.message and "kept" in kept.message
    assert read_image(str(images / "no_eoi.jpg")).shape == (48, 64, 3)  # and training decodes it (OpenCV 5 too)
    cut = verify_image_label(str(images / "cut.jpg"), str(tmp_path / "labels" / "cut.txt"))
    assert cut.status == "corrupt" and "truncated JPEG" in cut.message


def test_every_image_the_scan_keeps_is_one_opencv_decodes(tmp_path: Path) -> None:
    """PIL checks the files, OpenCV decodes them for training: a TIFF of 32-bit samples opens in one, not the other."""
    gray = np.random.default_rng(3).integers(0, 256, (40, 50)).astype(np.float64)
    images = tmp_path / "images"
    images.mkdir()
    kinds = {
        "float32.tif": Image.fromarray(gray.astype(np.float32)), "int32.tif": Image.fromarray(gray.astype(np.int32)),
        "uint16.tif": Image.fromarray((gray * 257).astype(np.uint16)),
        "uint16.png": Image.fromarray((gray * 257).astype(np.uint16)),
        "gray.tif": Image.fromarray(gray.astype(np.uint8)),
        "cmyk.jpg": Image.fromarray(np.dstack([gray] * 3).astype(np.uint8)).convert("CMYK"),
        "rgba.png": Image.fromarray(np.dstack([gray] * 4).astype(np.uint8)),
    }  # fmt: skip
    for name, image in kinds.items():
        image.save(images / name)
        record = verify_image_label(str(images / name), str(tmp_path / "labels" / "none.txt"))
        decodes = cv2.imread(str(images / name), cv2.IMREAD_COLOR) is not None
        assert (record.status != "corrupt") == decodes, name
        if not decodes:
            assert "32-bit samples" in record.message and name in record.message
    assert sum(cv2.imread(str(images / name)) is None for name in kinds) == 2  # float32 and int32


def test_file_names_that_are_not_utf8_are_scanned_and_read(tmp_path: Path) -> None:
    from utils.data.cache import read_image

    images = tmp_path / "images"
    images.mkdir()
    name = os.fsdecode(os.fsencode(images) + b"/caf\xe9.jpg")  # Latin-1 byte: not valid UTF-8
    ok, encoded = cv2.imencode(".jpg", np.full((30, 40, 3), 90, np.uint8))
    Path(name).write_bytes(encoded.tobytes())
    _label(tmp_path, os.fsdecode(b"caf\xe9"), "0 0.5 0.5 0.2 0.2\n")
    _image(images / "plain.jpg", 40, 30)
    index = scan_labels(list_image_files(images), 1, CTX)
    assert sorted(os.fsencode(p).rsplit(b"/", 1)[-1] for p in index.im_files) == [b"caf\xe9.jpg", b"plain.jpg"]
    assert index.counts["found"] == 1
    image = read_image(name)
    assert image is not None and image.shape == (30, 40, 3)
    # A mid-epoch save and a resume hash the paths (the loader's geometry): as bytes, as the other digests do.
    assert paths_digest(index.im_files) == hashlib.sha1(b"\n".join(os.fsencode(p) for p in index.im_files)).hexdigest()
    # An image list names it by its bytes too, and one saved with a byte-order mark (Notepad) keeps its first line.
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"\xef\xbb\xbfimages/plain.jpg\r\nimages/caf\xe9.jpg\n")
    listed = list_image_files(listing)
    assert sorted(listed) == sorted(index.im_files) and not listed.skipped


def test_reordered_index_gives_each_image_its_own_labels_and_polygons() -> None:
    rng = np.random.default_rng(0)
    labels = [rng.random((int(rng.integers(0, 4)), 5)).astype(np.float32) for _ in range(60)]
    polygons = [[rng.random((int(rng.integers(3, 9)), 2)).astype(np.float32) for _ in rows] for rows in labels]
    packed = _pack(labels, polygons)
    index = LabelIndex([f"{i}.jpg" for i in range(60)], np.arange(120, dtype=np.int32).reshape(60, 2), *packed, {}, [])
    order = np.concatenate([rng.permutation(60), [5, 5]])  # repeats allowed
    moved = index.reordered(order)
    assert list(moved.im_files) == [f"{i}.jpg" for i in order] and len(moved) == 62
    for k, i in enumerate(order):
        np.testing.assert_array_equal(moved.shapes[k], index.shapes[i])
        np.testing.assert_array_equal(moved.labels_of(k), labels[i])
        assert len(moved.segments_of(k)) == len(polygons[i])
        for got, want in zip(moved.segments_of(k), polygons[i], strict=True):
            np.testing.assert_array_equal(got, want)
    assert moved.labels.dtype == np.float32 and moved.seg_offsets.dtype == np.int64
    nothing = index.reordered(np.zeros(0, np.int64))
    assert len(nothing) == 0 and nothing.labels.shape == (0, 5) and nothing.seg_points.shape == (0, 2)
