"""Stand-ins for YOLOv5's own module classes, to write checkpoints in YOLOv5's pickle layout without a download.

The classes are written from YOLOv5's documented architecture (v6+ P5 layout, models/common.py and
models/yolo.py attribute names) and pickle under YOLOv5's module paths (`models.common.C3`,
`models.yolo.DetectionModel`, ...) while `yolov5_pickle_paths()` is active, so a file saved with
them is what `torch.save(ckpt)` in YOLOv5's train.py produces: whole module objects, fp16.
Each has a forward, so converted weights can be checked against the original network's outputs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]

ANCHORS = ((10, 13, 16, 30, 33, 23), (30, 61, 62, 45, 59, 119), (116, 90, 156, 198, 373, 326))
ANCHORS_P6 = ((19, 27, 44, 40, 38, 94), (96, 68, 86, 152, 180, 137), (140, 301, 303, 264, 238, 542))
ANCHORS_P6 += ((436, 615, 739, 380, 925, 792),)


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2 if p is None else p, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5) -> None:
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(hidden, c2, 3, 1)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C3(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, e: float = 0.5) -> None:
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(c1, hidden, 1, 1)
        self.cv3 = Conv(2 * hidden, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(hidden * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Concat(nn.Module):
    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)


class Proto(nn.Module):
    def __init__(self, c1: int, c_: int = 256, c2: int = 32) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c_, k=3)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.cv2 = Conv(c_, c_, k=3)
        self.cv3 = Conv(c_, c2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(self.cv2(self.upsample(self.cv1(x))))


class Detect(nn.Module):
    def __init__(self, nc: int, anchors: tuple, ch: tuple[int, ...]) -> None:
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.grid = [torch.empty(0) for _ in range(self.nl)]
        self.anchor_grid = [torch.empty(0) for _ in range(self.nl)]
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)
        self.inplace = True

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for i in range(self.nl):
            y = self.m[i](x[i])
            batch, _, height, width = y.shape
            out.append(y.view(batch, self.na, self.no, height, width).permute(0, 1, 3, 4, 2).contiguous())
        return out


class Segment(Detect):
    def __init__(self, nc: int, anchors: tuple, nm: int, npr: int, ch: tuple[int, ...]) -> None:
        super().__init__(nc, anchors, ch)
        self.nm = nm
        self.npr = npr
        self.no = 5 + nc + nm
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)
        self.proto = Proto(ch[0], npr, nm)

    def forward(self, x: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        protos = self.proto(x[0])
        return super().forward(x), protos


def _p6_layers(ch: Callable[[int], int], n: Callable[[int], int]) -> list[tuple[Any, nn.Module]]:
    """(from, module) of yolov5{n..x}6.yaml's layers 0-32: the P6 layout before its head."""
    c64, c128, c256, c512, c768, c1024 = (ch(c) for c in (64, 128, 256, 512, 768, 1024))
    up = (-1, nn.Upsample(None, 2, "nearest"))
    return [
        (-1, Conv(3, c64, 6, 2, 2)), (-1, Conv(c64, c128, 3, 2)), (-1, C3(c128, c128, n(3))),
        (-1, Conv(c128, c256, 3, 2)), (-1, C3(c256, c256, n(6))), (-1, Conv(c256, c512, 3, 2)),
        (-1, C3(c512, c512, n(9))), (-1, Conv(c512, c768, 3, 2)), (-1, C3(c768, c768, n(3))),
        (-1, Conv(c768, c1024, 3, 2)), (-1, C3(c1024, c1024, n(3))), (-1, SPPF(c1024, c1024, 5)),
        (-1, Conv(c1024, c768, 1, 1)), up, ([-1, 8], Concat(1)), (-1, C3(2 * c768, c768, n(3), False)),
        (-1, Conv(c768, c512, 1, 1)), (-1, nn.Upsample(None, 2, "nearest")), ([-1, 6], Concat(1)),
        (-1, C3(2 * c512, c512, n(3), False)), (-1, Conv(c512, c256, 1, 1)), (-1, nn.Upsample(None, 2, "nearest")),
        ([-1, 4], Concat(1)), (-1, C3(2 * c256, c256, n(3), False)),
        (-1, Conv(c256, c256, 3, 2)), ([-1, 20], Concat(1)), (-1, C3(2 * c256, c512, n(3), False)),
        (-1, Conv(c512, c512, 3, 2)), ([-1, 16], Concat(1)), (-1, C3(2 * c512, c768, n(3), False)),
        (-1, Conv(c768, c768, 3, 2)), ([-1, 12], Concat(1)), (-1, C3(2 * c768, c1024, n(3), False)),
    ]  # fmt: skip


