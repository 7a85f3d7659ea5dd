"""Tests for utils/config.py: hyp YAML checks, option validation and the options round trip."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from utils.config import DEFAULT_HYP, ROOT, stride_multiples
from utils.distributed import DistContext, per_rank_batch
from utils.errors import ConfigError
from utils.eval.config import build_val_parser, val_config_from_args
from utils.hyp import load_hyp
from utils.train.config import build_train_parser, config_from_args, config_from_dict, validate


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


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr0": -0.01}, "'lr0': -0.01 must be above 0"),
        ({"lr0": float("nan")}, "'lr0': nan is not a finite number"),
        ({"momentum": 1.5}, "'momentum': 1.5 is outside [0, 1]"),
        ({"weight_decay": -1}, "'weight_decay': -1 must be 0 or more"),
        ({"lrf": -3}, "'lrf': -3 must be above 0"),
        ({"hsv_v": float("nan")}, "'hsv_v': nan is not a finite number"),
        ({"mosaic": 3}, "'mosaic': 3 is outside [0, 1]"),
        ({"label_smoothing": 1.5}, "'label_smoothing': 1.5 is outside [0, 1]"),
    ],
)
def test_a_hyp_value_outside_its_range_is_one_line_naming_the_file(tmp_path: Path, changes: dict, message: str) -> None:
    # Each would fail deep inside the optimizer (a traceback) or train wrongly without a word (a negative
    # learning rate, black images from a NaN gain).
    with pytest.raises(ConfigError, match=re.escape(f"hyp.yaml: hyperparameter {message}")):
        load_hyp(_write_hyp(tmp_path, **changes))


def test_a_hyp_number_yaml_reads_as_text_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "hyp.yaml"
    path.write_text(DEFAULT_HYP.read_text().replace("lr0: 0.01", "lr0: 1e-3"))  # YAML 1.1: text without a dot
    assert load_hyp(path).lr0 == pytest.approx(0.001)


def test_label_smoothing_flag_overrides_hyp() -> None:
    # A given --hyp is read at once; with --hyp auto (the default) the flag waits for the file auto picks
    # (tests/test_recipe.py).
    cfg = config_from_args(build_train_parser().parse_args(["--hyp", str(DEFAULT_HYP), "--label-smoothing", "0.1"]))
    assert cfg.hyp.label_smoothing == pytest.approx(0.1) and cfg.hyp_path == DEFAULT_HYP
    plain = config_from_args(build_train_parser().parse_args(["--hyp", str(DEFAULT_HYP)]))
    assert plain.hyp.label_smoothing == 0.0 and plain.label_smoothing is None
    auto = config_from_args(build_train_parser().parse_args([]))
    assert (auto.hyp, auto.hyp_path, auto.optimizer) == (None, None, "auto")


def test_batch_not_divisible_by_world_size_is_one_line_error() -> None:
    cfg = config_from_args(build_train_parser().parse_args(["--batch-size", "30"]))
    ctx = DistContext(rank=0, world_size=4)
    with pytest.raises(ConfigError) as error:
        validate(cfg, ctx)
    message = str(error.value)
    assert "--batch-size 30 is not divisible by 4 processes" in message
    assert "\n" not in message
    validate(cfg, DistContext(rank=0, world_size=2))  # 30 = 2 x 15 is fine


def test_image_sizes_round_up_to_the_stride_as_yolov5s(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert config_from_args(build_train_parser().parse_args(["--imgsz", "100"])).imgsz == 128
        assert stride_multiples((640, 1), "--img") == (640, 32)
        assert stride_multiples((1280, 1300), "size", stride=64) == (1280, 1344)  # a P6 model's largest stride
    assert "size 1280 1300: sides must be multiples of 64 (the model's largest stride); using 1280 1344" in caplog.text
    assert "--imgsz 100: sides must be multiples of 32 (64 for the P6 models); using 128" in caplog.text
    assert "--img 640 1: sides must be multiples of 32 (64 for the P6 models); using 640 32" in caplog.text
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # said once per job: the other ranks round alike without a word
    with caplog.at_level(logging.WARNING):
        assert stride_multiples((100,)) == (128,)
    assert not caplog.text
    with pytest.raises(ConfigError, match="--imgsz 0: sides are positive numbers of pixels"):
        config_from_args(build_train_parser().parse_args(["--imgsz", "0"]))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--cache", "gpu"], "--cache gpu"),
        (["--optimizer", "LBFGS"], "--optimizer LBFGS is not one of auto, SGD, Adam, AdamW"),
        (["--label-smoothing", "1.5"], r"--label-smoothing 1.5 must be in \[0, 1\)"),  # checked before auto loads
        (["--epochs", "0"], "--epochs 0"),
        (["--close-mosaic", "-1"], "--close-mosaic -1"),
        (["--weights", "missing.pt"], "--weights missing.pt"),
        (["--seed", "-1"], r"--seed -1 must be in \[0, 2\*\*32\)"),
    ],
)
def test_validate_rejects_bad_flags(flags: list[str], needle: str) -> None:
    cfg = config_from_args(build_train_parser().parse_args(flags))
    with pytest.raises(ConfigError, match=needle):
        validate(cfg, DistContext())


def test_weights_that_are_a_folder_or_an_exported_model_are_named_as_such(tmp_path: Path) -> None:
    onnx = tmp_path / "best.onnx"
    onnx.write_bytes(b"onnx")
    for weights, needle in [
        (tmp_path, f"--weights {tmp_path} is a folder, not a checkpoint file"),
        (onnx, f"--weights {onnx} is an exported ONNX model, not a .pt checkpoint; give the .pt checkpoint"),
    ]:
        cfg = config_from_args(build_train_parser().parse_args(["--weights", str(weights)]))
        with pytest.raises(ConfigError, match=f"^{re.escape(needle)}"):
            validate(cfg, DistContext())


def test_cuda_graph_needs_one_cuda_process_without_compile() -> None:
    import torch

    cfg = config_from_args(build_train_parser().parse_args(["--cuda-graph"]))
    assert cfg.cuda_graph and not config_from_args(build_train_parser().parse_args([])).cuda_graph
    with pytest.raises(ConfigError, match="--cuda-graph needs a CUDA device; this run trains on cpu"):
        validate(cfg, DistContext())
    cuda = torch.device("cuda", 0)  # only compared, never used: no GPU is needed
    validate(cfg, DistContext(device=cuda))
    with pytest.raises(ConfigError, match="--cuda-graph runs in one process; this run has 2"):
        validate(cfg, DistContext(world_size=2, device=cuda))
    compiled = config_from_args(build_train_parser().parse_args(["--cuda-graph", "--compile"]))
    with pytest.raises(ConfigError, match="--cuda-graph and --compile exclude each other"):
        validate(compiled, DistContext(device=cuda))
    varied = config_from_args(build_train_parser().parse_args(["--cuda-graph", "--multi-scale"]))
    with pytest.raises(ConfigError, match="--cuda-graph replays one input shape and --multi-scale changes it"):
        validate(varied, DistContext(device=cuda))


def test_cache_flag_without_value_means_ram() -> None:
    assert config_from_args(build_train_parser().parse_args(["--cache"])).cache == "ram"


def test_compile_flag_takes_a_torch_compile_mode_and_is_off_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_train_parser().parse_args
    assert [
        config_from_args(parse(argv)).compile_mode for argv in ([], ["--compile"], ["--compile", "max-autotune"])
    ] == [
        "",
        "default",
        "max-autotune",
    ]
    with pytest.raises(SystemExit) as stop:
        parse(["--compile", "fast"])
    assert stop.value.code == 2 and "--compile: invalid choice: 'fast'" in capsys.readouterr().err


def test_config_dict_round_trip() -> None:
    cfg = config_from_args(build_train_parser().parse_args(["--freeze", "3", "--cos-lr", "--epochs", "7"]))
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg


def test_val_config_checks_thresholds() -> None:
    parser = build_val_parser()
    with pytest.raises(ConfigError, match="--conf-thres 1.5"):
        val_config_from_args(parser.parse_args(["--weights", "x.pt", "--conf-thres", "1.5"]))
    with pytest.raises(ConfigError, match="^--max-det -5 must be at least 1$"):  # a negative slice would drop the last
        val_config_from_args(parser.parse_args(["--weights", "x.pt", "--max-det", "-5"]))
    with pytest.raises(ConfigError, match=r"--workers -1 must be >= 0"):  # as train.py refuses it
        val_config_from_args(parser.parse_args(["--weights", "x.pt", "--workers", "-1"]))
    cfg = val_config_from_args(parser.parse_args(["--weights", "x.pt", "--iou-thres", "0.5"]))
    assert cfg.iou_thres == 0.5 and cfg.conf_thres == 0.001


def test_cfg_flag_sets_the_model_and_old_checkpoints_still_restore() -> None:
    cfg = config_from_args(build_train_parser("segment").parse_args(["--cfg", "yolov5s-seg"]), "segment")
    assert cfg.model == "yolov5s-seg"
    assert config_from_args(build_train_parser().parse_args([])).model == "yolov8n"  # the quick start's
    assert config_from_args(build_train_parser("segment").parse_args([]), "segment").model == "yolov8n-seg"
    stored = {**cfg.to_dict(), "cfg": "yolov5m"}  # a checkpoint written before the field was renamed
    del stored["model"]
    assert config_from_dict(stored).model == "yolov5m"


@pytest.mark.parametrize(
    ("task", "split", "speed_only", "conf"),
    [("val", "val", False, 0.001), ("test", "test", False, 0.001), ("speed", "val", True, 0.25)],
)
def test_val_task_flag_chooses_split_or_speed(task: str, split: str, speed_only: bool, conf: float) -> None:
    args = build_val_parser().parse_args(["--weights", "x.pt", "--task", task, "--save-json", "--plots"])
    cfg = val_config_from_args(args)
    assert (cfg.split, cfg.speed_only, cfg.conf_thres) == (split, speed_only, conf)
    assert cfg.save_json == cfg.plots == (not speed_only)  # YOLOv5's speed task writes no JSON or plots


def test_per_rank_batch_is_the_one_divisibility_check() -> None:
    assert per_rank_batch(64, DistContext(world_size=8)) == 8
    assert per_rank_batch(5, DistContext()) == 5
    for batch, world in ((30, 4), (0, 1)):
        with pytest.raises(ConfigError, match=f"--batch-size {batch}"):
            per_rank_batch(batch, DistContext(world_size=world))


def test_bare_names_of_shipped_yamls_find_them_as_in_yolov5_and_local_files_come_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    parser = build_train_parser()
    cfg = config_from_args(parser.parse_args(["--hyp", "hyp.scratch-low.yaml", "--data", "synthetic.yaml"]))
    assert (cfg.hyp_path, cfg.data) == (ROOT / "data/hyps/hyp.scratch-low.yaml", ROOT / "data/synthetic.yaml")
    assert cfg.hyp == load_hyp(ROOT / "data/hyps/hyp.scratch-low.yaml")
    (tmp_path / "synthetic.yaml").write_text("train: a\n")  # a file of that name here is the one meant
    assert config_from_args(parser.parse_args(["--data", "synthetic.yaml"])).data == Path("synthetic.yaml")
    val_args = build_val_parser().parse_args(["--weights", "w.pt", "--data", "other/synthetic.yaml"])
    assert val_args.data == Path("other/synthetic.yaml")  # a path with a folder is never looked up elsewhere
    with pytest.raises(ConfigError, match="^nothere.yaml: file not found$"):
        config_from_args(parser.parse_args(["--hyp", "nothere.yaml"]))
