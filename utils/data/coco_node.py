"""A COCO JSON parsed once per node: the local main rank reads it, saves the arrays beside it, every rank maps them."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import fields
from pathlib import Path

import numpy as np

from utils.data.coco_reader import CocoParse, read_coco_json
from utils.data.mapped_npz import load_npz_mapped, save_npz_atomic
from utils.distributed import DistContext, all_gather_objects
from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)

PARSE_VERSION = 5  # stored in the parse file (and the label cache's digest): another version is parsed again
# 3: RLE outlines along the pixels' outer edges; 4: traced at twice the size (no diagonals, no bridged gaps)
LIST_FIELDS = ("category_names", "file_names", "messages")  # stored as str arrays, held as lists


def parse_cache_path(json_path: Path) -> Path:
    """Where the parsed arrays of a COCO JSON live: beside it, `instances_train2017.parse.cache`."""
    return json_path.with_name(f"{json_path.stem}.parse.cache")


def json_key(json_path: Path) -> str:
    """A digest of the JSON's path, size and modification time (and PARSE_VERSION); ConfigError if it is missing."""
    try:
        stat = os.stat(json_path)
    except OSError as error:
        raise ConfigError(f"{json_path}: COCO annotations file not found ({error.strerror})") from None
    text = f"{PARSE_VERSION}\0{json_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(os.fsencode(text)).hexdigest()


def save_parse(path: Path, parse: CocoParse, key: str) -> bool:
    """Write `parse` to `path` atomically (on the rank that calls it); warn and return False on failure."""
    arrays = {"key": np.array(key)}
    for field in fields(CocoParse):
        value = getattr(parse, field.name)
        if field.name == "problems":
            arrays["problem_reasons"] = np.array(list(value), dtype=str)
            arrays["problem_counts"] = np.array(list(value.values()), dtype=np.int64)
        elif field.name in LIST_FIELDS or field.name == "source":
            arrays[field.name] = np.array(value, dtype=str)
        else:
            arrays[field.name] = value
    try:
        save_npz_atomic(path, arrays)
        return True
    except OSError as error:
        LOGGER.warning(
            f"{path} is not writable ({error.strerror or error}): every rank of this node reads the COCO JSON itself"
        )
        return False


def load_parse(path: Path, key: str) -> CocoParse | None:
    """The CocoParse saved at `path` as read-only memory maps, or None when it is absent, stale or unreadable."""
    try:
        data = load_npz_mapped(path)
        if str(data["key"]) != key:
            return None
        values = {field.name: data.get(field.name) for field in fields(CocoParse)}
        for name in LIST_FIELDS:
            values[name] = data[name].tolist()
        values["source"] = str(data["source"])
        reasons = data["problem_reasons"].tolist()
        values["problems"] = dict(zip(reasons, data["problem_counts"].tolist(), strict=True))
        return CocoParse(**values)
    except Exception:  # absent, truncated, foreign: parse again
        return None


def load_coco_parse(json_path: Path, ctx: DistContext) -> CocoParse:
    """Return the parsed COCO JSON on every rank, reading the JSON once per node (not once per rank).

    Every rank must call it. When the parse file beside the JSON (parse_cache_path) is current on
    every rank it is only mapped. Otherwise the local main rank of each node that lacks it reads
    the JSON (utils/data/coco_reader.py) and saves the arrays while the node's other ranks wait in
    the one all-gather that also shares its failure, so a bad file is the same error on every rank
    at once. The parse of a 448 MB JSON takes seconds, well inside the process-group timeout.
    Every rank then maps the file, so the node holds its pages once. A rank that still finds no
    current file (an unwritable folder) reads the JSON itself, as the warning said.
    """
    json_path = Path(json_path)
    path = parse_cache_path(json_path)
    key = json_key(json_path)
    parse = load_parse(path, key)
    needs = all_gather_objects(parse is None, ctx)
    if not any(needs):
        return parse  # type: ignore[return-value]  # current on every rank
    error: Exception | None = None
    if parse is None and ctx.is_local_main:
        try:
            parsed = read_coco_json(json_path)
            parse = load_parse(path, key) if save_parse(path, parsed, key) else parsed
            LOGGER.info(f"{json_path}: read {len(parsed.file_names)} images, {len(parsed.annotation_ids)} instances")
        except Exception as exc:  # raised below, after the node's other ranks have been told
            error = exc
    failures = all_gather_objects(None if error is None else (isinstance(error, ConfigError), str(error)), ctx)
    if error is not None:
        raise error
    failed = next((failure for failure in failures if failure is not None), None)
    if failed is not None:
        raise ConfigError(failed[1]) if failed[0] else RuntimeError(f"reading {json_path} failed: {failed[1]}")
    if parse is None:
        parse = load_parse(path, key) or read_coco_json(json_path)
    return parse
