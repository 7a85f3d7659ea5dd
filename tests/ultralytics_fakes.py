"""Stand-ins for Ultralytics' YOLOv8 / YOLO11 / YOLO26 module classes, to write their checkpoints without a download.

Written from the documented architecture (block semantics, sub-module and attribute names, the layer
tables of the published model YAMLs), not from their code. While `ultralytics_pickle_paths()` is active
the classes pickle as `ultralytics.nn.modules.conv.Conv`, `ultralytics.nn.tasks.DetectionModel`, ... so a
file saved with `save_ultralytics_checkpoint` has the layout of a released `yolo11n.pt`: a dict of
metadata around whole module objects in fp16. Every class has a forward, so a converted model can be
compared with the original network's raw outputs. `LAYER_ROWS` is the layer table of each layout; the
tests also write their YAML text from it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import yolov5_fakes
from tests.yolov5_fakes import Concat, pickle_paths, randomise  # noqa: F401 - randomise is shared with these fakes

# [from, repeats, module, args] per layout, before scaling; the head row's args follow with nc first.
_V8_BACKBONE = [
    [-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 3, "C2f", [128, True]],
    [-1, 1, "Conv", [256, 3, 2]], [-1, 6, "C2f", [256, True]], [-1, 1, "Conv", [512, 3, 2]],
    [-1, 6, "C2f", [512, True]], [-1, 1, "Conv", [1024, 3, 2]], [-1, 3, "C2f", [1024, True]],
    [-1, 1, "SPPF", [1024, 5]],
]  # fmt: skip
_V8_NECK = [
    [-1, 1, "nn.Upsample", ["None", 2, "nearest"]], [[-1, 6], 1, "Concat", [1]], [-1, 3, "C2f", [512]],
    [-1, 1, "nn.Upsample", ["None", 2, "nearest"]], [[-1, 4], 1, "Concat", [1]], [-1, 3, "C2f", [256]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 12], 1, "Concat", [1]], [-1, 3, "C2f", [512]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 9], 1, "Concat", [1]], [-1, 3, "C2f", [1024]],
]  # fmt: skip
_V11_BACKBONE = [
    [-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 2, "C3k2", [256, False, 0.25]],
    [-1, 1, "Conv", [256, 3, 2]], [-1, 2, "C3k2", [512, False, 0.25]], [-1, 1, "Conv", [512, 3, 2]],
    [-1, 2, "C3k2", [512, True]], [-1, 1, "Conv", [1024, 3, 2]], [-1, 2, "C3k2", [1024, True]],
    [-1, 1, "SPPF", [1024, 5]], [-1, 2, "C2PSA", [1024]],
]  # fmt: skip


def _v11_neck(flag: bool, last: list[Any]) -> list[list[Any]]:
    return [
        [-1, 1, "nn.Upsample", ["None", 2, "nearest"]], [[-1, 6], 1, "Concat", [1]], [-1, 2, "C3k2", [512, flag]],
        [-1, 1, "nn.Upsample", ["None", 2, "nearest"]], [[-1, 4], 1, "Concat", [1]], [-1, 2, "C3k2", [256, flag]],
        [-1, 1, "Conv", [256, 3, 2]], [[-1, 13], 1, "Concat", [1]], [-1, 2, "C3k2", [512, flag]],
        [-1, 1, "Conv", [512, 3, 2]], [[-1, 10], 1, "Concat", [1]], last,
    ]  # fmt: skip


_V26_BACKBONE = [*_V11_BACKBONE[:9], [-1, 1, "SPPF", [1024, 5, 3, True]], _V11_BACKBONE[10]]
LAYER_ROWS: dict[str, tuple[list[list[Any]], list[list[Any]]]] = {
    "yolov8": (_V8_BACKBONE, _V8_NECK),
    "yolo11": (_V11_BACKBONE, _v11_neck(False, [-1, 2, "C3k2", [1024, True]])),
    "yolo26": (_V26_BACKBONE, _v11_neck(True, [-1, 1, "C3k2", [1024, True, 0.5, True]])),
}
HEAD_FROM = {"yolov8": [15, 18, 21], "yolo11": [16, 19, 22], "yolo26": [16, 19, 22]}
SCALE_ROWS = {
    "yolov8": {"n": [0.33, 0.25, 1024], "s": [0.33, 0.50, 1024]},
    "yolo11": {"n": [0.50, 0.25, 1024], "s": [0.50, 0.50, 1024]},
    "yolo26": {"n": [0.50, 0.25, 1024], "s": [0.50, 0.50, 1024]},
}
TINY = (0.33, 0.125, 1024)  # a custom scale row: 8-128 channels, fast enough for unit tests


def head_row(layout: str, seg: bool) -> list[Any]:
    """The last YAML row: Detect on P3-P5, or Segment (Segment26 for YOLO26) with 32 masks and 256 base protos."""
    module = ("Segment26" if layout == "yolo26" else "Segment") if seg else "Detect"
    return [HEAD_FROM[layout], 1, module, ["nc", 32, 256] if seg else ["nc"]]


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class DWConv(Conv):
    def __init__(self, c1: int, c2: int, k: int = 1) -> None:
        super().__init__(c1, c2, k, g=math.gcd(c1, c2))


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True, k: tuple[int, int] = (3, 3), e: float = 0.5) -> None:
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, k[0])
        self.cv2 = Conv(hidden, c2, k[1])
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, e: float = 0.5) -> None:
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, e=1.0) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.cv1(x).chunk(2, 1))
        for block in self.m:
            parts.append(block(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class C3k(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 2, shortcut: bool = True, k: int = 3) -> None:
        super().__init__()
        hidden = c2 // 2
        self.cv1 = Conv(c1, hidden, 1)
        self.cv2 = Conv(c1, hidden, 1)
        self.cv3 = Conv(2 * hidden, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, (k, k), 1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, attn_ratio: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.scale = self.key_dim**-0.5
        self.qkv = Conv(dim, dim + 2 * self.key_dim * num_heads, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, g=dim, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(x).view(b, self.num_heads, 2 * self.key_dim + self.head_dim, h * w)
        q, k, v = qkv.split((self.key_dim, self.key_dim, self.head_dim), dim=2)
        attn = ((q.transpose(-2, -1) @ k) * self.scale).softmax(dim=-1)
        y = (v @ attn.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return self.proj(y)


class PSABlock(nn.Module):
    def __init__(self, c: int, num_heads: int, shortcut: bool = True) -> None:
        super().__init__()
        self.attn = Attention(c, num_heads)
        self.ffn = nn.Sequential(Conv(c, 2 * c, 1), Conv(2 * c, c, 1, act=False))
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C3k2(C2f):
    def __init__(
        self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, attn: bool = False, shortcut: bool = True
    ) -> None:
        super().__init__(c1, c2, n, shortcut, e)
        c = self.c
        if attn:
            links = [nn.Sequential(Bottleneck(c, c, shortcut), PSABlock(c, max(c // 64, 1))) for _ in range(n)]
        elif c3k:
            links = [C3k(c, c, 2, shortcut) for _ in range(n)]
        else:
            links = [Bottleneck(c, c, shortcut) for _ in range(n)]
        self.m = nn.ModuleList(links)


class C2PSA(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5) -> None:
        super().__init__()
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        self.m = nn.Sequential(*(PSABlock(self.c, max(self.c // 64, 1)) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).split((self.c, self.c), dim=1)
        return self.cv2(torch.cat((a, self.m(b)), 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5, n: int = 3, shortcut: bool = False, act: bool = True) -> None:
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, act=act)
        self.cv2 = Conv(hidden * (n + 1), c2, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.n = n
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps = [self.cv1(x)]
        for _ in range(self.n):
            maps.append(self.m(maps[-1]))
        y = self.cv2(torch.cat(maps, 1))
        return x + y if self.add else y


class DFL(nn.Module):
    def __init__(self, c1: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        self.conv.weight.data[:] = torch.arange(c1, dtype=torch.float32).view(1, c1, 1, 1)
        self.c1 = c1


class Proto(nn.Module):
    def __init__(self, c1: int, c_: int = 256, c2: int = 32) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c_, 3)
        self.upsample = nn.ConvTranspose2d(c_, c_, 2, 2, 0, bias=True)
        self.cv2 = Conv(c_, c_, 3)
        self.cv3 = Conv(c_, c2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(self.cv2(self.upsample(self.cv1(x))))


class Proto26(Proto):
    def __init__(self, ch: tuple[int, ...], c_: int, c2: int, nc: int) -> None:
        super().__init__(c_, c_, c2)
        self.feat_refine = nn.ModuleList(Conv(x, ch[0], 1) for x in ch[1:])
        self.feat_fuse = Conv(ch[0], c_, 3)
        self.semseg = nn.Sequential(Conv(ch[0], c_, 3), Conv(c_, c_, 3), nn.Conv2d(c_, nc, 1))

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:  # eval only: the semantic branch is training-only
        feat = x[0]
        for refine, level in zip(self.feat_refine, x[1:], strict=True):
            feat = feat + F.interpolate(refine(level), size=feat.shape[2:], mode="nearest")
        return super().forward(self.feat_fuse(feat))


class Detect(nn.Module):
    def __init__(self, nc: int, reg_max: int, end2end: bool, ch: tuple[int, ...], legacy: bool) -> None:
        super().__init__()
        self.nc, self.nl, self.reg_max = nc, len(ch), reg_max
        self.no = nc + 4 * reg_max
        self.stride = torch.zeros(self.nl)
        c2, c3 = max(16, ch[0] // 4, 4 * reg_max), max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch
        )
        if legacy:
            cls = [nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3)) for x in ch]
        else:
            cls = [
                nn.Sequential(
                    nn.Sequential(DWConv(x, x, 3), Conv(x, c3, 1)),
                    nn.Sequential(DWConv(c3, c3, 3), Conv(c3, c3, 1)),
                )
                for x in ch
            ]
        self.cv3 = nn.ModuleList(nn.Sequential(*branch, nn.Conv2d(c3, nc, 1)) for branch in cls)
        self.dfl = DFL(reg_max) if reg_max > 1 else nn.Identity()
        if end2end:
            self.one2one_cv2 = copy.deepcopy(self.cv2)
            self.one2one_cv3 = copy.deepcopy(self.cv3)
        self.anchors, self.strides = torch.empty(0), torch.empty(0)

    def branches(self, one2one: bool) -> list[nn.ModuleList]:
        prefix = "one2one_" if one2one else ""
        names = ("cv2", "cv3", "cv4") if hasattr(self, "cv4") else ("cv2", "cv3")
        return [getattr(self, prefix + name) for name in names]

    def forward(self, x: list[torch.Tensor]) -> Any:
        """Raw per-level outputs (boxes, classes[, masks] concatenated); {'one2many', 'one2one'} when end-to-end."""
        raw = {}
        for one2one in (False, True) if hasattr(self, "one2one_cv2") else (False,):
            modules = self.branches(one2one)
            raw[one2one] = [torch.cat([m[i](x[i]) for m in modules], 1) for i in range(self.nl)]
        return {"one2many": raw[False], "one2one": raw[True]} if True in raw else raw[False]


class Segment(Detect):
    def __init__(self, nc: int, nm: int, npr: int, reg_max: int, end2end: bool, ch: tuple[int, ...], **kw: Any) -> None:
        super().__init__(nc, reg_max, end2end, ch, **kw)
        self.nm, self.npr = nm, npr
        self.proto = self.make_proto(ch, npr, nm, nc)
        hidden = max(ch[0] // 4, nm)
        self.cv4 = nn.ModuleList(
            nn.Sequential(Conv(x, hidden, 3), Conv(hidden, hidden, 3), nn.Conv2d(hidden, nm, 1)) for x in ch
        )
        if end2end:
            self.one2one_cv4 = copy.deepcopy(self.cv4)

    def make_proto(self, ch: tuple[int, ...], npr: int, nm: int, nc: int) -> nn.Module:
        return Proto(ch[0], npr, nm)

    def forward(self, x: list[torch.Tensor]) -> tuple[Any, torch.Tensor]:
        protos = self.proto(x[0]) if type(self.proto) is Proto else self.proto(x)
        return super().forward(x), protos


class Segment26(Segment):
    def make_proto(self, ch: tuple[int, ...], npr: int, nm: int, nc: int) -> nn.Module:
        return Proto26(ch, npr, nm, nc)


class IterableSimpleNamespace(types.SimpleNamespace):
    """What a pre-strip last.pt keeps in `model.args` (strip_optimizer turns it into a dict)."""


class DetectionModel(nn.Module):
    """The network a published model YAML describes, built row by row from LAYER_ROWS and one scale row.

    Scaling as the YAMLs' `scales` rows mean it: repeats max(round(n x depth), 1) when n > 1, channels
    min(c, max_channels) x width rounded up to a multiple of 8, every C3k2 link a C3k at scales m, l, x.
    """

    def __init__(self, layout: str, nc: int, row: tuple[float, float, int] = TINY, scale: str = "t") -> None:
        super().__init__()
        is_seg = type(self) is SegmentationModel
        backbone, neck = LAYER_ROWS[layout]
        rows = [*backbone, *neck, head_row(layout, is_seg)]
        self.layout, self.row, self.scale, self.nc = layout, row, scale, nc
        channels: list[int] = []
        layers = []
        for index, (source, repeats, name, args) in enumerate(rows):
            module, out = self._build(name, list(args), source, repeats, channels)
            module.f, module.i, module.type = source, index, name
            module.np = sum(p.numel() for p in module.parameters())
            channels.append(out)
            layers.append(module)
        self.model = nn.Sequential(*layers)
        self.yaml = {"nc": nc, "scales": {scale: list(row)}, "backbone": backbone, "head": [*neck, rows[-1]]}
        self.yaml.update(scale=scale, yaml_file=f"{layout}{scale}{'-seg' if is_seg else ''}.yaml", channels=3)
        if layout == "yolo26":
            self.yaml.update(end2end=True, reg_max=1)
        self.names = {index: f"class{index}" for index in range(nc)}
        self.stride = torch.tensor([8.0, 16.0, 32.0])
        self.model[-1].stride = self.stride.clone()
        self.inplace, self.save = True, []
        self.args = {"task": "segment" if is_seg else "detect", "imgsz": 640}
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = 1e-3, 0.03

    def _build(
        self, name: str, args: list[Any], source: Any, repeats: int, channels: list[int]
    ) -> tuple[nn.Module, int]:
        depth, width, max_channels = self.row
        is_26 = self.layout == "yolo26"

        def scaled(c: int) -> int:
            return math.ceil(min(c, max_channels) * width / 8) * 8

        c_in = channels[source] if channels and isinstance(source, int) else 3
        if name == "nn.Upsample":
            return nn.Upsample(None, 2, "nearest"), c_in
        if name == "Concat":
            return Concat(1), sum(channels[i] for i in source)
        if name in ("Detect", "Segment", "Segment26"):
            ch = tuple(channels[i] for i in source)
            options = dict(reg_max=1 if is_26 else 16, end2end=is_26, ch=ch, legacy=self.layout == "yolov8")
            if name == "Detect":
                return Detect(self.nc, **options), 0
            return globals()[name](self.nc, args[1], scaled(args[2]), **options), 0
        c_out = scaled(args[0])
        n = max(round(repeats * depth), 1) if repeats > 1 else repeats
        if name == "Conv":
            return Conv(c_in, c_out, *args[1:]), c_out
        if name == "SPPF":
            return SPPF(c_in, c_out, *args[1:], act=len(args) <= 2), c_out
        if name == "C2PSA":
            return C2PSA(c_in, c_out, n), c_out
        if name == "C2f":
            return C2f(c_in, c_out, n, *args[1:]), c_out
        flags = list(args[1:])
        if self.scale in ("m", "l", "x"):
            flags[0] = True  # at these scales every C3k2 link is a C3k
        return C3k2(c_in, c_out, n, *flags), c_out

    forward = yolov5_fakes.DetectionModel.forward  # the same walk over `f` (from) indices: the head's raw outputs


class SegmentationModel(DetectionModel):
    pass


CLASSES = {
    "ultralytics.nn.modules.conv": (Conv, DWConv, Concat),
    "ultralytics.nn.modules.block": (Bottleneck, C2f, C3k, C3k2, Attention, PSABlock, C2PSA, SPPF, DFL, Proto, Proto26),
    "ultralytics.nn.modules.head": (Detect, Segment, Segment26),
    "ultralytics.nn.tasks": (DetectionModel, SegmentationModel),
    "ultralytics.utils": (IterableSimpleNamespace,),
}


def ultralytics_pickle_paths() -> contextlib.AbstractContextManager[None]:
    """Make the fakes pickle under Ultralytics' module paths (`ultralytics.nn.modules.block.C3k2`, ...)."""
    return pickle_paths(CLASSES)


def save_ultralytics_checkpoint(model: nn.Module, path: str, released: bool = True) -> None:
    """Save `model` as Ultralytics writes it: fp16 module objects in `model` (released, stripped) or in `ema`
    (a last.pt before stripping, whose `args` is still their namespace object), plus plain metadata."""
    half = copy.deepcopy(model).half()
    if not released:
        half.args = IterableSimpleNamespace(**half.args)
    checkpoint = {
        "date": "2026-01-01T00:00:00+00:00",
        "version": "8.4.190",
        "epoch": -1 if released else 4,
        "best_fitness": None,
        "model": half if released else None,
        "ema": None if released else half,
        "updates": None if released else 50,
        "optimizer": None,
        "train_args": {"task": model.args["task"], "epochs": 5, "imgsz": 640},
        "train_metrics": {"fitness": 0.0},
        "git": {"branch": None},
    }
    with ultralytics_pickle_paths():
        torch.save(checkpoint, path)
