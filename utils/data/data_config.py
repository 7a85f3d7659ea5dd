"""Dataset YAML loading: split paths, class names and annotation files, resolved and checked once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from utils.data.coco_labels import CocoSource
from utils.data.coco_node import load_coco_parse
from utils.distributed import DistContext, main_first
from utils.errors import ConfigError, read_yaml_mapping

KNOWN_KEYS = {
    "path",
    "train",
    "val",
    "test",
    "names",
    "nc",
    "train_annotations",
    "val_annotations",
    "test_annotations",
    "category_ids",
    "builtin",
    "download",
}
# Keys other tools write that say nothing about the data: read past with one note (any other unknown key is an error).
METADATA_KEYS = {"roboflow": "Roboflow's export metadata"}
BUILTIN_DATASETS = ("synthetic",)
MAX_KEYS_NAMED = 5  # 'names' keys listed in an error, of each kind (missing, unexpected)
LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    """A dataset description: where each split's images are, the class names, optional COCO annotations.

    Split entries are folders or `.txt` image lists (absolute paths); `annotations` maps a split
    name to its COCO-format instances JSON when the YAML names one (`<split>_annotations:`); such a
    split takes its labels from the JSON (`coco_source`) and is scored against it by pycocotools.
    `category_ids` (YAML key `category_ids:`, one int per class) is the explicit class index -> COCO
    category id mapping, e.g. COCO's 80 classes -> ids 1..90; None derives it from the annotations
    (utils/data/coco_labels.py: category_mapping).
    """

    yaml_file: Path
    root: Path
    splits: dict[str, tuple[Path, ...]]
    names: tuple[str, ...]
    annotations: dict[str, Path]
    category_ids: tuple[int, ...] | None = None
    absent: dict[str, Path] = field(default_factory=dict)  # an optional split (test) whose path is not there

    @property
    def num_classes(self) -> int:
        """Number of classes in `names`."""
        return len(self.names)

    def split(self, name: str) -> tuple[Path, ...]:
        """Return the sources of split `name`, or raise ConfigError naming the YAML when it is absent."""
        if name in self.absent:
            raise ConfigError(f"{self.yaml_file}: '{name}' path {self.absent[name]} does not exist")
        if name not in self.splits:
            raise ConfigError(f"{self.yaml_file}: no '{name}' split defined")
        return self.splits[name]

    def coco_source(self, name: str) -> CocoSource | None:
        """How split `name` reads its labels from a COCO JSON (file, folder, classes); None: from YOLO txt files."""
        if name not in self.annotations:
            return None
        return CocoSource(self.annotations[name], self.split(name)[0], self.names, self.category_ids)


def parse_names(raw: dict, yaml_file: Path) -> tuple[str, ...]:
    """Read class names from `names` (list or {index: name}) and check them against optional `nc`."""
    names = raw.get("names")
    num_classes = raw.get("nc")
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise ConfigError(f"{yaml_file}: 'nc' must be a positive integer (the number of classes), got {num_classes!r}")
    if isinstance(names, dict):
        # Keys written as strings ('0': person), as YAML converted from JSON has them, are the same indices.
        indexed = {_index_key(key): name for key, name in names.items()}
        if len(indexed) < len(names):
            twice = [key for key in names if key != _index_key(key) and _index_key(key) in names]
            raise ConfigError(f"{yaml_file}: 'names' keys {_few(twice)} repeat the index keys they spell")
        names = indexed
        check_names_keys(list(names), yaml_file)
        names = [names[k] for k in range(len(names))]
    if names is None and num_classes is not None:
        names = [f"class{i}" for i in range(num_classes)]
    if names is None:
        raise ConfigError(f"{yaml_file}: missing 'names' (a list or an index->name mapping)")
    if not isinstance(names, list):
        raise ConfigError(f"{yaml_file}: 'names' must be a list or an index->name mapping, got {names!r}")
    if not names:
        raise ConfigError(f"{yaml_file}: 'names' is empty: list the class names")
    blank = [index for index, name in enumerate(names) if name is None or str(name).strip() == ""]
    if blank:
        raise ConfigError(f"{yaml_file}: 'names' has no name for class {_few(blank)} (null or empty)")
    if num_classes is not None and num_classes != len(names):
        raise ConfigError(f"{yaml_file}: nc={num_classes} but 'names' has {len(names)} entries")
    return tuple(str(n) for n in names)


def _index_key(key: object) -> object:
    """A `names` key as written: `'3'` (a string of a plain decimal) read as 3, anything else unchanged."""
    return int(key) if isinstance(key, str) and key.isdecimal() and str(int(key)) == key else key


def _few(values: list[object]) -> str:
    """Up to MAX_KEYS_NAMED values, comma-separated, with how many more there are."""
    shown = ", ".join(map(repr, values[:MAX_KEYS_NAMED]))
    return shown + (f" and {len(values) - MAX_KEYS_NAMED} more" if len(values) > MAX_KEYS_NAMED else "")


def check_names_keys(keys: list[object], yaml_file: Path) -> None:
    """Raise a one-line ConfigError unless the keys of an index->name `names` mapping are exactly 0..n-1.

    The message names the indices that are missing and the keys that do not belong, not just the
    first few keys: in {0, 1, 2, 3, 4, 6} the fault is 5 missing and 6 unexpected, which a
    truncated list of the keys would hide. A key that is not an integer (YAML `yes`, `'x'`) is
    unexpected, never compared with the integers (parse_names reads `'1'` as 1 before).
    """
    expected = range(len(keys))
    indices = {key for key in keys if type(key) is int}  # not bool: YAML reads `yes:` as True
    missing = [index for index in expected if index not in indices]
    unexpected = [key for key in keys if type(key) is not int or key not in expected]
    if not missing and not unexpected:
        return
    problems = [f"missing {_few(missing)}"] if missing else []
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    raise ConfigError(f"{yaml_file}: 'names' keys must be the class indices 0..{len(keys) - 1} ({'; '.join(problems)})")


def parse_category_ids(raw: dict, yaml_file: Path, num_classes: int) -> tuple[int, ...] | None:
    """Read the optional `category_ids` list: distinct integers, one per class (class i -> category id)."""
    ids = raw.get("category_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in ids):
        raise ConfigError(f"{yaml_file}: 'category_ids' must be a list of integers (one COCO category id per class)")
    if len(ids) != num_classes:
        raise ConfigError(f"{yaml_file}: 'category_ids' has {len(ids)} entries but 'names' has {num_classes} classes")
    if len(set(ids)) != len(ids):
        duplicate = next(v for v in ids if ids.count(v) > 1)
        raise ConfigError(f"{yaml_file}: 'category_ids' lists category {duplicate} more than once")
    return tuple(ids)


def _resolve(entry: object, root: Path, yaml_file: Path, key: str, notes: list[str]) -> tuple[Path, ...]:
    """A YAML entry (a path or a list of them) as absolute paths under `root`.

    A relative entry starting with '../' that is not there but is without that prefix (Roboflow's
    exports write `train: ../train/images` beside a data.yaml in the dataset folder) is read without
    it, as Ultralytics reads it, and a line saying so is added to `notes`.
    """
    entries = entry if isinstance(entry, list) else [entry]
    out = []
    for item in entries:
        if not isinstance(item, str):
            raise ConfigError(f"{yaml_file}: '{key}' entries must be paths, got {item!r}")
        path = Path(item).expanduser()
        resolved = path if path.is_absolute() else (root / path).resolve()
        if not resolved.exists() and item.startswith("../") and (root / item[3:]).exists():
            resolved = (root / item[3:]).resolve()
            notes.append(f"{yaml_file}: '{key}' {item} is not there; reading {resolved} (the path without '../')")
        out.append(resolved)
    return tuple(out)


def ensure_builtin(name: str, root: Path, yaml_file: Path, ctx: DistContext) -> None:
    """Generate a built-in dataset at `root` if it is not complete there; one local rank writes, others wait."""
    if name not in BUILTIN_DATASETS:
        raise ConfigError(f"{yaml_file}: unknown builtin dataset '{name}' (known: {', '.join(BUILTIN_DATASETS)})")
    from utils.data.synthetic import ensure_synthetic_dataset

    # The generator also holds a file lock, so unrelated processes are safe too; main_first
    # simply avoids every local rank contending for it.
    with main_first(ctx):
        ensure_synthetic_dataset(root)


def load_data_config(yaml_file: Path, ctx: DistContext) -> DataConfig:
    """Load and check a dataset YAML; relative paths resolve against `path`, itself relative to the YAML.

    Nothing in the YAML is executed: `builtin: synthetic` names a generator this project ships, and
    YOLOv5's `download` (a URL or a Python script) is ignored with one warning on rank 0.
    A missing key, an unknown key (METADATA_KEYS aside) or a missing train or val path is a
    ConfigError naming the file; a missing test path is one only when the test split is used
    (`DataConfig.split`), as exports often name a test folder they do not ship.
    """
    yaml_file = Path(yaml_file).resolve()
    raw = read_yaml_mapping(yaml_file)
    unknown = sorted(set(raw) - KNOWN_KEYS - set(METADATA_KEYS))
    if unknown:
        raise ConfigError(f"{yaml_file}: unknown key '{unknown[0]}' (known: {', '.join(sorted(KNOWN_KEYS))})")
    notes = [f"{yaml_file}: '{key}' ({what}) is not read" for key, what in METADATA_KEYS.items() if key in raw]
    if raw.get("download") and ctx.is_main:
        # YOLOv5 runs this (a URL, or Python code) when a split is missing; we never download or execute anything.
        LOGGER.warning(
            "%s: 'download' is ignored (nothing is downloaded or run); fetch the dataset yourself", yaml_file
        )
    for key in ("train", "val"):
        if key not in raw:
            raise ConfigError(f"{yaml_file}: missing key '{key}'")
        if raw[key] in (None, "", []):  # `val:` with nothing after it: found before the train split is scanned
            raise ConfigError(f"{yaml_file}: '{key}' is empty; give its image folder, .txt list or image")
    path = raw.get("path")  # left empty (None): the YAML's folder, as without the key
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"{yaml_file}: 'path' must be one folder, got {path!r}")
    root_raw = Path(path or ".").expanduser()
    root = root_raw if root_raw.is_absolute() else (yaml_file.parent / root_raw).resolve()
    if raw.get("builtin"):
        ensure_builtin(str(raw["builtin"]), root, yaml_file, ctx)
    splits, absent = _split_paths(raw, root, yaml_file, notes)
    annotations = {}
    for key in ("train", "val", "test"):
        ann = raw.get(f"{key}_annotations")
        if ann and key not in absent:
            annotations[key] = _resolve(ann, root, yaml_file, f"{key}_annotations", notes)[0]
            sources = splits.get(key, ())
            if len(sources) != 1 or not sources[0].is_dir():
                raise ConfigError(
                    f"{yaml_file}: '{key}_annotations' needs '{key}' to be one image folder (the JSON's file_names "
                    "are looked up under it)"
                )
    if raw.get("names") is None and annotations:
        names = names_from_categories(raw, annotations, yaml_file, ctx)
    else:
        names = parse_names(raw, yaml_file)
    if ctx.is_main:
        for note in notes:
            LOGGER.info(note)
    category_ids = parse_category_ids(raw, yaml_file, len(names))
    return DataConfig(yaml_file, root, splits, names, annotations, category_ids, absent)


def _split_paths(
    raw: dict, root: Path, yaml_file: Path, notes: list[str]
) -> tuple[dict[str, tuple[Path, ...]], dict[str, Path]]:
    """The splits' paths that are there, and the test split's first missing path when it is not.

    A missing train or val path is a ConfigError naming the file (with a word on `download`, which
    is never run); a missing test path only matters to a run that uses it (`DataConfig.split`).
    """
    splits = {key: _resolve(raw[key], root, yaml_file, key, notes) for key in ("train", "val", "test") if raw.get(key)}
    hint = " ('download' is not run: fetch the dataset yourself)" if raw.get("download") else ""
    absent = {}
    for key, sources in list(splits.items()):
        missing = next((source for source in sources if not source.exists()), None)
        if missing is not None and key == "test":
            absent[key] = missing
            del splits[key]
        elif missing is not None:
            raise ConfigError(f"{yaml_file}: '{key}' path {missing} does not exist{hint}")
    return splits, absent


def names_from_categories(
    raw: dict, annotations: dict[str, Path], yaml_file: Path, ctx: DistContext
) -> tuple[str, ...]:
    """Class names of a YAML without `names`: the categories of its (train, else val, else test) COCO JSON, by id.

    Every rank must call it; the JSON is read once per node (and kept parsed beside it for the
    label scan that follows). An `nc` that differs from the number of categories is a ConfigError.
    """
    split = next(key for key in ("train", "val", "test") if key in annotations)
    names = tuple(load_coco_parse(annotations[split], ctx).category_names)
    num_classes = raw.get("nc")
    if num_classes is not None and num_classes != len(names):
        raise ConfigError(f"{yaml_file}: nc={num_classes} but {annotations[split]} has {len(names)} categories")
    return names
