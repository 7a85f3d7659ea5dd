"""The image files of a split: folders, .txt image lists (entries left out are noted) and each image's label path."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from utils.errors import ConfigError

IMAGE_SUFFIXES = frozenset({".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp"})


class ImageFiles(list[str]):
    """Image paths as list_image_files returns them, with `skipped`: one line per .txt list entry left out.

    A list, so a caller that wants paths uses it as one; the label scan (utils/data/scan.py:
    scan_labels) warns about `skipped` and counts it once, on rank 0, beside the bad files it finds.
    """

    def __init__(self, paths: Iterable[str] = (), skipped: Iterable[str] = ()) -> None:
        super().__init__(paths)
        self.skipped = list(skipped)


def _read_image_list(list_file: Path) -> tuple[list[str], list[str]]:
    """Return (image paths, skip notes) of a .txt image list: one path per line, relative to the list's folder.

    An entry without an image suffix (a typo such as .jgp, or none) is left out with one note
    naming the list, its line and why: YOLOv5 drops them silently, which loses images without a word.
    """
    paths, skipped = [], []
    for line_number, line in enumerate(list_file.read_text(encoding="utf-8").splitlines(), 1):
        entry = line.strip()
        if not entry:
            continue
        suffix = Path(entry).suffix
        if suffix.lower() in IMAGE_SUFFIXES:
            paths.append(os.path.normpath(list_file.parent / entry))
            continue
        why = f"{suffix!r} is not an image suffix" if suffix else "it has no file suffix"
        known = ", ".join(sorted(IMAGE_SUFFIXES))
        skipped.append(f"image list {list_file}: line {line_number} '{entry}' left out: {why} ({known})")
    return paths, skipped


def list_image_files(sources: str | Path | Sequence[str | Path]) -> ImageFiles:
    """Return the sorted image paths under `sources`, with the .txt list entries left out (ImageFiles.skipped).

    A source is a folder (searched recursively), a .txt file listing image paths one per line
    (relative ones resolve against the .txt file's folder), or a list of those. Raises
    FileNotFoundError naming a missing source and a one-line ConfigError naming the sources when
    nothing is found. A listed path that does not exist is kept: the label scan counts it as corrupt.
    A path found more than once (a list naming it twice, a list and a folder holding it) is kept once,
    and each extra entry is one line of `skipped`: an epoch samples every image once, so repeating a
    path cannot oversample it, and dropping the repeats silently would hide that.
    """
    source_list = [sources] if isinstance(sources, str | Path) else list(sources)
    files: list[str] = []
    skipped: list[str] = []
    for source in map(Path, source_list):
        if source.is_dir():
            files += [str(p) for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
        elif source.is_file() and source.suffix.lower() == ".txt":
            listed, left_out = _read_image_list(source)
            files += listed
            skipped += left_out
        elif source.is_file() and source.suffix.lower() in IMAGE_SUFFIXES:
            files.append(str(source))
        else:
            raise FileNotFoundError(f"image source {source} does not exist (expected a folder, .txt list or image)")
    if not files:
        where = ", ".join(map(str, source_list))
        first = f"; {len(skipped)} list entries left out, first: {skipped[0]}" if skipped else ""
        raise ConfigError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found in {where}{first}")
    unique = sorted(set(files))
    if len(unique) < len(files):
        skipped += _repeated_entries(files, source_list)
    return ImageFiles(unique, skipped)


def _repeated_entries(files: list[str], sources: Sequence[str | Path]) -> list[str]:
    """One note per extra occurrence of a path in `files`, naming the path and how often it came."""
    counts: dict[str, int] = {}
    for path in files:
        counts[path] = counts.get(path, 0) + 1
    where = ", ".join(map(str, sources))
    return [
        f"{path} is listed {count} times in {where}; used once (each image is sampled once per epoch)"
        for path, count in counts.items()
        for _ in range(count - 1)
    ]


def image_to_label_path(path: str | Path) -> str:
    """Return the YOLO label path of an image: the last /images/ becomes /labels/, suffix .txt."""
    text = str(path)
    head, sep, tail = text.rpartition(f"{os.sep}images{os.sep}")
    if sep:
        text = f"{head}{os.sep}labels{os.sep}{tail}"
    return str(Path(text).with_suffix(".txt"))
