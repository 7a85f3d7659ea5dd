"""Shared test helpers: tiny built-in-style datasets generated under a temporary folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset


def make_tiny_dataset(root: Path, spec: SyntheticSpec) -> Path:
    """Generate a shapes dataset with `spec` under `root/shapes` and return the path of its dataset YAML."""
    ensure_synthetic_dataset(root / "shapes", spec)
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(
        yaml.safe_dump({"path": "shapes", "train": "images/train", "val": "images/val", "names": list(SHAPE_NAMES)})
    )
    return yaml_file


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's model-heavy tests on one intra-op thread, restoring the previous count after.

    Two threads on a loaded 2-core machine made single yolov5n steps up to 20x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
