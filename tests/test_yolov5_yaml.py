"""YOLOv5's own YAML files load: hyp files (utils/config.py), model YAMLs (models/yolo.py, models/yolov5_yaml.py)
and dataset YAMLs with `download:` (utils/data/data_config.py). The file contents below are YOLOv5's (v7.0)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from models.yolo import DEFAULT_ANCHORS, DEFAULT_ANCHORS_P6, build_model, scale_width, spec_from_cfg
from segment.task import SEGMENT
from tests.conftest import make_tiny_dataset
from utils.config import ROOT
from utils.data.data_config import load_data_config
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.hyp import load_hyp
from utils.tasks import DETECT

# ultralytics/yolov5 data/hyps/hyp.scratch-low.yaml, key for key (no nbs, no label_smoothing; anchors commented).
YOLOV5_HYP_SCRATCH_LOW = """\
lr0: 0.01 # initial learning rate (SGD=1E-2, Adam=1E-3)
lrf: 0.01 # final OneCycleLR learning rate (lr0 * lrf)
momentum: 0.937 # SGD momentum/Adam beta1
weight_decay: 0.0005 # optimizer weight decay 5e-4
warmup_epochs: 3.0 # warmup epochs (fractions ok)
warmup_momentum: 0.8 # warmup initial momentum
warmup_bias_lr: 0.1 # warmup initial bias lr
box: 0.05 # box loss gain
cls: 0.5 # cls loss gain
cls_pw: 1.0 # cls BCELoss positive_weight
obj: 1.0 # obj loss gain (scale with pixels)
obj_pw: 1.0 # obj BCELoss positive_weight
iou_t: 0.20 # IoU training threshold
anchor_t: 4.0 # anchor-multiple threshold
# anchors: 3  # anchors per output layer (0 to ignore)
fl_gamma: 0.0 # focal loss gamma (efficientDet default gamma=1.5)
hsv_h: 0.015 # image HSV-Hue augmentation (fraction)
hsv_s: 0.7 # image HSV-Saturation augmentation (fraction)
hsv_v: 0.4 # image HSV-Value augmentation (fraction)
degrees: 0.0 # image rotation (+/- deg)
translate: 0.1 # image translation (+/- fraction)
scale: 0.5 # image scale (+/- gain)
shear: 0.0 # image shear (+/- deg)
perspective: 0.0 # image perspective (+/- fraction), range 0-0.001
flipud: 0.0 # image flip up-down (probability)
fliplr: 0.5 # image flip left-right (probability)
mosaic: 1.0 # image mosaic (probability)
mixup: 0.0 # image mixup (probability)
copy_paste: 0.0 # segment copy-paste (probability)
"""

_BACKBONE = """\
backbone:
  # [from, number, module, args]
  [
    [-1, 1, Conv, [64, 6, 2, 2]], # 0-P1/2
    [-1, 1, Conv, [128, 3, 2]], # 1-P2/4
    [-1, 3, C3, [128]],
    [-1, 1, Conv, [256, 3, 2]], # 3-P3/8
    [-1, 6, C3, [256]],
    [-1, 1, Conv, [512, 3, 2]], # 5-P4/16
    [-1, 9, C3, [512]],
    [-1, 1, Conv, [1024, 3, 2]], # 7-P5/32
    [-1, 3, C3, [1024]],
    [-1, 1, SPPF, [1024, 5]], # 9
  ]
"""
_PARAMETERS = """\
nc: 80 # number of classes
depth_multiple: 0.33 # model depth multiple
width_multiple: 0.50 # layer channel multiple
anchors:
  - [10, 13, 16, 30, 33, 23] # P3/8
  - [30, 61, 62, 45, 59, 119] # P4/16
  - [116, 90, 156, 198, 373, 326] # P5/32
