"""The image files of a split: folders, .txt image lists (entries left out are noted) and each image's label path."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from utils.errors import ConfigError

# YOLOv5's image types (a .dng or .pfm OpenCV cannot decode is counted corrupt by the scan, not dropped unseen).
IMAGE_SUFFIXES = frozenset({".bmp", ".dng", ".jpg", ".jpeg", ".mpo", ".pfm", ".png", ".tif", ".tiff", ".webp"})
# Image types found in a split's folder that are not read: each is named and counted, never dropped unseen.
OTHER_IMAGE_SUFFIXES = frozenset(
    {".avif", ".gif", ".heic", ".heif", ".jfif", ".jp2", ".jxl", ".pbm", ".pgm", ".pnm", ".ppm", ".svg"}
)


class ImageFiles(list[str]):
    """Image paths as list_image_files returns them, with what the label scan reports beside its own findings.

    `skipped`: one line per file left out before the scan (a .txt list entry that is no image, a path
    listed twice, an image of a type not read); `notes`: warnings about files kept (images sharing a
    label file); `cache_path`: where their label cache lives (see _cache_path).
    A list, so a caller that wants paths uses it as one; the label scan (utils/data/scan.py:
    scan_labels) warns about both and counts `skipped` once, on rank 0, beside the bad files it finds.
    """

    def __init__(
        self,
        paths: Iterable[str] = (),
        skipped: Iterable[str] = (),
        notes: Iterable[str] = (),
        cache_path: Path | None = None,
    ) -> None:
        super().__init__(paths)
        self.skipped = list(skipped)
        self.notes = list(notes)
        self.cache_path = cache_path


def list_lines(list_file: Path) -> list[str]:
    """The lines of a .txt list as file-system names: os.fsdecode (bytes that are not UTF-8 name the file they
    name on disk, as a folder listing gives them), a UTF-8 byte-order mark before the first dropped."""
    return os.fsdecode(list_file.read_bytes().removeprefix(b"\xef\xbb\xbf")).splitlines()


def _read_image_list(list_file: Path) -> tuple[list[str], list[str]]:
    """Return (image paths, skip notes) of a .txt image list: one path per line, relative to the list's folder.

    An entry without an image suffix (a typo such as .jgp, or none) is left out with one note
    naming the list, its line and why: YOLOv5 drops them silently, which loses images without a word.
    Lines are file-system names (list_lines).
    """
    paths, skipped = [], []
    folder = str(list_file.parent)
    for line_number, line in enumerate(list_lines(list_file), 1):
        entry = line.strip()
        if not entry:
            continue
        # os.path, not pathlib: 1M entries took 12 s with Path objects
        suffix = name_suffix(os.path.basename(os.path.normpath(entry)))
        if suffix.lower() in IMAGE_SUFFIXES:
            paths.append(os.path.normpath(os.path.join(folder, entry)))
            continue
        why = f"{suffix!r} is not an image suffix" if suffix else "it has no file suffix"
        known = ", ".join(sorted(IMAGE_SUFFIXES))
        skipped.append(f"image list {list_file}: line {line_number} '{entry}' left out: {why} ({known})")
    return paths, skipped


def name_suffix(name: str) -> str:
    """A file name's suffix as pathlib gives it: from the last dot, unless the name starts or ends there ('' then)."""
    dot = name.rfind(".")
    return name[dot:] if 0 < dot < len(name) - 1 else ""


def list_image_files(sources: str | Path | Sequence[str | Path]) -> ImageFiles:
    """Return the sorted image paths under `sources`, with what was left out (ImageFiles.skipped) and noted.

    A source is a folder (searched recursively, into linked folders too), a .txt file listing image
    paths one per line (relative ones resolve against the .txt file's folder), or a list of those.
    Raises FileNotFoundError naming a missing source and a one-line ConfigError naming the sources
    when nothing is found. A listed path that does not exist, or a link in a folder whose target is
    gone, is kept: the label scan counts it as corrupt. A path found more than once (a list naming it
    twice, a list and a folder holding it) is kept once, and each extra entry is one line of
    `skipped`: an epoch samples every image once, so repeating a path cannot oversample it, and
    dropping the repeats silently would hide that. Images whose label path is the same file (x.jpg
    and x.png) are kept and noted: both train with that file's labels. A source that is there but is
    none of those (a .zip, a COCO .json) is a one-line ConfigError, not "does not exist".
    """
    source_list = [sources] if isinstance(sources, str | Path) else list(sources)
    files: list[str] = []
    skipped: list[str] = []
    for source in map(Path, source_list):
        if source.is_dir():
            found, left_out = _folder_images(source)
            files += found
            skipped += left_out
        elif source.is_file() and source.suffix.lower() == ".txt":
            listed, left_out = _read_image_list(source)
            files += listed
            skipped += left_out
        elif source.is_file() and source.suffix.lower() in IMAGE_SUFFIXES:
            files.append(str(source))
        elif source.exists():
            raise ConfigError(f"image source {source} is not a folder, a .txt image list or an image")
        else:
            raise FileNotFoundError(f"image source {source} does not exist (expected a folder, .txt list or image)")
    if not files:
        where = ", ".join(map(str, source_list))
        first = f"; {len(skipped)} file(s) left out, first: {skipped[0]}" if skipped else ""
        raise ConfigError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found in {where}{first}")
    unique = sorted(set(files))
    if len(unique) < len(files):
        skipped += _repeated_entries(files, source_list)
    return ImageFiles(unique, skipped, _shared_label_files(unique), _cache_path(source_list))


