"""YOLOv5 (v6+) detection and -seg models in plain Python: scale table, ModelSpec, backbone, PAN neck, build_model()."""

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
CFG_NAMES = "yolov5n|s|m|l|x"  # the size names spec_from_cfg accepts (each optionally -seg), as errors list them
# Anchor w, h pairs in pixels for P3/8, P4/16, P5/32 (fitted on COCO at 640).
DEFAULT_ANCHORS: tuple[tuple[float, ...], ...] = (
    (10, 13, 16, 30, 33, 23),
    (30, 61, 62, 45, 59, 119),
    (116, 90, 156, 198, 373, 326),
)
BASE_WIDTHS = (64, 128, 256, 512, 1024)
BASE_DEPTHS = (3, 6, 9, 3)
SEG_NUM_MASKS = 32
SEG_BASE_PROTOS = 256
YAML_KEYS = ("depth_multiple", "width_multiple", "anchors", "nc", "num_masks", *LAYOUT_KEYS)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a model: scale, anchors (pixels), classes and mask sizes.

    `anchors` holds 3 levels (P3, P4, P5) of flat (w1, h1, w2, h2, ...) pixel pairs. Stored in
    checkpoints via `to_dict()` so a model can be rebuilt without the original `--cfg`.
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
        if len(self.anchors) != 3 or len(sizes) != 1 or sizes.pop() % 2 or not self.anchors[0]:
            raise ValueError(f"anchors must be 3 levels of equally many (w, h) pixel pairs, got {self.anchors}")
        if not all(math.isfinite(v) and v > 0 for level in self.anchors for v in level):
            raise ValueError(f"anchor sizes must be finite and > 0 pixels, got {self.anchors}")

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
    """Return `spec` with `num_masks` mask coefficients and `base_protos` (YOLOv5-seg: 256) width-scaled prototypes."""
    return replace(spec, num_masks=num_masks, num_protos=scale_width(base_protos, spec.width_multiple))


def parse_size_name(cfg: str) -> tuple[str, bool] | None:
    """(scale 'n'..'x', is -seg) of a YOLOv5 size name ('yolov5s', 's', 'yolov5s-seg', 'yolov5s.yaml'), else None."""
    path = Path(cfg)
    name = (path.stem if path.suffix in {".yaml", ".yml"} else cfg).lower()
    size = name.removesuffix("-seg").removeprefix("yolov5")
    return (size, name.endswith("-seg")) if size in SCALES else None


def claims_cfg(cfg: str) -> bool:
    """Whether `--cfg` is for this resolver: a YOLOv5 size name or an existing model YAML file of any other kind."""
    path = Path(cfg)
    return (path.suffix in {".yaml", ".yml"} and path.is_file()) or parse_size_name(cfg) is not None


def spec_from_cfg(cfg: str, num_classes: int) -> ModelSpec:
    """Resolve `--cfg` to a ModelSpec: a size name ('yolov5s', 's', 'yolov5s-seg', 'yolov5s.yaml') or a YAML file.

    A YAML file sets `depth_multiple`, `width_multiple` (required), `anchors`, `nc` and `num_masks`
    (> 0 for a segmentation model), or is a YOLOv5 model YAML whose `backbone`/`head` lists must be
    the standard yolov5n-x or -seg P5 layout (models/yolov5_yaml.py); any other key or layout is a
    ConfigError (a ValueError) naming the file. `num_classes` (from the dataset) wins over the file's
    `nc`. '-seg' records 32 mask coefficients and 256 width-scaled prototypes.
    """
    path = Path(cfg)
    if path.suffix in {".yaml", ".yml"} and path.is_file():
        return _spec_from_yaml(path, num_classes)
    parsed = parse_size_name(cfg)
    if parsed is None:
        raise ConfigError(f"--cfg {cfg}: not a YAML file and not a model name ({CFG_NAMES}, optionally -seg)")
    size, is_seg = parsed
    depth, width = SCALES[size]
    spec = ModelSpec(depth_multiple=depth, width_multiple=width, anchors=DEFAULT_ANCHORS, num_classes=num_classes)
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
    anchors = _anchors_from_yaml(raw.get("anchors", DEFAULT_ANCHORS), path)
    try:
        spec = ModelSpec(float(raw["depth_multiple"]), float(raw["width_multiple"]), anchors, num_classes)
        return segmentation_spec(spec, num_masks, base_protos) if num_masks else spec
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from error