"""
_HEAD = """\
head: [
    [-1, 1, Conv, [512, 1, 1]],
    [-1, 1, nn.Upsample, [None, 2, "nearest"]],
    [[-1, 6], 1, Concat, [1]], # cat backbone P4
    [-1, 3, C3, [512, False]], # 13

    [-1, 1, Conv, [256, 1, 1]],
    [-1, 1, nn.Upsample, [None, 2, "nearest"]],
    [[-1, 4], 1, Concat, [1]], # cat backbone P3
    [-1, 3, C3, [256, False]], # 17 (P3/8-small)

    [-1, 1, Conv, [256, 3, 2]],
    [[-1, 14], 1, Concat, [1]], # cat head P4
    [-1, 3, C3, [512, False]], # 20 (P4/16-medium)

    [-1, 1, Conv, [512, 3, 2]],
    [[-1, 10], 1, Concat, [1]], # cat head P5
    [-1, 3, C3, [1024, False]], # 23 (P5/32-large)

"""
# ultralytics/yolov5 models/yolov5s.yaml and models/segment/yolov5s-seg.yaml.
YOLOV5S = _PARAMETERS + _BACKBONE + _HEAD + "    [[17, 20, 23], 1, Detect, [nc, anchors]], # Detect(P3, P4, P5)\n  ]\n"
YOLOV5S_SEG = _PARAMETERS + _BACKBONE + _HEAD + "    [[17, 20, 23], 1, Segment, [nc, anchors, 32, 256]],\n  ]\n"

# ultralytics/yolov5 models/hub/yolov5s6.yaml: P3-P6, four output levels.
YOLOV5S6 = """\
nc: 80 # number of classes
depth_multiple: 0.33 # model depth multiple
width_multiple: 0.50 # layer channel multiple
anchors:
  - [19, 27, 44, 40, 38, 94] # P3/8
  - [96, 68, 86, 152, 180, 137] # P4/16
  - [140, 301, 303, 264, 238, 542] # P5/32
  - [436, 615, 739, 380, 925, 792] # P6/64
backbone:
  [
    [-1, 1, Conv, [64, 6, 2, 2]], # 0-P1/2
    [-1, 1, Conv, [128, 3, 2]], # 1-P2/4
    [-1, 3, C3, [128]],
    [-1, 1, Conv, [256, 3, 2]], # 3-P3/8
    [-1, 6, C3, [256]],
    [-1, 1, Conv, [512, 3, 2]], # 5-P4/16
    [-1, 9, C3, [512]],
    [-1, 1, Conv, [768, 3, 2]], # 7-P5/32
    [-1, 3, C3, [768]],
    [-1, 1, Conv, [1024, 3, 2]], # 9-P6/64
    [-1, 3, C3, [1024]],
    [-1, 1, SPPF, [1024, 5]], # 11
  ]
head: [
    [-1, 1, Conv, [768, 1, 1]],
    [-1, 1, nn.Upsample, [None, 2, "nearest"]],
    [[-1, 8], 1, Concat, [1]], # cat backbone P5
    [-1, 3, C3, [768, False]], # 15
    [-1, 1, Conv, [512, 1, 1]],
    [-1, 1, nn.Upsample, [None, 2, "nearest"]],
    [[-1, 6], 1, Concat, [1]], # cat backbone P4
    [-1, 3, C3, [512, False]], # 19
    [-1, 1, Conv, [256, 1, 1]],
    [-1, 1, nn.Upsample, [None, 2, "nearest"]],
    [[-1, 4], 1, Concat, [1]], # cat backbone P3
    [-1, 3, C3, [256, False]], # 23 (P3/8-small)
    [-1, 1, Conv, [256, 3, 2]],
    [[-1, 20], 1, Concat, [1]], # cat head P4
    [-1, 3, C3, [512, False]], # 26 (P4/16-medium)
    [-1, 1, Conv, [512, 3, 2]],
    [[-1, 16], 1, Concat, [1]], # cat head P5
    [-1, 3, C3, [768, False]], # 29 (P5/32-large)
    [-1, 1, Conv, [768, 3, 2]],
    [[-1, 12], 1, Concat, [1]], # cat head P6
    [-1, 3, C3, [1024, False]], # 32 (P6/64-xlarge)
    [[23, 26, 29, 32], 1, Detect, [nc, anchors]], # Detect(P3, P4, P5, P6)
  ]
"""
SIZES = {"n": (0.33, 0.25), "s": (0.33, 0.50), "m": (0.67, 0.75), "l": (1.0, 1.0), "x": (1.33, 1.25)}


def _write(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def _one_line_error(cfg: str, num_classes: int = 3) -> str:
    with pytest.raises(ConfigError) as error:
        spec_from_cfg(cfg, num_classes)
    message = str(error.value)
    assert "\n" not in message and Path(cfg).name in message
    return message


# --- hyp files -------------------------------------------------------------------------------------------


def test_yolov5_hyp_file_loads_with_yolov5_defaults_and_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = Path(_write(tmp_path, "hyp.scratch-low.yaml", YOLOV5_HYP_SCRATCH_LOW))
    ours = load_hyp(ROOT / "data" / "hyps" / "hyp.scratch-low.yaml")
    with caplog.at_level(logging.INFO):
        hyp = load_hyp(path)
    assert hyp == ours  # our recipe file is YOLOv5's plus the two train.py values
    assert (hyp.nbs, hyp.label_smoothing, hyp.fl_gamma, hyp.lr0, hyp.copy_paste) == (64.0, 0.0, 0.0, 0.01, 0.0)
    [record] = caplog.records
    message = record.getMessage()
    assert str(path) in message and "nbs=64" in message and "label_smoothing=0" in message and "\n" not in message
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert load_hyp(path, {"label_smoothing": 0.1}).label_smoothing == 0.1  # the flag, not a default
    assert "label_smoothing" not in caplog.records[0].getMessage()


def test_own_scratch_high_is_yolov5s(tmp_path: Path) -> None:
    changes = {"lrf: 0.01": "lrf: 0.1", "cls: 0.5": "cls: 0.3", "obj: 1.0": "obj: 0.7", "scale: 0.5": "scale: 0.9"}
    changes |= {"mixup: 0.0": "mixup: 0.1", "copy_paste: 0.0": "copy_paste: 0.1"}  # YOLOv5's hyp.scratch-high.yaml
    text = YOLOV5_HYP_SCRATCH_LOW
    for old, new in changes.items():
        text = text.replace(old, new)
    high = load_hyp(Path(_write(tmp_path, "hyp.scratch-high.yaml", text)))
    assert high == load_hyp(ROOT / "data" / "hyps" / "hyp.scratch-high.yaml") and high.copy_paste == 0.1


def test_yolov5_hyp_anchors_key_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = Path(
        _write(tmp_path, "hyp.VOC.yaml", YOLOV5_HYP_SCRATCH_LOW + "anchors: 3.412 # anchors per output layer\n")
    )
    with caplog.at_level(logging.INFO):
        hyp = load_hyp(path)
    assert hyp.nbs == 64.0
    [record] = caplog.records  # defaults and anchors in one line
    assert record.levelno == logging.WARNING and "anchors: 3.412' is ignored" in record.getMessage()
    assert "nbs=64" in record.getMessage()


def test_own_hyp_files_load_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        for path in sorted((ROOT / "data" / "hyps").glob("hyp.*.yaml")):  # space.*.yaml are tune.py's search spaces
            load_hyp(path)
    assert not caplog.records


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda text: text.replace("box: 0.05", ""), "missing hyperparameter 'box'"),
        (lambda text: text + "albumentations: 1\n", "unknown hyperparameter 'albumentations'"),
        (lambda text: text + "anchors: three\n", "'anchors' must be a number"),
    ],
)
def test_other_hyp_mistakes_stay_errors(tmp_path: Path, change: Callable[[str], str], needle: str) -> None:
    path = Path(_write(tmp_path, "hyp.yaml", change(YOLOV5_HYP_SCRATCH_LOW)))
    with pytest.raises(ConfigError, match=needle) as error:
        load_hyp(path)
    assert str(path) in str(error.value)


# --- model YAMLs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_yolov5_model_yamls_give_the_named_specs(tmp_path: Path, size: str) -> None:
    depth, width = SIZES[size]
    scaled = f"depth_multiple: {depth}\nwidth_multiple: {width}\n"
    base = "depth_multiple: 0.33 # model depth multiple\nwidth_multiple: 0.50 # layer channel multiple\n"
    detect = _write(tmp_path, f"yolov5{size}.yaml", YOLOV5S.replace(base, scaled))
    seg = _write(tmp_path, f"yolov5{size}-seg.yaml", YOLOV5S_SEG.replace(base, scaled))
    assert spec_from_cfg(detect, 7) == spec_from_cfg(f"yolov5{size}", 7)
    seg_spec = spec_from_cfg(seg, 7)
    assert seg_spec == spec_from_cfg(f"yolov5{size}-seg", 7)
    assert (seg_spec.num_masks, seg_spec.num_protos) == (32, scale_width(256, width))


def test_yolov5s_yaml_builds_the_same_network(tmp_path: Path) -> None:
    spec = spec_from_cfg(_write(tmp_path, "yolov5s-seg.yaml", YOLOV5S_SEG), 80)
    assert spec.num_classes == 80 and spec.anchors == DEFAULT_ANCHORS
    from_yaml, from_name = build_model(spec), build_model(spec_from_cfg("yolov5s-seg", 80))
    shapes = {key: tuple(value.shape) for key, value in from_yaml.state_dict().items()}
    assert shapes == {key: tuple(value.shape) for key, value in from_name.state_dict().items()}
    assert shapes["head.proto.expand.conv.weight"][0] == 128  # 256 prototypes x width 0.5


def test_segment_task_resolves_yolov5_yamls(tmp_path: Path) -> None:
    seg, detect = _write(tmp_path, "yolov5s-seg.yaml", YOLOV5S_SEG), _write(tmp_path, "yolov5s.yaml", YOLOV5S)
    assert SEGMENT.spec_from_cfg(seg, 3) == spec_from_cfg("yolov5s-seg", 3)
    assert SEGMENT.spec_from_cfg(detect, 3) == spec_from_cfg("yolov5s-seg", 3)  # as with the name yolov5s
    assert DETECT.spec_from_cfg(detect, 3) == spec_from_cfg("yolov5s", 3)
    with pytest.raises(ConfigError, match="segmentation model"):
        DETECT.spec_from_cfg(seg, 3)


def test_segment_arguments_set_masks_and_width_scaled_protos(tmp_path: Path) -> None:
    content = YOLOV5S_SEG.replace("[nc, anchors, 32, 256]", "[nc, anchors, 16, 128]")
    spec = spec_from_cfg(_write(tmp_path, "seg16.yaml", content), 3)
    assert (spec.num_masks, spec.num_protos) == (16, 64)
    short = spec_from_cfg(_write(tmp_path, "seg-default.yaml", YOLOV5S_SEG.replace(", 32, 256]", "]")), 3)
    assert (short.num_masks, short.num_protos) == (32, 128)  # YOLOv5's Segment defaults


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("depth_multiple: 0.33", "depth_multiple: .nan", "depth_multiple and width_multiple must be finite and > 0"),
        ("[10, 13, 16, 30, 33, 23]", "[-10, 13, 16, 30, 33, 23]", "anchor sizes must be finite and > 0 pixels"),
    ],
)
def test_a_multiplier_or_anchor_that_is_not_a_positive_number_is_one_line(
    tmp_path: Path, old: str, new: str, needle: str
) -> None:
    # A NaN depth failed while building the model; a negative anchor trained (and AutoAnchor took its log).
    assert needle in _one_line_error(_write(tmp_path, "yolov5s.yaml", YOLOV5S.replace(old, new)))


def test_p6_yaml_gives_the_yolov5s6_spec_and_network(tmp_path: Path) -> None:
    spec = spec_from_cfg(_write(tmp_path, "yolov5s6.yaml", YOLOV5S6), 80)
    assert spec == spec_from_cfg("yolov5s6", 80) and spec.anchors == DEFAULT_ANCHORS_P6
    counted = YOLOV5S6[: YOLOV5S6.index("anchors:")] + "anchors: 3\n" + YOLOV5S6[YOLOV5S6.index("backbone:") :]
    assert spec_from_cfg(_write(tmp_path, "auto6.yaml", counted), 80).anchors == DEFAULT_ANCHORS_P6
    three = YOLOV5S6.replace("  - [436, 615, 739, 380, 925, 792] # P6/64\n", "")
    assert "'anchors' lists 3 levels but the head has 4" in _one_line_error(_write(tmp_path, "three.yaml", three))


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [  # P2-P5: four levels too, but not the P6 ones; P3-P7: five levels
        ("[[17, 20, 23], 1, Detect", "[[2, 17, 20, 23], 1, Detect", "P2-P5 (4 output levels) is not supported"),
        ("[[17, 20, 23], 1, Detect", "[[17, 20], 1, Detect", "P3-P4 (2 output levels) is not supported"),
    ],
)
def test_p2_and_p3_p4_yamls_are_one_line_errors(tmp_path: Path, old: str, new: str, needle: str) -> None:
    message = _one_line_error(_write(tmp_path, "custom.yaml", YOLOV5S.replace(old, new)))
    assert needle in message and "yolov5n-x and -seg P5 layouts and the yolov5n6-x6 P6 layout" in message


def test_p7_and_p6_seg_yamls_are_one_line_errors(tmp_path: Path) -> None:
    head = "    [[23, 26, 29, 32], 1, Detect, [nc, anchors]]"
    p7 = YOLOV5S6.replace(
        head, "    [-1, 1, Conv, [1024, 3, 2]], # 33-P7/128\n    [[23, 26, 29, 32, 33], 1, Detect, [nc, anchors]]"
    )
    assert "P3-P7 (5 output levels) is not supported" in _one_line_error(_write(tmp_path, "p7.yaml", p7))
    seg = YOLOV5S6.replace(head, "    [[23, 26, 29, 32], 1, Segment, [nc, anchors, 32, 256]]")
    assert "there are no P6 -seg models" in _one_line_error(_write(tmp_path, "seg6.yaml", seg))


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("[-1, 3, C3, [512, False]], # 13", "[-1, 3, C3, [512, True]],", r"layer 13 \[-1, 3, C3, \[512, True\]\]"),
        ("[-1, 1, Conv, [128, 3, 2]], # 1-P2/4", "[-1, 1, GhostConv, [128, 3, 2]],", "layer 1 .*GhostConv"),
        ("[-1, 9, C3, [512]],", "[-1, 6, C3, [512]],", r"layer 6 .*standard \[-1, 9, C3, \[512\]\]"),
        ("[[-1, 14], 1, Concat, [1]],", "[[-1, 14, 6], 1, Concat, [1]],", r"layer 19 \[\[-1, 14, 6\]"),
        ("[[17, 20, 23], 1, Detect", "[[17, 20, 22], 1, Detect", r"head \[\[17, 20, 22\]"),
        ("Detect, [nc, anchors]]", "Detect, [nc, anchors, 32]]", "head .*Detect, \\[nc, anchors\\]\\]"),
        ("[-1, 1, SPPF, [1024, 5]], # 9", "[-1, 1, SPPF, [1024, 5]],\n    [-1, 1, Conv, [1024, 1, 1]],", "layer 10"),
    ],
)
def test_modified_layout_is_a_one_line_error_naming_the_layer(tmp_path: Path, old: str, new: str, needle: str) -> None:
    assert old in YOLOV5S
    message = _one_line_error(_write(tmp_path, "custom.yaml", YOLOV5S.replace(old, new)))
    assert re.search(needle, message), message


def test_yolov5_keys_activation_anchor_count_and_conflicts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    silu = spec_from_cfg(_write(tmp_path, "silu.yaml", "activation: nn.SiLU()\n" + YOLOV5S), 3)
    assert silu == spec_from_cfg("yolov5s", 3)
    assert "activation nn.LeakyReLU(0.1) is not supported" in _one_line_error(
        _write(tmp_path, "leaky.yaml", "activation: nn.LeakyReLU(0.1)\n" + YOLOV5S)
    )
    anchors_list = _PARAMETERS[_PARAMETERS.index("anchors:") :]
    counted = YOLOV5S.replace(anchors_list, "anchors: 3 # AutoAnchor evolves 3 anchors per P output layer\n")
    with caplog.at_level(logging.INFO):
        assert spec_from_cfg(_write(tmp_path, "auto.yaml", counted), 3).anchors == DEFAULT_ANCHORS
    assert any("AutoAnchor" in record.getMessage() for record in caplog.records)
    assert "'anchors: 4' per level is not supported" in _one_line_error(
        _write(tmp_path, "four.yaml", counted.replace("anchors: 3 #", "anchors: 4 #"))
    )
    assert "'num_masks' cannot be combined" in _one_line_error(_write(tmp_path, "nm.yaml", "num_masks: 8\n" + YOLOV5S))
    only_backbone = _PARAMETERS + _BACKBONE
    assert "'backbone' and 'head' must both be lists" in _one_line_error(_write(tmp_path, "half.yaml", only_backbone))


# --- dataset YAMLs ---------------------------------------------------------------------------------------


def _coco128_style(tmp_path: Path, **changes: str) -> Path:
    """A dataset YAML laid out like YOLOv5's data/coco128.yaml over a tiny local shapes dataset."""
    make_tiny_dataset(tmp_path, SyntheticSpec(num_train=2, num_val=1, min_side=64, max_side=64, max_objects=2))
    lines = {
        "path": "path: shapes # dataset root dir",
        "train": "train: images/train # train images (relative to 'path')",
        "val": "val: images/val # val images (relative to 'path')",
        "test": "test: # test images (optional)",
        "nc": f"nc: {len(SHAPE_NAMES)}",
        "names": "names:\n" + "".join(f"  {i}: {name}\n" for i, name in enumerate(SHAPE_NAMES)),
        "download": "# Download script/URL (optional)\ndownload: https://example.invalid/coco128.zip",
    }
    lines.update(changes)
    path = tmp_path / "coco128.yaml"
    path.write_text("\n".join(lines.values()) + "\n")
    return path


def test_download_key_is_ignored_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _coco128_style(tmp_path)
    with caplog.at_level(logging.INFO):
        data = load_data_config(path, DistContext())
    assert data.names == SHAPE_NAMES and set(data.splits) == {"train", "val"}
    # Only this module's records: a thread left by an earlier test (a loader worker) may log meanwhile.
    [record] = [r for r in caplog.records if r.name == "utils.data.data_config"]
    assert (
        record.levelno == logging.WARNING
        and str(path) in record.getMessage()
        and "'download' is ignored" in (record.getMessage())
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        load_data_config(path, DistContext(rank=1, local_rank=1, world_size=2))
    assert not [r for r in caplog.records if r.name == "utils.data.data_config"]  # once per run: rank 0 says it


def test_download_script_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    script = f"download: |\n  from pathlib import Path\n  Path('{marker}').touch()\n"
    load_data_config(_coco128_style(tmp_path, download=script), DistContext())
    assert not marker.exists()
    missing = _coco128_style(tmp_path, val="val: images/nowhere", download=script)
    with pytest.raises(ConfigError, match=r"'val' path .*nowhere does not exist \('download' is not run"):
        load_data_config(missing, DistContext())
    assert not marker.exists()


@pytest.mark.parametrize(
    ("nc", "needle"), [("nc: 5", "nc=5 but 'names' has 6 entries"), ("nc: six", "'nc' must be a positive integer")]
)
def test_nc_must_agree_with_names(tmp_path: Path, nc: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as error:
        load_data_config(_coco128_style(tmp_path, nc=nc), DistContext())
    assert "coco128.yaml" in str(error.value) and "\n" not in str(error.value)


def test_nc_without_names_still_names_classes(tmp_path: Path) -> None:
    data = load_data_config(_coco128_style(tmp_path, names="", nc="nc: 2"), DistContext())
    assert data.names == ("class0", "class1")


def test_empty_layer_lists_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "yolov5s.yaml"
    path.write_text("nc: 3\ndepth_multiple: 0.33\nwidth_multiple: 0.5\nanchors: 3\nbackbone: []\nhead: []\n")
    assert "'backbone' and 'head' list no layers" in _one_line_error(str(path))