def _folder_images(folder: Path) -> tuple[list[str], list[str]]:
    """(image paths, skip notes) under `folder`, recursively, and into linked folders outside it.

    A linked folder inside `folder` is reached by its own path anyway (its labels are found there,
    not under the link's name), and one that holds `folder` would pull in other splits: neither is
    followed, the second with a note. Links to files are kept whether or not their target exists (a
    dangling one is counted corrupt by the scan). An image of a type that is not read
    (OTHER_IMAGE_SUFFIXES) and a folder that cannot be listed are one skip note each.
    """
    root = os.path.realpath(folder)
    images: list[str] = []
    skipped: list[str] = []
    visited: set[str] = set()  # real folders walked: two links to one outside folder list it once

    def unlisted(error: OSError) -> None:
        skipped.append(f"{error.filename}: left out: the folder cannot be listed ({error.strerror or error})")

    for directory, subdirectories, names in os.walk(str(folder), onerror=unlisted, followlinks=True):
        visited.add(os.path.realpath(directory))
        kept = []
        for name in sorted(subdirectories):
            path = os.path.join(directory, name)
            real = os.path.realpath(path)
            if not os.path.islink(path):
                kept.append(name)
            elif root == real or root.startswith(real + os.sep):
                skipped.append(f"{path}: left out: a link to {real}, which holds this split's folder {folder}")
            elif not real.startswith(root + os.sep) and real not in visited:
                visited.add(real)
                kept.append(name)
        subdirectories[:] = kept
        prefix = os.path.join(directory, "")  # os.path.join(directory, name) for every name, a third of its cost
        for name in names:
            suffix = _splitext_suffix(name)
            if suffix in IMAGE_SUFFIXES:
                images.append(prefix + name)
            elif suffix in OTHER_IMAGE_SUFFIXES:
                path = prefix + name
                known = ", ".join(sorted(IMAGE_SUFFIXES))
                skipped.append(f"{path}: left out: {suffix} images are not read ({known}); convert it to train on it")
    return images, skipped


def _splitext_suffix(name: str) -> str:
    """`os.path.splitext(name)[1].lower()` of a file name (no separator), in half its time.

    As splitext: from the last dot, unless only dots come before it (".jpg", "..jpg" have none).
    """
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and name.count(".", 0, dot) < dot else ""


def _shared_label_files(image_files: Sequence[str]) -> list[str]:
    """One note per label file that several of `image_files` map to (x.jpg and x.png: labels/x.txt)."""
    label_files = image_to_label_paths(image_files)
    if len(set(label_files)) == len(label_files):  # the usual case, without a list per label
        return []
    by_label: dict[str, list[str]] = {}
    for path, label in zip(image_files, label_files, strict=True):
        by_label.setdefault(label, []).append(path)
    return [
        f"{label}: the label file of {len(images)} images ({', '.join(images)}); each trains with these labels"
        for label, images in by_label.items()
        if len(images) > 1
    ]


