"""Prediction inputs: find images and videos from --source, split them across ranks, read images and video frames."""

from __future__ import annotations

import glob
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from utils.data.cache import opencv_can_name
from utils.data.cache import read_image as decode_image
from utils.data.image_files import IMAGE_SUFFIXES, list_lines, unique_stems
from utils.distributed import DistContext
from utils.errors import ConfigError

VIDEO_SUFFIXES = frozenset({".asf", ".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".wmv"})
DEFAULT_FPS = 30.0  # when a video or webcam reports none
LOGGER = logging.getLogger(__name__)


class UnreadableInputError(ValueError):
    """An input that cannot be read (missing, corrupt, not an image or video); the message names it."""


@dataclass(frozen=True)
class InputItem:
    """One input of a prediction run, as found on rank 0 and shared with every rank."""

    path: str  # file path; for a webcam its index ("0")
    kind: str  # "image", "video" or "webcam"
    index: int  # position in the whole run's list, for "image 3/10" lines on any rank
    output_stem: str = ""  # set when an earlier input has the same file stem (a recursive glob): "<stem>-2", ...

    @property
    def stem(self) -> str:
        """The base name its outputs take: the file's stem (made unique in the run), or 'webcam0' for webcam 0."""
        if self.output_stem:
            return self.output_stem
        return f"webcam{self.path}" if self.kind == "webcam" else Path(self.path).stem


def kind_of(path: str | Path) -> str | None:
    """Return "image" or "video" from the file suffix (case-insensitive), None for any other file."""
    suffix = Path(path).suffix.lower()
    return "image" if suffix in IMAGE_SUFFIXES else "video" if suffix in VIDEO_SUFFIXES else None


def discover_inputs(source: str) -> list[InputItem]:
    """Resolve `--source` into the run's ordered list of inputs.

    A digit string is a webcam index. A folder gives its images and videos (not recursive, as
    YOLOv5), a glob pattern ('dir/*.jpg', '**' recursive) its matching images and videos, both
    sorted; other files there are ignored. A .txt file lists one file, folder or glob per line
    (relative paths resolve against the .txt file's folder, else the current directory: `_listed_path`;
    names as utils/data/image_files.list_lines reads them); its file entries are kept whatever they
    are, so a missing or unreadable one is later skipped with a warning and counted rather than
    dropped silently.
    Raises a one-line ConfigError for a source that does not exist or holds no image or video.
    """
    if source.strip().isdigit():
        return [InputItem(source.strip(), "webcam", 0)]
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".txt":
        files = _listed_files(path)
    elif path.is_file():
        if kind_of(path) is None:
            raise ConfigError(f"--source {source}: not an image or video suffix (images: {_suffixes(IMAGE_SUFFIXES)})")
        files = [str(path)]
    elif path.is_dir() or glob.has_magic(source):
        files = _folder_or_glob(source)
    else:
        raise ConfigError(f"--source {source} does not exist (give a file, folder, glob, .txt list or webcam index)")
    if not files:
        raise ConfigError(
            f"--source {source}: no images ({_suffixes(IMAGE_SUFFIXES)}) or videos ({_suffixes(VIDEO_SUFFIXES)}) found"
        )
    stems = _unique_stems(files)
    return [
        InputItem(file, kind_of(file) or "image", index, stem if stem != Path(file).stem else "")
        for index, (file, stem) in enumerate(zip(files, stems, strict=True))
    ]


def _unique_stems(files: list[str]) -> list[str]:
    """Each file's output stem (utils/data/image_files.py: unique_stems); one warning names the renamed ones.

    A video's frames are pictures `<stem>_<frame>`, so an image of such a name (`v_1.jpg` beside `v.mp4`)
    would write over frame 1's labels and crops: it is renamed as a repeated name is (`v_1-2`).
    """
    stems, renamed = unique_stems(files)
    videos = {stem for file, stem in zip(files, stems, strict=True) if kind_of(file) == "video"}
    used = set(stems)
    for position, (file, stem) in enumerate(zip(files, stems, strict=True)):
        head, underscore, frame = stem.rpartition("_")
        if kind_of(file) == "video" or not (underscore and frame.isdigit() and frame.isascii() and head in videos):
            continue
        number = 2
        while f"{stem}-{number}" in used:
            number += 1
        stems[position] = f"{stem}-{number}"
        used.add(stems[position])
        renamed.append(f"{file} -> {stems[position]} (a frame of video {head} has its name)")
    if renamed:
        LOGGER.warning(
            f"{len(renamed)} input(s) share a file name with an earlier one or a video's frame; their outputs "
            f"are renamed (first: {renamed[0]})"
        )
    return stems


def _folder_or_glob(source: str) -> list[str]:
    """A folder's images and videos, or a glob's, sorted (a link to a missing file is kept: skipped, counted later)."""
    if os.path.isdir(source):
        candidates = [str(path) for path in Path(source).iterdir()]
    else:
        candidates = glob.glob(source, recursive=True)
    return sorted(p for p in candidates if (os.path.isfile(p) or os.path.islink(p)) and kind_of(p))


def _listed_files(list_file: Path) -> list[str]:
    """The files a .txt list names, line by line: a folder or glob line gives its images and videos, any other
    line its path (`_listed_path`), kept whether it exists or not.

    A line naming an existing file is that file even when its name holds glob characters (`shot[1].jpg`,
    `a?.jpg`), as `--source` reads such a name: as a pattern it would match other files, or none.
    """
    files = []
    for line in list_lines(list_file):
        entry = line.strip()
        if not entry:
            continue
        path = _listed_path(list_file.parent, entry)
        is_pattern = glob.has_magic(entry) and not (os.path.isfile(path) or os.path.islink(path))
        files.extend(_folder_or_glob(path) if os.path.isdir(path) or is_pattern else [path])
    return files


def _listed_path(list_folder: Path, entry: str) -> str:
    """Where a relative list line points: into the list's folder, or, when nothing is there, the current directory.

    YOLOv5 reads a --source list's lines from the current directory (Ultralytics tries it first, then the
    list's folder), so a list written for it names files from where it was run; read only against the
    list's folder, each of its lines would be skipped as missing.
    """
    beside_list = os.path.normpath(os.path.join(list_folder, entry))
    if os.path.isabs(entry) or _names_something(beside_list) or not _names_something(entry):
        return beside_list
    return os.path.normpath(entry)


def _names_something(path: str) -> bool:
    """Whether `path` is an existing file, folder or link, or a glob that matches one."""
    return os.path.lexists(path) or (glob.has_magic(path) and bool(glob.glob(path, recursive=True)))


def _suffixes(suffixes: frozenset[str]) -> str:
    return " ".join(sorted(suffixes))


def shard_inputs(items: list[InputItem], ctx: DistContext) -> list[InputItem]:
    """Return this rank's inputs: items rank, rank + world_size, ... (disjoint, together all of them).

    Whole files are the unit, so a video's frames stay on one rank and its output is one file.
    A webcam is read by one process only: with several ranks it is a one-line ConfigError, raised on
    every rank alike (all hold the same list).
    """
    if ctx.world_size > 1 and any(item.kind == "webcam" for item in items):
        raise ConfigError(f"--source {items[0].path} is a webcam, which one process reads; run without torchrun")
    return items[ctx.rank :: ctx.world_size]


def read_image(path: str) -> np.ndarray:
    """Read an image file as (H, W, 3) uint8 BGR; raise UnreadableInputError naming the file and why."""
    if not os.path.isfile(path):
        raise UnreadableInputError(f"{path}: file not found")
    image = decode_image(path)  # any file name (cv2.imread crashes on names that are not UTF-8)
    if image is None:
        raise UnreadableInputError(f"{path}: not a readable image (corrupt, empty or unsupported format)")
    return image


class VideoReader:
    """Every `vid_stride`-th frame of a video file or webcam through cv2.VideoCapture; a context manager.

    Opening raises UnreadableInputError when OpenCV cannot open a video file, and a one-line
    ConfigError for a webcam. Iterating yields
    (frame_number, (H, W, 3) uint8 BGR frame) for frames 1, 1 + vid_stride, ... with 1-based
    numbers counting the frames kept, and stops at the first frame that cannot be read (end of
    file or stream). `frame_count` is the number of frames kept, 0 when unknown (webcam).
    """

    def __init__(self, item: InputItem, vid_stride: int = 1) -> None:
        self.vid_stride = vid_stride
        if item.kind != "webcam" and not opencv_can_name(item.path):  # it would crash inside VideoCapture
            raise UnreadableInputError(f"{item.path}: OpenCV cannot open a video whose name is not valid UTF-8")
        self.capture = cv2.VideoCapture(int(item.path) if item.kind == "webcam" else item.path)
        if not self.capture.isOpened():
            self.capture.release()
            if item.kind == "webcam":  # the run's only input (one process): a user error, not a skipped file
                raise ConfigError(f"--source {item.path}: cannot open webcam {item.path}")
            raise UnreadableInputError(f"{item.path}: not a readable video")
        fps = self.capture.get(cv2.CAP_PROP_FPS)
        self.fps = fps if math.isfinite(fps) and fps > 0 else DEFAULT_FPS
        frames = self.capture.get(cv2.CAP_PROP_FRAME_COUNT)
        # Webcams report 0 or -1 frames: "unknown".
        self.frame_count = math.ceil(frames / vid_stride) if item.kind == "video" and frames > 0 else 0

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.capture.release()

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        frame_number = 0
        while True:
            ok, frame = self.capture.read()
            if not ok or frame is None:
                return
            frame_number += 1
            yield frame_number, frame
            for _ in range(self.vid_stride - 1):  # skipped frames are only grabbed, not decoded
                if not self.capture.grab():
                    return