class DetectionModel(nn.Module):
    """The standard P5 layout (or with `p6` the P6 one), built as YOLOv5's parse_model builds it from its YAML."""

    def __init__(
        self, depth: float, width: float, nc: int, anchors: tuple = ANCHORS, seg: bool = False, p6: bool = False
    ) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return math.ceil(c * width / 8) * 8

        def n(count: int) -> int:
            return max(round(count * depth), 1) if count > 1 else count

        c64, c128, c256, c512, c1024 = (ch(c) for c in (64, 128, 256, 512, 1024))
        layers = [
            (-1, Conv(3, c64, 6, 2, 2)), (-1, Conv(c64, c128, 3, 2)), (-1, C3(c128, c128, n(3))),
            (-1, Conv(c128, c256, 3, 2)), (-1, C3(c256, c256, n(6))), (-1, Conv(c256, c512, 3, 2)),
            (-1, C3(c512, c512, n(9))), (-1, Conv(c512, c1024, 3, 2)), (-1, C3(c1024, c1024, n(3))),
            (-1, SPPF(c1024, c1024, 5)), (-1, Conv(c1024, c512, 1, 1)), (-1, nn.Upsample(None, 2, "nearest")),
            ([-1, 6], Concat(1)), (-1, C3(2 * c512, c512, n(3), False)), (-1, Conv(c512, c256, 1, 1)),
            (-1, nn.Upsample(None, 2, "nearest")), ([-1, 4], Concat(1)), (-1, C3(2 * c256, c256, n(3), False)),
            (-1, Conv(c256, c256, 3, 2)), ([-1, 14], Concat(1)), (-1, C3(2 * c256, c512, n(3), False)),
            (-1, Conv(c512, c512, 3, 2)), ([-1, 10], Concat(1)), (-1, C3(2 * c512, c1024, n(3), False)),
        ]  # fmt: skip
        outputs, head_from = (c256, c512, c1024), [17, 20, 23]
        if p6:
            layers, outputs, head_from = _p6_layers(ch, n), (c256, c512, ch(768), c1024), [23, 26, 29, 32]
        head = Segment(nc, anchors, 32, ch(256), outputs) if seg else Detect(nc, anchors, outputs)
        layers.append((head_from, head))
        for index, (source, module) in enumerate(layers):
            module.f, module.i = source, index
        self.model = nn.Sequential(*(module for _, module in layers))
        self.yaml = {"nc": nc, "depth_multiple": depth, "width_multiple": width, "anchors": [list(a) for a in anchors]}
        self.names = {index: f"class{index}" for index in range(nc)}
        self.stride = torch.tensor([8.0, 16.0, 32.0, 64.0][: len(anchors)])
        head.stride = self.stride
        head.anchors /= self.stride.view(-1, 1, 1)
        for module in self.modules():  # YOLOv5's initialize_weights
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = 1e-3, 0.03

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor]:
        outputs: list[torch.Tensor] = []
        for module in self.model:
            if module.f != -1:
                x = outputs[module.f] if isinstance(module.f, int) else [x if j == -1 else outputs[j] for j in module.f]
            x = module(x)
            outputs.append(x)
        return x


class SegmentationModel(DetectionModel):
    def __init__(self, depth: float, width: float, nc: int, anchors: tuple = ANCHORS) -> None:
        super().__init__(depth, width, nc, anchors, seg=True)


COMMON = (Conv, Bottleneck, C3, SPPF, Concat, Proto)
YOLO = (Detect, Segment, DetectionModel, SegmentationModel)


def _is_this_repository(package: str) -> bool:
    """Whether `package` is importable from this repository (as `models` is), not from site-packages."""
    spec = importlib.util.find_spec(package)
    origin = spec.origin if spec is not None and spec.origin else None
    return origin is not None and Path(origin).resolve().is_relative_to(REPO)


@contextlib.contextmanager
def pickle_paths(classes_by_module: dict[str, tuple[type, ...]]) -> Iterator[None]:
    """Make each class pickle under the module path it is listed with, as if that module defined it.

    Stand-in modules are put in `sys.modules` (with their parent packages, which pickle imports on
    saving, unless the package is this repository's own) and everything is restored on exit. A real
    Ultralytics installed beside the tests is never imported: its package would import its own
    modules, which the stand-ins hide, and saving would fail only where it is installed.
    """
    names = list(classes_by_module)
    for name in classes_by_module:
        parts = name.split(".")
        if not _is_this_repository(parts[0]):  # e.g. `ultralytics`, installed or not
            names += [".".join(parts[:depth]) for depth in range(1, len(parts))]
    saved = {name: sys.modules.get(name) for name in names}
    originals = {cls: cls.__module__ for classes in classes_by_module.values() for cls in classes}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    for name, classes in classes_by_module.items():
        for cls in classes:
            cls.__module__ = name
            setattr(sys.modules[name], cls.__name__, cls)
    try:
        yield
    finally:
        for cls, module in originals.items():
            cls.__module__ = module
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def yolov5_pickle_paths() -> contextlib.AbstractContextManager[None]:
    """Make the fakes pickle as `models.common.*` / `models.yolo.*` (as YOLOv5's own classes do)."""
    return pickle_paths({"models.common": COMMON, "models.yolo": YOLO})


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every weight and BatchNorm statistic distinct random values, so a wrong mapping shows in outputs.

    Fixed weights (requires_grad False, such as a DFL's bins) keep their values.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.uniform_(-0.2, 0.2, generator=generator)
                module.running_mean.uniform_(-0.2, 0.2, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
            elif isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)) and module.weight.requires_grad:
                module.weight.normal_(0, 0.5 / math.sqrt(module.weight[0].numel()), generator=generator)
                if module.bias is not None:
                    module.bias.uniform_(-0.5, 0.5, generator=generator)
    return model.eval()


def save_yolov5_checkpoint(model: nn.Module, path: str, with_ema: bool = False) -> None:
    """Save `model` the way YOLOv5's train.py does: module objects in fp16 plus plain metadata."""
    half = model.half()
    checkpoint = {
        "epoch": 299 if with_ema else -1,
        "best_fitness": 0.5 if with_ema else None,
        "model": half,
        "ema": half if with_ema else None,
        "updates": 1000 if with_ema else None,
        "optimizer": None,
        "opt": {"weights": "", "hyp": {"lr0": 0.01}, "epochs": 300},
        "git": {"remote": "https://github.com/ultralytics/yolov5", "branch": "master"},
        "date": "2024-01-01T00:00:00",
    }
    with yolov5_pickle_paths():
        torch.save(checkpoint, path)
    model.float()
