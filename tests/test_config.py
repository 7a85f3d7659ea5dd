"""Tests for utils/config.py: hyp YAML checks, option validation and the options round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from utils.config import (
    DEFAULT_HYP,
    ConfigError,
    build_train_parser,
    build_val_parser,
    config_from_args,
    config_from_dict,
    load_hyp,
    val_config_from_args,
    validate,
)
from utils.distributed import DistContext


def _write_hyp(tmp_path: Path, **changes: object) -> Path:
    raw = yaml.safe_load(DEFAULT_HYP.read_text())
    raw.update(changes)
    path = tmp_path / "hyp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_default_hyp_loads_with_expected_values() -> None:
    hyp = load_hyp(DEFAULT_HYP)
    assert hyp.lr0 == pytest.approx(0.01)
    assert hyp.momentum == pytest.approx(0.937)
    assert hyp.mosaic == 1.0


def test_unknown_hyp_key_names_file_and_key(tmp_path: Path) -> None:
    path = _write_hyp(tmp_path, lr00=0.1)
    with pytest.raises(ConfigError, match=r"hyp\.yaml: unknown hyperparameter 'lr00'"):
        load_hyp(path)


def test_missing_and_non_numeric_hyp_keys(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEFAULT_HYP.read_text())
    del raw["box"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="missing hyperparameter 'box'"):
        load_hyp(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="'lr0' must be a number"):
        load_hyp(_write_hyp(tmp_path, lr0="fast"))


def test_label_smoothing_flag_overrides_hyp() -> None:
    cfg = config_from_args(build_train_parser().parse_args(["--label-smoothing", "0.1"]))
    assert cfg.hyp.label_smoothing == pytest.approx(0.1)
    assert config_from_args(build_train_parser().parse_args([])).hyp.label_smoothing == 0.0


def test_batch_not_divisible_by_world_size_is_one_line_error() -> None:
    cfg = config_from_args(build_train_parser().parse_args(["--batch-size", "30"]))
    ctx = DistContext(rank=0, world_size=4)
    with pytest.raises(ConfigError) as error:
        validate(cfg, ctx)
    message = str(error.value)
    assert "--batch-size 30 is not divisible by 4 processes" in message
    assert "\n" not in message
    validate(cfg, DistContext(rank=0, world_size=2))  # 30 = 2 x 15 is fine


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--imgsz", "100"], "--imgsz 100"),
        (["--cache", "gpu"], "--cache gpu"),
        (["--optimizer", "LBFGS"], "--optimizer LBFGS"),
        (["--epochs", "0"], "--epochs 0"),
        (["--close-mosaic", "-1"], "--close-mosaic -1"),
        (["--weights", "missing.pt"], "--weights missing.pt"),
    ],
)
def test_validate_rejects_bad_flags(flags: list[str], needle: str) -> None:
    cfg = config_from_args(build_train_parser().parse_args(flags))
    with pytest.raises(ConfigError, match=needle):
        validate(cfg, DistContext())


def test_cache_flag_without_value_means_ram() -> None:
    assert config_from_args(build_train_parser().parse_args(["--cache"])).cache == "ram"


def test_config_dict_round_trip() -> None:
    cfg = config_from_args(build_train_parser().parse_args(["--freeze", "3", "--cos-lr", "--epochs", "7"]))
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg


def test_val_config_checks_thresholds() -> None:
    parser = build_val_parser()
    with pytest.raises(ConfigError, match="--conf-thres 1.5"):
        val_config_from_args(parser.parse_args(["--weights", "x.pt", "--conf-thres", "1.5"]))
    cfg = val_config_from_args(parser.parse_args(["--weights", "x.pt", "--iou-thres", "0.5"]))
    assert cfg.iou_thres == 0.5 and cfg.conf_thres == 0.001