def _anchors_from_yaml(value: Any, path: Path) -> tuple[tuple[float, ...], ...]:
    """Anchor pixel pairs from a model YAML's `anchors`: 3 lists of w, h pairs, or YOLOv5's count per level.

    YOLOv5 reads an integer as "this many anchors per level, fitted by AutoAnchor". We support 3
    (our heads' count): the COCO anchors are the start, and the training set-up's anchor check refits
    them to the dataset when fewer than 98% of its labels can be matched (models/anchors.py).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value != 3:
            raise ConfigError(f"{path}: 'anchors: {value}' per level is not supported; use 3 or list the anchors")
        LOGGER.info("%s: anchors: 3 -> the COCO anchors, refitted by AutoAnchor at the start if they fit poorly", path)
        return DEFAULT_ANCHORS
    try:
        return tuple(tuple(float(v) for v in level) for level in value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: 'anchors' must be 3 lists of w, h pixel pairs ({error})") from error


class Backbone(nn.Module):
    """CSP-Darknet backbone: 6x6 stride-2 stem, four Conv+C3 stages, SPPF. Returns P3, P4, P5 features."""

    def __init__(self, widths: list[int], depths: list[int]) -> None:
        super().__init__()
        w64, w128, w256, w512, w1024 = widths
        self.stem = Conv(3, w64, 6, 2, 2)  # P1/2
        self.stage2 = nn.Sequential(Conv(w64, w128, 3, 2), C3(w128, w128, depths[0]))  # P2/4
        self.stage3 = nn.Sequential(Conv(w128, w256, 3, 2), C3(w256, w256, depths[1]))  # P3/8
        self.stage4 = nn.Sequential(Conv(w256, w512, 3, 2), C3(w512, w512, depths[2]))  # P4/16
        self.stage5 = nn.Sequential(Conv(w512, w1024, 3, 2), C3(w1024, w1024, depths[3]), SPPF(w1024, w1024, 5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) -> P3 (B, w256, H/8, W/8), P4 (B, w512, H/16, W/16), P5 (B, w1024, H/32, W/32)."""
        p3 = self.stage3(self.stage2(self.stem(x)))
        p4 = self.stage4(p3)
        return p3, p4, self.stage5(p4)


class PANNeck(nn.Module):
    """Path-aggregation neck: a top-down pass (FPN) then a bottom-up pass, one output per level."""

    def __init__(self, widths: list[int], depth: int) -> None:
        super().__init__()
        _, _, w256, w512, w1024 = widths
        self.upsample = upsample2x()
        self.concat = Concat(1)
        self.lateral5 = Conv(w1024, w512, 1, 1)
        self.top_down4 = C3(2 * w512, w512, depth, shortcut=False)
        self.lateral4 = Conv(w512, w256, 1, 1)
        self.top_down3 = C3(2 * w256, w256, depth, shortcut=False)
        self.down3 = Conv(w256, w256, 3, 2)
        self.bottom_up4 = C3(2 * w256, w512, depth, shortcut=False)
        self.down4 = Conv(w512, w512, 3, 2)
        self.bottom_up5 = C3(2 * w512, w1024, depth, shortcut=False)
        self.out_channels = (w256, w512, w1024)

    def forward(self, features: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        """Backbone (P3, P4, P5) -> neck outputs with `out_channels` channels at the same strides."""
        p3, p4, p5 = features
        lateral5 = self.lateral5(p5)
        lateral4 = self.lateral4(self.top_down4(self.concat([self.upsample(lateral5), p4])))
        out3 = self.top_down3(self.concat([self.upsample(lateral4), p3]))
        out4 = self.bottom_up4(self.concat([self.down3(out3), lateral4]))
        out5 = self.bottom_up5(self.concat([self.down4(out4), lateral5]))
        return [out3, out4, out5]


class DetectionModel(nn.Module):
    """YOLOv5 detector: Backbone -> PANNeck -> DetectHead over P3/P4/P5 (strides 8/16/32).

    Input: (B, 3, H, W) float in [0, 1] with H and W multiples of 32 (rectangular batches are fine).
    Output: see DetectHead (train: raw list; eval: (decoded (B, N, 5+nc) pixels, raw list)).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        widths = [scale_width(c, spec.width_multiple) for c in BASE_WIDTHS]
        depths = [scale_depth(n, spec.depth_multiple) for n in BASE_DEPTHS]
        self.backbone = Backbone(widths, depths)
        self.neck = PANNeck(widths, depths[-1])
        strides = self._measure_strides()
        anchors_px = order_anchors(torch.tensor(spec.anchors, dtype=torch.float32).view(3, -1, 2), strides)
        self.head = self._make_head(anchors_px, strides)
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
        """Build the head on the neck's outputs; anchors (3, na, 2) pixels ordered by stride."""
        return DetectHead(self.spec.num_classes, anchors_px, strides, self.neck.out_channels)

    def forward(self, x: torch.Tensor) -> HeadOutput:
        """x: (B, 3, H, W) float in [0, 1]; H, W multiples of 32."""
        return self.head(self.neck(self.backbone(x)))

    @property
    def stride(self) -> torch.Tensor:
        """(3,) float pixels per grid cell of P3, P4, P5: [8, 16, 32]."""
        return self.head.stride

    @property
    def anchors(self) -> torch.Tensor:
        """(3, na, 2) anchors in grid units (the head's buffer, not a copy)."""
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
        """Return the network as YOLOv5's numbered layer list (0-9 backbone, 10-23 neck, 24 head).

        `--freeze 10` therefore freezes the backbone, as users of YOLOv5 expect. Shared
        parameter-free modules (upsample, concat) appear at each index they hold there.
        """
        b, n = self.backbone, self.neck
        backbone = [b.stem, *b.stage2, *b.stage3, *b.stage4, *b.stage5]
        neck = [
            n.lateral5,
            n.upsample,
            n.concat,
            n.top_down4,
            n.lateral4,
            n.upsample,
            n.concat,
            n.top_down3,
            n.down3,
            n.concat,
            n.bottom_up4,
            n.down4,
            n.concat,
            n.bottom_up5,
        ]
        return [*backbone, *neck, self.head]

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