def _cache_path(sources: Sequence[str | Path]) -> Path | None:
    """Where the label cache of a split read from `sources` lives; None for a split of single image files.

    One .txt list: beside it, as YOLOv5 keeps it (autosplit_train.cache); one folder: beside its
    labels folder (labels/train.cache); several sources: the first one's name and a digest of them
    all (labels/a-1f2e3d4c.cache). Keyed on the split's own sources, so a train list and a val list
    of images in one folder, or splits sharing their first folder, keep caches of their own.
    """
    caches = []
    for source in map(Path, sources):
        if source.is_file() and source.suffix.lower() == ".txt":
            caches.append(source.with_suffix(".cache"))
        elif source.is_dir():
            caches.append(labels_folder_cache(source / "x.jpg"))
    if len(caches) != len(sources) or not caches:
        return None
    if len(caches) == 1:
        return caches[0]
    digest = hashlib.sha256("\0".join(os.fspath(source) for source in sources).encode(errors="surrogateescape"))
    return caches[0].with_name(f"{caches[0].stem}-{digest.hexdigest()[:8]}.cache")


def labels_folder_cache(image_path: str | Path) -> Path:
    """The label cache beside the labels folder of `image_path`'s label file (labels/train.cache)."""
    return Path(image_to_label_path(image_path)).parent.with_suffix(".cache")


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
    """Return the YOLO label path of an image: the last /images/ becomes /labels/, suffix .txt.

    The result is `str(Path(...).with_suffix(".txt"))`'s. A path that pathlib would not change (no
    repeated separator, no `.` component, no trailing separator) takes a string shortcut, 0.8 us
    against 3.8 us (image_to_label_paths maps a whole list faster still).
    """
    text = str(path)
    head, sep, tail = text.rpartition(f"{os.sep}images{os.sep}")
    if sep:
        text = f"{head}{os.sep}labels{os.sep}{tail}"
    if not _pathlib_would_normalise(text):
        suffix = name_suffix(text[text.rfind(os.sep) + 1 :])
        return f"{text[: len(text) - len(suffix)]}.txt"
    return str(Path(text).with_suffix(".txt"))


def image_to_label_paths(paths: Sequence[str]) -> list[str]:
    """`[image_to_label_path(p) for p in paths]` for str paths, with each folder's label folder worked out once.

    A start-up maps every image of a split on every rank, twice (the shared-label check and the label
    scan): 0.55 us a path against 1.6 us one at a time (200k COCO-style paths, 2-core AMD EPYC). The
    folder part decides both the /images/ -> /labels/ swap and pathlib's normalising (a file name
    holds no separator), so a name with a suffix only has it replaced; any other name takes
    image_to_label_path.
    """
    if os.altsep:
        return [image_to_label_path(path) for path in paths]
    label_folders: dict[str, str] = {}
    labels = []
    for path in paths:
        cut = path.rfind(os.sep) + 1
        dot = path.rfind(".")
        if not cut < dot < len(path) - 1:  # no suffix, as name_suffix has it ("x", ".x", "x.")
            labels.append(image_to_label_path(path))
            continue
        folder = path[:cut]
        label_folder = label_folders.get(folder)
        if label_folder is None:  # "x.jpg" stands for any name with a suffix: "labels/x.txt" -> "labels/"
            label_folder = label_folders[folder] = image_to_label_path(f"{folder}x.jpg")[: -len("x.txt")]
        labels.append(f"{label_folder}{path[cut:dot]}.txt")
    return labels


def _pathlib_would_normalise(text: str) -> bool:
    """Whether str(Path(text)) differs from `text` (or might: a second separator character, as on Windows)."""
    dot_part = f"{os.sep}.{os.sep}"
    return bool(
        os.altsep
        or not text
        or os.sep * 2 in text
        or dot_part in text
        or text.startswith(f".{os.sep}")
        or text.endswith((os.sep, f"{os.sep}."))
        or text == "."
    )


def unique_stems(files: Sequence[str]) -> tuple[list[str], list[str]]:
    """Each file's output stem, its own or with `-2`, `-3`... when an earlier file has it; and `path -> stem` notes.

    Outputs named by stem (labels/<stem>.txt, annotated images, COCO image ids without an annotations
    file) would otherwise overwrite or merge two `x.jpg` from different folders, or `x.jpg` and `x.png`.
    A hyphen, because a video's frames are `<stem>_<frame>`: `a_2` would be frame 2 of a video `a`.
    Each stem remembers its next number, so 100k files of one name take one pass, not 100k squared.
    """
    used: set[str] = set()
    next_number: dict[str, int] = {}
    stems, renamed = [], []
    for file in files:
        stem = candidate = Path(file).stem
        number = next_number.get(stem, 2)
        while candidate in used:  # also past a real file already named `x-2`
            candidate, number = f"{stem}-{number}", number + 1
        next_number[stem] = number
        used.add(candidate)
        stems.append(candidate)
        if candidate != stem:
            renamed.append(f"{file} -> {candidate}")
    return stems, renamed
