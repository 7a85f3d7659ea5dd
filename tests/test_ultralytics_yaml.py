"""Ultralytics model YAMLs via --cfg: standard layouts accepted (scale from the name), others refused in one line."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from models.anchor_free import spec_for_name
from tests import ultralytics_fakes as uf
from utils.errors import ConfigError
from utils.families import spec_from_cfg


def write_model_yaml(path: Path, layout: str, seg: bool, edit: Any = None) -> Path:
    """Write the layout's YAML from the layer table (what the published file lists); `edit(rows)` changes rows."""
    backbone, neck = copy.deepcopy(uf.LAYER_ROWS[layout])
    head = [*neck, uf.head_row(layout, seg)]
    if edit is not None:
        edit(backbone, head)
    data: dict[str, Any] = {"nc": 80, "scales": uf.SCALE_ROWS[layout]}
    if layout == "yolo26":
        data.update(end2end=True, reg_max=1)
    data.update(backbone=backbone, head=head)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("layout", ["yolov8", "yolo11", "yolo26"])
@pytest.mark.parametrize("seg", [False, True], ids=["detect", "seg"])
def test_a_scale_named_file_gives_the_published_model(layout: str, seg: bool, tmp_path: Path) -> None:
    name = f"{layout}s{'-seg' if seg else ''}"
    path = write_model_yaml(tmp_path / f"{name}.yaml", layout, seg)
    assert spec_from_cfg(str(path), 7) == spec_for_name(name, 7)


def test_a_file_without_a_scale_letter_uses_its_first_row(tmp_path: Path) -> None:
    path = write_model_yaml(tmp_path / "custom-model.yaml", "yolo26", seg=False)
    assert spec_from_cfg(str(path), 3) == spec_for_name("yolo26n", 3)


@pytest.mark.parametrize("row", [["a", 0.25, 1024], None, [float("nan"), 0.25, 1024], [0.5, float("inf"), 1024]])
def test_a_scale_row_that_is_not_positive_numbers_is_one_line(row: Any, tmp_path: Path) -> None:
    path = write_model_yaml(tmp_path / "yolo11n.yaml", "yolo11", seg=False)
    data = yaml.safe_load(path.read_text())
    data["scales"]["n"] = row
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(
        ConfigError, match="scale 'n' is not a \\[depth, width, max_channels\\] row of positive numbers"
    ):
        spec_from_cfg(str(path), 3)


def test_another_layer_is_refused_naming_the_first_difference(tmp_path: Path) -> None:
    def widen(backbone: list, head: list) -> None:
        head[2][3] = [768, False]  # layer 13

    path = write_model_yaml(tmp_path / "yolo11n.yaml", "yolo11", seg=False, edit=widen)
    with pytest.raises(ConfigError, match=r"layer 13 \[-1, 2, C3k2, \[768, False\]\] differs from yolo11's") as error:
        spec_from_cfg(str(path), 3)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_a_p2_head_or_missing_layer_is_refused(tmp_path: Path) -> None:
    def p2_head(backbone: list, head: list) -> None:
        head[-1][0] = [2, 15, 18, 21]

    path = write_model_yaml(tmp_path / "yolov8n.yaml", "yolov8", seg=False, edit=p2_head)
    with pytest.raises(ConfigError, match=r"head \[\[2, 15, 18, 21\], 1, Detect, \[nc\]\] differs from yolov8's"):
        spec_from_cfg(str(path), 3)
    path = write_model_yaml(tmp_path / "yolo26n.yaml", "yolo26", seg=False, edit=lambda b, h: b.pop(10))
    with pytest.raises(ConfigError, match="layer 10 .* differs from yolo26's"):
        spec_from_cfg(str(path), 3)


@pytest.mark.parametrize("stem", ["yolo11s-custom", "my-yolo11s", "yolo11s_parts"])
def test_a_scale_letter_anywhere_in_the_name_picks_that_row(stem: str, tmp_path: Path) -> None:
    # As Ultralytics reads it: a copy of yolo11.yaml saved as yolo11s-custom.yaml is the s model, not the first row.
    path = write_model_yaml(tmp_path / f"{stem}.yaml", "yolo11", seg=False)
    assert spec_from_cfg(str(path), 3) == spec_for_name("yolo11s", 3)
