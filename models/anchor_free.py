"""Anchor-free YOLOv8 / YOLO11 / YOLO26 detection and -seg models: layouts, scales, AnchorFreeSpec, build."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from models.blocks import Concat, Conv, fuse_convs, upsample2x
from models.csp_blocks import C2PSA, C2f, C3k2, PoolPyramid
from models.dense_head import DenseHead, DenseRaw, SegmentDenseHead
from models.ultralytics_yaml import is_ultralytics_yaml, read_ultralytics_yaml
from utils.errors import ConfigError

LAYOUTS = ("yolov8", "yolo11", "yolo26")
# Size -> (depth_multiple, width_multiple, max_channels) per layout: the published scale rows.
SCALES: dict[str, dict[str, tuple[float, float, int]]] = {
    "yolov8": {
        "n": (0.33, 0.25, 1024),
        "s": (0.33, 0.50, 1024),
        "m": (0.67, 0.75, 768),
        "l": (1.00, 1.00, 512),
        "x": (1.00, 1.25, 512),
    },
    "yolo11": {
        "n": (0.50, 0.25, 1024),
        "s": (0.50, 0.50, 1024),
        "m": (0.50, 1.00, 512),
        "l": (1.00, 1.00, 512),
        "x": (1.00, 1.50, 512),
    },
}
SCALES["yolo26"] = SCALES["yolo11"]
SEG_NUM_MASKS = 32
SEG_BASE_PROTOS = 256
# At these sizes every C3k2 link is a C3k whatever the layout row says (how the published m/l/x models are built).
FORCED_C3K_SCALES = ("m", "l", "x")
CFG_NAME = re.compile(r"^(yolov8|yolo11|yolo26)([nsmlx])(-seg)?$")
CFG_NAMES = "yolov8|yolo11|yolo26 + n|s|m|l|x"  # what CFG_NAME accepts (each optionally -seg), as errors list it


@dataclass(frozen=True)
class AnchorFreeSpec:
    """Everything needed to rebuild an anchor-free model; stored in checkpoints via `to_dict()`.

    `layout` picks the network (yolov8: C2f; yolo11: C3k2 + C2PSA attention; yolo26: yolo11's with a
    residual SPPF and attention in the last neck stage). `reg_max` bins per box side (16: DFL; 1: the
    distances directly), `end_to_end` trains a one-to-one branch whose outputs need no NMS.
    `num_masks > 0` makes a segmentation model with `num_protos` prototypes. `scale` is the size
    letter the multipliers came from ('' for a custom row). `linear_pool_reduce` leaves the SPPF's first 1x1
    conv without an activation, as YOLO26 always has it and Ultralytics 8.4.0-8.4.140 built YOLOv8/YOLO11 too
    (set by weight conversion when the file's SPPF says so).
    """

    family: ClassVar[str] = "anchor_free"
    layout: str
    depth_multiple: float
    width_multiple: float
    max_channels: int
    num_classes: int
    reg_max: int = 16
    end_to_end: bool = False
    num_masks: int = 0
    num_protos: int = 0
    scale: str = ""
    linear_pool_reduce: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        multipliers = (self.depth_multiple, self.width_multiple)
        if not all(math.isfinite(v) and v > 0 for v in multipliers) or self.max_channels < 8:
            raise ValueError(f"bad scale {(self.depth_multiple, self.width_multiple, self.max_channels)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.reg_max < 1:
            raise ValueError(f"reg_max must be >= 1, got {self.reg_max}")
        if self.num_masks < 0 or (self.num_masks > 0) != (self.num_protos > 0):
            masks = (self.num_masks, self.num_protos)
            raise ValueError(f"num_masks and num_protos must both be 0 or both be > 0, got {masks}")

    def to_dict(self) -> dict[str, Any]:
        """Return plain YAML/JSON-safe data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnchorFreeSpec:
        """Rebuild a spec from `to_dict()` output; unknown keys raise ValueError."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"AnchorFreeSpec.from_dict: unknown key '{unknown[0]}'")
        return cls(**data)

    @property
    def max_stride(self) -> int:
        """Pixels per grid cell of the coarsest level (P5): image sides are multiples of it."""
        return int(STRIDES[-1])

    def width(self, channels: int) -> int:
        """Channels after capping at `max_channels` and width scaling, rounded up to a multiple of 8."""
        return int(math.ceil(min(channels, self.max_channels) * self.width_multiple / 8) * 8)

    def depth(self, repeats: int) -> int:
        """Repeats after depth scaling (at least 1 where the base has more)."""
        return max(round(repeats * self.depth_multiple), 1) if repeats > 1 else repeats


def segmentation_spec(
    spec: AnchorFreeSpec, num_masks: int = SEG_NUM_MASKS, base_protos: int = SEG_BASE_PROTOS
) -> AnchorFreeSpec:
    """Return `spec` with `num_masks` mask coefficients and `base_protos` (256) prototypes, capped and width-scaled
    like a layer."""
    return replace(spec, num_masks=num_masks, num_protos=spec.width(base_protos))


def spec_for_name(name: str, num_classes: int) -> AnchorFreeSpec:
    """The spec of a published model name: 'yolov8n', 'yolo11s-seg', 'yolo26x' ... (ConfigError otherwise)."""
    match = CFG_NAME.match(name.lower())
    if match is None:
        raise ConfigError(f"--cfg {name}: not an anchor-free model name ({CFG_NAMES}, optionally -seg)")
    layout, size, seg = match.groups()
    depth, width, max_channels = SCALES[layout][size]
    is_26 = layout == "yolo26"
    spec = AnchorFreeSpec(
        layout, depth, width, max_channels, num_classes, reg_max=1 if is_26 else 16, end_to_end=is_26, scale=size
    )
    return segmentation_spec(spec) if seg else spec


def _model_yaml(cfg: str) -> Path | None:
    """`cfg` as an existing .yaml/.yml file, else None."""
    path = Path(cfg)
    return path if path.suffix in (".yaml", ".yml") and path.is_file() else None


def claims_cfg(cfg: str) -> bool:
    """Whether `--cfg` names an anchor-free model: a published name (optionally .yaml), or an Ultralytics model YAML."""
    stem = cfg.lower().removesuffix(".yaml").removesuffix(".yml").rsplit("/", 1)[-1]
    path = _model_yaml(cfg)
    return CFG_NAME.match(stem) is not None or (path is not None and is_ultralytics_yaml(path))


def spec_from_cfg(cfg: str, num_classes: int) -> AnchorFreeSpec:
    """Resolve an anchor-free `--cfg`: an existing model YAML is read and checked (models/ultralytics_yaml.py),
    otherwise a published size name, with or without .yaml, gives its spec."""
    path = _model_yaml(cfg)
    if path is not None:
        return _spec_from_yaml(path, num_classes)
    stem = cfg.lower().removesuffix(".yaml").removesuffix(".yml").rsplit("/", 1)[-1]
    return spec_for_name(stem, num_classes)


def _spec_from_yaml(path: Path, num_classes: int) -> AnchorFreeSpec:
    """The spec a checked Ultralytics model YAML describes (one-line ConfigError for a bad value)."""
    read = read_ultralytics_yaml(path, num_classes)
    try:
        spec = AnchorFreeSpec(
            read.layout,
            read.depth_multiple,
            read.width_multiple,
            read.max_channels,
            num_classes,
            reg_max=read.reg_max,
            end_to_end=read.end_to_end,
            scale=read.scale,
        )
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    return segmentation_spec(spec, read.num_masks, read.base_protos) if read.num_masks else spec


class AnchorFreeBackbone(nn.Module):
    """Stem, four stride-2 stages with CSP blocks, SPPF (and C2PSA attention for YOLO11/26). Returns P3, P4, P5."""

    def __init__(self, spec: AnchorFreeSpec) -> None:
        super().__init__()
        w, d = spec.width, spec.depth
        self.stem = Conv(3, w(64), 3, 2)  # P1/2
        self.down2 = Conv(w(64), w(128), 3, 2)  # P2/4
        if spec.layout == "yolov8":
            self.stage2 = C2f(w(128), w(128), d(3), shortcut=True)
            self.down3 = Conv(w(128), w(256), 3, 2)  # P3/8
            self.stage3 = C2f(w(256), w(256), d(6), shortcut=True)
            self.down4 = Conv(w(256), w(512), 3, 2)  # P4/16
            self.stage4 = C2f(w(512), w(512), d(6), shortcut=True)
            self.down5 = Conv(w(512), w(1024), 3, 2)  # P5/32
            self.stage5 = C2f(w(1024), w(1024), d(3), shortcut=True)
        else:
            big = spec.scale in FORCED_C3K_SCALES
            self.stage2 = C3k2(w(128), w(256), d(2), use_c3k=big, expansion=0.25)
            self.down3 = Conv(w(256), w(256), 3, 2)
            self.stage3 = C3k2(w(256), w(512), d(2), use_c3k=big, expansion=0.25)
            self.down4 = Conv(w(512), w(512), 3, 2)
            self.stage4 = C3k2(w(512), w(512), d(2), use_c3k=True)
            self.down5 = Conv(w(512), w(1024), 3, 2)
            self.stage5 = C3k2(w(1024), w(1024), d(2), use_c3k=True)
        is_26 = spec.layout == "yolo26"
        linear_reduce = is_26 or spec.linear_pool_reduce
        self.pyramid = PoolPyramid(w(1024), w(1024), 5, residual=is_26, reduce_activation=not linear_reduce)
        self.attention = C2PSA(w(1024), d(2)) if spec.layout != "yolov8" else None
        self.out_channels = (self.stage3_width(spec), w(512), w(1024))

    @staticmethod
    def stage3_width(spec: AnchorFreeSpec) -> int:
        """Width of the P3 output: 256 for YOLOv8, 512 for YOLO11/26 (before scaling)."""
        return spec.width(256 if spec.layout == "yolov8" else 512)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) -> P3 (stride 8), P4 (stride 16), P5 (stride 32)."""
        p3 = self.stage3(self.down3(self.stage2(self.down2(self.stem(x)))))
        p4 = self.stage4(self.down4(p3))
        p5 = self.pyramid(self.stage5(self.down5(p4)))
        if self.attention is not None:
            p5 = self.attention(p5)
        return p3, p4, p5


class AnchorFreeNeck(nn.Module):
    """PAN neck without lateral convs: upsample + concat + CSP block down to P3, then stride-2 conv + concat back up."""

    def __init__(self, spec: AnchorFreeSpec, in_channels: tuple[int, int, int]) -> None:
        super().__init__()
        w, d = spec.width, spec.depth
        c3, c4, c5 = in_channels
        self.upsample = upsample2x()
        self.concat = Concat(1)
        if spec.layout == "yolov8":
            self.top_down4 = C2f(c5 + c4, w(512), d(3))
            self.top_down3 = C2f(w(512) + c3, w(256), d(3))
            self.down3 = Conv(w(256), w(256), 3, 2)
            self.bottom_up4 = C2f(w(256) + w(512), w(512), d(3))
            self.down4 = Conv(w(512), w(512), 3, 2)
            self.bottom_up5 = C2f(w(512) + c5, w(1024), d(3))
        else:
            is_26 = spec.layout == "yolo26"
            big = is_26 or spec.scale in FORCED_C3K_SCALES
            self.top_down4 = C3k2(c5 + c4, w(512), d(2), use_c3k=big)
            self.top_down3 = C3k2(w(512) + c3, w(256), d(2), use_c3k=big)
            self.down3 = Conv(w(256), w(256), 3, 2)
            self.bottom_up4 = C3k2(w(256) + w(512), w(512), d(2), use_c3k=big)
            self.down4 = Conv(w(512), w(512), 3, 2)
            self.bottom_up5 = C3k2(w(512) + c5, w(1024), d(1 if is_26 else 2), use_c3k=True, attention=is_26)
        self.out_channels = (w(256), w(512), w(1024))

    def forward(self, features: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        """Backbone (P3, P4, P5) -> neck outputs with `out_channels` channels at the same strides."""
        p3, p4, p5 = features
        mid4 = self.top_down4(self.concat([self.upsample(p5), p4]))
        out3 = self.top_down3(self.concat([self.upsample(mid4), p3]))
        out4 = self.bottom_up4(self.concat([self.down3(out3), mid4]))
        out5 = self.bottom_up5(self.concat([self.down4(out4), p5]))
        return [out3, out4, out5]


STRIDES = (8.0, 16.0, 32.0)


class AnchorFreeModel(nn.Module):
    """Anchor-free detector (or, with `spec.num_masks`, segmenter): backbone -> PAN neck -> dense head.

    Input: (B, 3, H, W) float in [0, 1] with H and W multiples of 32. Output: see DenseHead /
    SegmentDenseHead (train: DenseRaw [, protos]; eval: (decoded (B, N, 4 + nc [+ nm]), train output)).
    """

    counts_norm_flops = True  # GFLOPs as Ultralytics prints them: batch norms of the unfused model included

    def __init__(self, spec: AnchorFreeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.backbone = AnchorFreeBackbone(spec)
        self.neck = AnchorFreeNeck(spec, self.backbone.out_channels)
        strides = STRIDES
        options = dict(reg_max=spec.reg_max, depthwise_classes=spec.layout != "yolov8", end_to_end=spec.end_to_end)
        if spec.num_masks:
            self.head: DenseHead = SegmentDenseHead(
                spec.num_classes,
                strides,
                self.neck.out_channels,
                num_masks=spec.num_masks,
                num_protos=spec.num_protos,
                multi_scale_protos=spec.layout == "yolo26",
                **options,
            )
        else:
            self.head = DenseHead(spec.num_classes, strides, self.neck.out_channels, **options)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = 1e-3, 0.03  # as the published models: smoother running stats

    def forward(self, x: torch.Tensor) -> DenseRaw | tuple:
        """x: (B, 3, H, W) float in [0, 1]; H, W multiples of 32."""
        return self.head(self.neck(self.backbone(x)))

    @property
    def stride(self) -> torch.Tensor:
        """(3,) float pixels per grid cell of P3, P4, P5: [8, 16, 32]."""
        return self.head.stride

    @property
    def num_classes(self) -> int:
        """Number of object classes the head predicts."""
        return self.head.num_classes

    def layers(self) -> list[nn.Module]:
        """The network as the published layer list (backbone 0-9 or 0-10, neck, head last), for --freeze.

        Indices match Ultralytics' YAML rows, so `--freeze 10` freezes the YOLOv8 backbone and
        `--freeze 11` the YOLO11/26 one, as users of those models expect.
        """
        b, n = self.backbone, self.neck
        backbone = [b.stem, b.down2, b.stage2, b.down3, b.stage3, b.down4, b.stage4, b.down5, b.stage5, b.pyramid]
        if b.attention is not None:
            backbone.append(b.attention)
        neck = [n.upsample, n.concat, n.top_down4, n.upsample, n.concat, n.top_down3]
        neck += [n.down3, n.concat, n.bottom_up4, n.down4, n.concat, n.bottom_up5]
        return [*backbone, *neck, self.head]

    def fuse(self) -> AnchorFreeModel:
        """Fold every BatchNorm into its conv for faster inference, and drop the branches an end-to-end head does
        not decode; returns self. Use only for eval."""
        fuse_convs(self)
        self.head.drop_one_to_many()
        return self


def build_model(spec: AnchorFreeSpec) -> AnchorFreeModel:
    """Build the anchor-free model `spec` describes (CPU, train mode, biases initialised)."""
    return AnchorFreeModel(spec)
