"""Shared test helpers: tiny built-in-style datasets generated under a temporary folder."""

from __future__ import annotations

from pathlib import Path

import yaml

from utils.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset


def make_tiny_dataset(root: Path, spec: SyntheticSpec) -> Path:
    """Generate a shapes dataset with `spec` under `root/shapes` and return the path of its dataset YAML."""
    ensure_synthetic_dataset(root / "shapes", spec)
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(
        yaml.safe_dump({"path": "shapes", "train": "images/train", "val": "images/val", "names": list(SHAPE_NAMES)})
    )
    return yaml_file
