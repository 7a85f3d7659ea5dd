"""YOLOv5 (v6+) detection (P5, P6) and -seg models in plain Python: ModelSpec, backbone, PAN neck, build_model()."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from models.blocks import C3, SPPF, Concat, Conv, fuse_convs, upsample2x
from models.heads import DetectHead, HeadOutput, SegmentHead
from models.yolov5_yaml import LAYOUT_KEYS, read_yolov5_layout
from utils.errors import ConfigError, read_yaml_mapping

LOGGER = logging.getLogger(__name__)

# Size name -> (depth_multiple, width_multiple); a new size is one row.
SCALES: dict[str, tuple[float, float]] = {
    "n": (0.33, 0.25),
    "s": (0.33, 0.50),
    "m": (0.67, 0.75),
    "l": (1.0, 1.0),
    "x": (1.33, 1.25),
}
# The size names spec_from_cfg accepts, as errors list them: P5 (each optionally -seg) and P6 (detection only).
CFG_NAMES = "yolov5n|s|m|l|x"
CFG_NAMES_P6 = "yolov5n6|s6|m6|l6|x6"
# Anchor w, h pairs in pixels for P3/8, P4/16, P5/32 (fitted on COCO at 640).
DEFAULT_ANCHORS: tuple[tuple[float, ...], ...] = (
    (10, 13, 16, 30, 33, 23),
    (30, 61, 62, 45, 59, 119),
    (116, 90, 156, 198, 373, 326),
)
# The P6 models' anchors for P3/8, P4/16, P5/32, P6/64 (fitted on COCO at 1280).
DEFAULT_ANCHORS_P6: tuple[tuple[float, ...], ...] = (
    (19, 27, 44, 40, 38, 94),
    (96, 68, 86, 152, 180, 137),
    (140, 301, 303, 264, 238, 542),
    (436, 615, 739, 380, 925, 792),
)
# Unscaled channels of the stem, then of each stride-2 stage; C3 repeats per stage (stride 4 on), by output level count.
BASE_WIDTHS = (64, 128, 256, 512, 1024)
BASE_DEPTHS = (3, 6, 9, 3)
BASE_WIDTHS_P6 = (64, 128, 256, 512, 768, 1024)
BASE_DEPTHS_P6 = (3, 6, 9, 3, 3)
SEG_NUM_MASKS = 32
SEG_BASE_PROTOS = 256
YAML_KEYS = ("depth_multiple", "width_multiple", "anchors", "nc", "num_masks", *LAYOUT_KEYS)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a model: scale, anchors (pixels), classes and mask sizes.

    `anchors` holds 3 levels (P3-P5) or, for the P6 models, 4 levels (P3-P6) of flat
    (w1, h1, w2, h2, ...) pixel pairs; the level count picks the network. Stored in checkpoints
    via `to_dict()` so a model can be rebuilt without the original `--cfg`.
    `num_masks > 0` (mask coefficients per detection) makes it a segmentation model with
    `num_protos` prototype channels; see `segmentation_spec`. `family` names the model family
    (utils/families.py) whose spec this is; checkpoints record it beside the spec.
    """

    family: ClassVar[str] = "yolov5"
    depth_multiple: float
    width_multiple: float
    anchors: tuple[tuple[float, ...], ...]
    num_classes: int
    num_masks: int = 0
    num_protos: int = 0

    def __post_init__(self) -> None:
        scale = (self.depth_multiple, self.width_multiple)
        if not all(math.isfinite(v) and v > 0 for v in scale):
            raise ValueError(f"depth_multiple and width_multiple must be finite and > 0, got {scale}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.num_masks < 0 or (self.num_masks > 0) != (self.num_protos > 0):
            masks = (self.num_masks, self.num_protos)
            raise ValueError(f"num_masks and num_protos must both be 0 or both be > 0, got {masks}")
        sizes = {len(level) for level in self.anchors}
        if len(self.anchors) not in (3, 4) or len(sizes) != 1 or sizes.pop() % 2 or not self.anchors[0]:
            raise ValueError(f"anchors must be 3 or 4 levels of equally many (w, h) pixel pairs, got {self.anchors}")
        if not all(math.isfinite(v) and v > 0 for level in self.anchors for v in level):
            raise ValueError(f"anchor sizes must be finite and > 0 pixels, got {self.anchors}")
        if self.num_masks and len(self.anchors) != 3:
            raise ValueError("segmentation models have 3 anchor levels; there are no P6 -seg models")

    @property
    def max_stride(self) -> int:
        """Pixels per grid cell of the coarsest level: 32 for P5 models, 64 for P6; image sizes are multiples of it."""
        return 2 ** (len(self.anchors) + 2)

    def to_dict(self) -> dict[str, Any]:
        """Return plain YAML/JSON-safe data (anchors as nested lists)."""
        out = asdict(self)
        out["anchors"] = [list(level) for level in self.anchors]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Rebuild a spec from `to_dict()` output; unknown keys raise ValueError."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"ModelSpec.from_dict: unknown key '{unknown[0]}'")
        values = dict(data)
        values["anchors"] = tuple(tuple(float(v) for v in level) for level in data["anchors"])
        return cls(**values)


def scale_depth(num_blocks: int, depth_multiple: float) -> int:
    """Number of bottlenecks in a C3 after depth scaling (at least 1 where the base has more)."""
    return max(round(num_blocks * depth_multiple), 1) if num_blocks > 1 else num_blocks


def scale_width(channels: int, width_multiple: float) -> int:
    """Channels after width scaling, rounded up to a multiple of 8 (friendly to tensor cores)."""
    return int(math.ceil(channels * width_multiple / 8) * 8)


def segmentation_spec(spec: ModelSpec, num_masks: int = SEG_NUM_MASKS, base_protos: int = SEG_BASE_PROTOS) -> ModelSpec:
    """Return `spec` with `num_masks` mask coefficients and `base_protos` (YOLOv5-seg: 256) width-scaled prototypes.

    A P6 spec is a one-line ConfigError: YOLOv5 publishes no P6 -seg model, and neither do we.
    """
    if len(spec.anchors) != 3:
        raise ConfigError("there are no P6 -seg models (yolov5n6-x6 detect); segment with yolov5n-seg .. yolov5x-seg")
    return replace(spec, num_masks=num_masks, num_protos=scale_width(base_protos, spec.width_multiple))


def parse_size_name(cfg: str) -> tuple[str, bool, bool] | None:
    """(scale 'n'..'x', is -seg, is P6) of a YOLOv5 size name ('yolov5s', 's6', 'yolov5s-seg.yaml'), else None.

    A trailing 6 ('yolov5s6', 's6') names the P6 model of that scale: four output levels up to stride 64.
    """
    path = Path(cfg)
    name = (path.stem if path.suffix in {".yaml", ".yml"} else cfg).lower()
    size = name.removesuffix("-seg").removeprefix("yolov5")
    is_p6 = len(size) == 2 and size.endswith("6")
    size = size.removesuffix("6") if is_p6 else size
    return (size, name.endswith("-seg"), is_p6) if size in SCALES else None


def claims_cfg(cfg: str) -> bool:
    """Whether `--cfg` is for this resolver: a YOLOv5 size name or an existing model YAML file of any other kind."""
    path = Path(cfg)
    return (path.suffix in {".yaml", ".yml"} and path.is_file()) or parse_size_name(cfg) is not None


def spec_from_cfg(cfg: str, num_classes: int) -> ModelSpec:
    """Resolve `--cfg` to a ModelSpec: a size name ('yolov5s', 's', 'yolov5s6', 'yolov5s-seg.yaml') or a YAML file.

    A YAML file sets `depth_multiple`, `width_multiple` (required), `anchors` (3 or 4 levels), `nc`
    and `num_masks` (> 0 for a segmentation model), or is a YOLOv5 model YAML whose `backbone`/`head`
    lists must be a standard yolov5n-x, -seg or P6 layout (models/yolov5_yaml.py); any other key or
    layout is a ConfigError (a ValueError) naming the file. `num_classes` (from the dataset) wins over
    the file's `nc`. '-seg' records 32 mask coefficients and 256 width-scaled prototypes; a P6 name
    ('yolov5s6') takes the four-level COCO anchors. There are no P6 -seg models (YOLOv5 publishes none).
    """
    path = Path(cfg)
    if path.suffix in {".yaml", ".yml"} and path.is_file():
        return _spec_from_yaml(path, num_classes)
    parsed = parse_size_name(cfg)
    if parsed is None:
        names = f"{CFG_NAMES}, optionally -seg; {CFG_NAMES_P6}"
        raise ConfigError(f"--cfg {cfg}: not a YAML file and not a model name ({names})")
    size, is_seg, is_p6 = parsed
    depth, width = SCALES[size]
    anchors = DEFAULT_ANCHORS_P6 if is_p6 else DEFAULT_ANCHORS
    spec = ModelSpec(depth_multiple=depth, width_multiple=width, anchors=anchors, num_classes=num_classes)
    return segmentation_spec(spec) if is_seg else spec


def _spec_from_yaml(path: Path, num_classes: int) -> ModelSpec:
    """Read a model YAML (safe_load); see spec_from_cfg for the accepted keys."""
    raw = read_yaml_mapping(path)
    unknown = [key for key in raw if key not in YAML_KEYS]
    if unknown:
        raise ConfigError(f"{path}: unknown key '{unknown[0]}' (allowed: {', '.join(YAML_KEYS)})")
    for key in ("depth_multiple", "width_multiple"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: '{key}' must be a number, got {value!r}")
    head = read_yolov5_layout(raw, path)
    num_masks, base_protos = (head.num_masks, head.base_protos) if head else (raw.get("num_masks", 0), SEG_BASE_PROTOS)
    if isinstance(num_masks, bool) or not isinstance(num_masks, int) or num_masks < 0:
        raise ConfigError(f"{path}: 'num_masks' must be an integer >= 0, got {num_masks!r}")
    if "nc" in raw and raw["nc"] != num_classes:
        LOGGER.info("%s: overriding nc=%s with the dataset's %d classes", path, raw["nc"], num_classes)
    default_anchors = DEFAULT_ANCHORS_P6 if head and head.num_levels == 4 else DEFAULT_ANCHORS
    anchors = _anchors_from_yaml(raw.get("anchors", default_anchors), default_anchors, path)
    if head and len(anchors) != head.num_levels:
        raise ConfigError(f"{path}: 'anchors' lists {len(anchors)} levels but the head has {head.num_levels}")
    try:
        spec = ModelSpec(float(raw["depth_multiple"]), float(raw["width_multiple"]), anchors, num_classes)
        return segmentation_spec(spec, num_masks, base_protos) if num_masks else spec
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from error


def _anchors_from_yaml(
    value: Any, default_anchors: tuple[tuple[float, ...], ...], path: Path
) -> tuple[tuple[float, ...], ...]:
    """Anchor pixel pairs from a model YAML's `anchors`: 3 or 4 lists of w, h pairs, or YOLOv5's count per level.

    YOLOv5 reads an integer as "this many anchors per level, fitted by AutoAnchor". We support 3
    (our heads' count): `default_anchors` (the COCO anchors of the YAML's layout, P5 or P6) are the
    start, and the training set-up's anchor check refits them to the dataset when fewer than 98% of
    its labels can be matched (models/anchors.py).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value != 3:
            raise ConfigError(f"{path}: 'anchors: {value}' per level is not supported; use 3 or list the anchors")
        LOGGER.info("%s: anchors: 3 -> the COCO anchors, refitted by AutoAnchor at the start if they fit poorly", path)
        return default_anchors
    try:
        return tuple(tuple(float(v) for v in level) for level in value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: 'anchors' must be 3 or 4 lists of w, h pixel pairs ({error})") from error


class Backbone(nn.Module):
    """CSP-Darknet backbone: 6x6 stride-2 stem, Conv+C3 stages, SPPF. Returns P3 ... P5 (or P6) features.

    `widths` are the stem's channels then each stage's (5 for P5 models, 6 for P6); `depths` the
    C3 repeats of each stage. Stages are named stage2 (stride 4) onwards; the last one ends in SPPF.
    """

    def __init__(self, widths: list[int], depths: list[int]) -> None:
        super().__init__()
        self.stem = Conv(3, widths[0], 6, 2, 2)  # P1/2
        self.num_stages = len(depths)
        for index, (in_channels, out_channels, depth) in enumerate(zip(widths[:-1], widths[1:], depths, strict=True)):
            blocks = [Conv(in_channels, out_channels, 3, 2), C3(out_channels, out_channels, depth)]
            if index == self.num_stages - 1:
                blocks.append(SPPF(out_channels, out_channels, 5))
            self.add_module(f"stage{index + 2}", nn.Sequential(*blocks))  # stage k has stride 2**k

    def stages(self) -> list[nn.Sequential]:
        """The stride-2 stages in order, stage2 (P2/4) first."""
        return [getattr(self, f"stage{k}") for k in range(2, self.num_stages + 2)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, 3, H, W) -> P3 (B, widths[2], H/8, W/8), P4 (H/16), P5 (H/32), and for P6 models P6 (H/64)."""
        features = []
        x = self.stem(x)
        for stage in self.stages():
            x = stage(x)
            features.append(x)
        return tuple(features[1:])


class PANNeck(nn.Module):
    """Path-aggregation neck: a top-down pass (FPN) then a bottom-up pass, one output per level.

    `level_widths` are the backbone's output channels from P3 up (3 levels, or 4 for P6). Modules
    are named by level k: lateral{k} (1x1 on the level-k path, before upsampling), top_down{k},
    down{k} (3x3 stride 2 from level k) and bottom_up{k}; level k's output has level_widths[k-3]
    channels.
    """

    def __init__(self, level_widths: list[int], depth: int) -> None:
        super().__init__()
        self.upsample = upsample2x()
        self.concat = Concat(1)
        self.first, self.last = 3, 3 + len(level_widths) - 1
        width = dict(enumerate(level_widths, start=3))
        for k in range(self.last, self.first, -1):  # top-down: lateral{k} then top_down{k-1}
            self.add_module(f"lateral{k}", Conv(width[k], width[k - 1], 1, 1))
            self.add_module(f"top_down{k - 1}", C3(2 * width[k - 1], width[k - 1], depth, shortcut=False))
        for k in range(self.first, self.last):  # bottom-up: down{k} then bottom_up{k+1}
            self.add_module(f"down{k}", Conv(width[k], width[k], 3, 2))
            self.add_module(f"bottom_up{k + 1}", C3(2 * width[k], width[k + 1], depth, shortcut=False))
        self.out_channels = tuple(level_widths)

    def forward(self, features: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Backbone (P3, ..., Pmax) -> neck outputs with `out_channels` channels at the same strides."""
        level = dict(enumerate(features, start=self.first))
        laterals: dict[int, torch.Tensor] = {}
        path = level[self.last]
        for k in range(self.last, self.first, -1):
            laterals[k] = getattr(self, f"lateral{k}")(path)
            path = getattr(self, f"top_down{k - 1}")(self.concat([self.upsample(laterals[k]), level[k - 1]]))
        outputs = [path]
        for k in range(self.first, self.last):
            path = getattr(self, f"bottom_up{k + 1}")(self.concat([getattr(self, f"down{k}")(path), laterals[k + 1]]))
            outputs.append(path)
        return outputs

    def layers(self) -> list[nn.Module]:
        """The neck in YOLOv5's layer order: per top-down step Conv, Upsample, Concat, C3; then Conv, Concat, C3."""
        top_down = [
            module
            for k in range(self.last, self.first, -1)
            for module in (getattr(self, f"lateral{k}"), self.upsample, self.concat, getattr(self, f"top_down{k - 1}"))
        ]
        bottom_up = [
            module
            for k in range(self.first, self.last)
            for module in (getattr(self, f"down{k}"), self.concat, getattr(self, f"bottom_up{k + 1}"))
        ]
        return [*top_down, *bottom_up]


class DetectionModel(nn.Module):
    """YOLOv5 detector: Backbone -> PANNeck -> DetectHead over P3/P4/P5 (strides 8/16/32), or P3-P6 (up to 64).

    The spec's anchor level count picks the network: 3 levels build yolov5n-x, 4 the P6 models.
    Input: (B, 3, H, W) float in [0, 1] with H and W multiples of the largest stride, 32 or 64
    (rectangular batches are fine). Output: see DetectHead (train: raw list; eval: (decoded
    (B, N, 5+nc) pixels, raw list)).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        is_p6 = len(spec.anchors) == 4
        widths = [scale_width(c, spec.width_multiple) for c in (BASE_WIDTHS_P6 if is_p6 else BASE_WIDTHS)]
        depths = [scale_depth(n, spec.depth_multiple) for n in (BASE_DEPTHS_P6 if is_p6 else BASE_DEPTHS)]
        self.backbone = Backbone(widths, depths)
        self.neck = PANNeck(widths[2:], depths[-1])
        strides = self._measure_strides()
        anchors_px = torch.tensor(spec.anchors, dtype=torch.float32).view(len(spec.anchors), -1, 2)
        self.head = self._make_head(order_anchors(anchors_px, strides), strides)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = 1e-3, 0.03  # YOLOv5 values: smoother running stats

    @torch.no_grad()
    def _measure_strides(self, probe_size: int = 64) -> torch.Tensor:
        """Run a zero image through backbone and neck (eval mode, BN stats untouched) and read the strides."""
        was_training = self.training
        self.eval()
        features = self.neck(self.backbone(torch.zeros(1, 3, probe_size, probe_size)))
        self.train(was_training)
        return torch.tensor([probe_size / f.shape[-1] for f in features], dtype=torch.float32)

    def _make_head(self, anchors_px: torch.Tensor, strides: torch.Tensor) -> DetectHead:
        """Build the head on the neck's outputs; anchors (levels, na, 2) pixels ordered by stride."""
        return DetectHead(self.spec.num_classes, anchors_px, strides, self.neck.out_channels)

    def forward(self, x: torch.Tensor) -> HeadOutput:
        """x: (B, 3, H, W) float in [0, 1]; H, W multiples of the largest stride (32, or 64 for P6)."""
        return self.head(self.neck(self.backbone(x)))

    @property
    def stride(self) -> torch.Tensor:
        """(levels,) float pixels per grid cell: [8, 16, 32], or [8, 16, 32, 64] for a P6 model."""
        return self.head.stride

    @property
    def anchors(self) -> torch.Tensor:
        """(levels, na, 2) anchors in grid units (the head's buffer, not a copy); 3 levels, or 4 for P6."""
        return self.head.anchors

    @property
    def num_classes(self) -> int:
        """Number of object classes the head predicts."""
        return self.head.num_classes

    @property
    def width_multiple(self) -> float:
        """Channel scale factor of this model size."""
        return self.spec.width_multiple

    @property
    def depth_multiple(self) -> float:
        """Depth scale factor of this model size."""
        return self.spec.depth_multiple

    def layers(self) -> list[nn.Module]:
        """Return the network as YOLOv5's numbered layer list: 0-9 backbone, 10-23 neck, 24 head (P6: 0-11, 12-32, 33).

        `--freeze 10` (P6: `--freeze 12`) therefore freezes the backbone, as users of YOLOv5 expect.
        Shared parameter-free modules (upsample, concat) appear at each index they hold there.
        """
        backbone = [self.backbone.stem, *(block for stage in self.backbone.stages() for block in stage)]
        return [*backbone, *self.neck.layers(), self.head]

    def fuse(self) -> DetectionModel:
        """Fold every BatchNorm into its conv for faster inference; returns self. Use only for eval."""
        fuse_convs(self)
        return self


class SegmentationModel(DetectionModel):
    """YOLOv5-seg: the detector with a SegmentHead (mask coefficients per box + prototype branch on P3).

    Output: see SegmentHead (train: (raw list, protos (B, nm, H/4, W/4)); eval: (decoded (B, N, 5+nc+nm),
    (raw list, protos))).
    """

    def _make_head(self, anchors_px: torch.Tensor, strides: torch.Tensor) -> SegmentHead:
        """Build the segmentation head; `spec.num_masks` and `spec.num_protos` size its mask outputs."""
        spec = self.spec
        return SegmentHead(
            spec.num_classes, anchors_px, strides, self.neck.out_channels, spec.num_masks, spec.num_protos
        )


def order_anchors(anchors_px: torch.Tensor, strides: torch.Tensor) -> torch.Tensor:
    """Return anchors (nl, na, 2) re-ordered so the smallest anchor set sits on the smallest stride.

    A YAML listing the levels largest-first would otherwise put big anchors on the fine grid.
    """
    by_area = anchors_px.prod(-1).mean(-1).argsort()
    by_stride = strides.argsort()
    ordered = torch.empty_like(anchors_px)
    ordered[by_stride] = anchors_px[by_area]
    if not torch.equal(ordered, anchors_px):
        LOGGER.info("Reordered anchor levels to match increasing stride")
    return ordered


def build_model(spec: ModelSpec) -> DetectionModel:
    """Build the model described by `spec` (CPU, train mode, biases initialised).

    A SegmentationModel when `spec.num_masks > 0`, otherwise a DetectionModel.
    """
    return SegmentationModel(spec) if spec.num_masks > 0 else DetectionModel(spec)
