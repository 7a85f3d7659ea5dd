"""What a label scan tells the user: the bad files, every warning kept beside the cache, the counts, and the stops.

The stops are the two findings a run cannot train past: class ids beyond the dataset YAML's `names`
(check_class_ids) and a train split without a single label (check_labelled).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from utils.data.image_files import image_to_label_path
from utils.data.labels import LabelIndex
from utils.distributed import DistContext
from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)

MAX_LOGGED_MESSAGES = 10  # bad files named in the log; past it, all of them go to <cache>.warnings.txt
# How the line of a file or JSON entry that is not used ends (labels.verify_image_label, the COCO readers),
# as opposed to one that was repaired and kept: the log names those first.
LEFT_OUT_ENDINGS = ("skipped", "left out")


def report_scan(
    index: LabelIndex,
    source: str,
    skipped: Sequence[str] = (),
    notes: Sequence[str] = (),
    cache_path: Path | None = None,
) -> None:
    """Log the first bad files (or COCO entries) one per line, how many more there were, and the summary counts.

    Called on rank 0 by every label scan, so the txt and COCO JSON paths report alike. `skipped`
    are the files left out before the scan (image_files.ImageFiles.skipped): warned first and
    counted in the summary, so no image is lost without a word; `notes` are warned after them.
    When there are more than MAX_LOGGED_MESSAGES lines, the log shows those of files and entries
    left out before those of repairs, and all of them, in file order, go to a text file beside the
    label cache `cache_path` (labels/train.warnings.txt), which the log names.
    """
    messages = [*skipped, *notes, *index.messages]
    for message in _named_in_log(messages):
        LOGGER.warning(message)
    written = _write_all_warnings(messages, cache_path)
    if len(messages) > MAX_LOGGED_MESSAGES:
        LOGGER.warning(f"... and {len(messages) - MAX_LOGGED_MESSAGES} more label/image warnings{written}")
    c = index.counts
    dropped = f", {index.num_degenerate} degenerate instance(s) dropped" if index.num_degenerate else ""
    problems = "".join(f", {count} {reason}" for reason, count in index.problems.items())
    left_out = f", {len(skipped)} file(s) left out before the scan" if skipped else ""
    LOGGER.info(
        f"{source}: {c['found']} found, {c['missing']} missing (background), {c['empty']} empty, "
        f"{c['corrupt']} corrupt{dropped}{problems}{left_out}"
    )


def _named_in_log(messages: list[str]) -> list[str]:
    """The first MAX_LOGGED_MESSAGES lines of files or entries left out, then of the rest, each in file order.

    Among thousands of repaired labels a handful of unusable images would otherwise only be counted.
    """
    if len(messages) <= MAX_LOGGED_MESSAGES:
        return messages
    left_out = list(itertools.islice((m for m in messages if m.endswith(LEFT_OUT_ENDINGS)), MAX_LOGGED_MESSAGES))
    repaired = (m for m in messages if not m.endswith(LEFT_OUT_ENDINGS))
    return left_out + list(itertools.islice(repaired, MAX_LOGGED_MESSAGES - len(left_out)))


def _write_all_warnings(messages: Sequence[str], cache_path: Path | None) -> str:
    """Keep every warning line beside the label cache when some go unprinted; return where, for the log line.

    Written whole or not at all (a temporary file renamed); a file left by an earlier scan that
    printed everything is removed, so the file always belongs to the scan just reported.
    """
    if cache_path is None:
        return " not shown"
    target = cache_path.with_suffix(".warnings.txt")
    if len(messages) <= MAX_LOGGED_MESSAGES:
        with contextlib.suppress(OSError):
            target.unlink(missing_ok=True)
        return ""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text("".join(f"{message}\n" for message in messages), "utf-8", "surrogateescape")
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return f" not shown (could not write them to {target}: {error.strerror or error})"
    return f"; all {len(messages)} are in {target}"


def check_class_ids(index: LabelIndex, num_classes: int, names_file: Path | None) -> None:
    """Raise a one-line ConfigError when labels use integer class ids >= `num_classes`.

    The rule: one such id stops the run (as YOLOv5 stops), instead of skipping its file like a
    damaged one. A class id past the declared classes cannot be trained as labelled: `names` in
    the dataset YAML (`names_file`) is short, or the labels come from another dataset, and
    skipping those files would train on what is left without a word about why. The message names
    the YAML, its class count, the largest id and its label count, and the first label file with
    such an id and how many there are. Decided on the index, not while scanning, so the label cache
    serves any class count: a corrected `names` (or --single-cls) reads the cache instead of
    scanning again. Call it with the gathered index (the same on every rank), so every rank decides alike.
    """
    classes = index.labels[:, 0]
    beyond = classes >= num_classes
    if not beyond.any():
        return
    ids, counts = np.unique(classes[beyond].astype(np.int64), return_counts=True)
    largest, num_largest, num_rows = int(ids[-1]), int(counts[-1]), int(counts.sum())
    image_of_row = np.repeat(np.arange(len(index)), np.diff(index.label_offsets))
    images = np.unique(image_of_row[beyond])
    where = str(names_file) if names_file is not None else "the dataset"
    others = f"; {num_rows} labels in all use ids >= {num_classes}" if num_rows > num_largest else ""
    first = image_to_label_path(index.im_files[int(images[0])])
    raise ConfigError(
        f"{where} declares {num_classes} classes ('names') but the labels use class ids up to {largest} "
        f"({num_largest} labels with class {largest}{others}); first in {first} ({len(images)} label file(s) in "
        "all); list every class in 'names', or fix the labels"
    )


def _labels_folders_text(label_files: Sequence[str]) -> str:
    """Name the folder(s) the label files of a split are looked for in: the first, and how many others."""
    folders = list(dict.fromkeys(os.path.dirname(path) for path in label_files))
    more = f" (and {len(folders) - 1} more folder(s))" if len(folders) > 1 else ""
    return f"{folders[0]}{more}" if folders else "(no label folder)"


def check_labelled(index: LabelIndex, label_files: Sequence[str], is_train: bool, ctx: DistContext) -> None:
    """Stop a training split that has no label at all, and warn (rank 0) about another split without any.

    A train set of background images only trains the model to find nothing and ends with mAP 0
    after the whole run, so, as YOLOv5 does ("No labels found"), it is a one-line ConfigError
    naming the folder of `label_files` (where the labels were looked for). A val or test set
    without labels can still be predicted on, so it gets one warning instead. Call it with the
    gathered index (the same on every rank), so every rank decides alike.
    """
    if not len(index) or index.counts["found"]:
        return  # the common case: the folder names (a pass over every path) are built only for the message
    c, split = index.counts, "train " if is_train else ""
    what = (
        f"{_labels_folders_text(label_files)}: none of the {len(index)} {split}images has a label "
        f"({c['missing']} label files missing, {c['empty']} empty)"
    )
    if is_train:
        raise ConfigError(f"{what}; a train set needs labels: check that the labels folder is there and filled")
    if ctx.is_main:
        LOGGER.warning(f"{what}; its metrics will be zero")
