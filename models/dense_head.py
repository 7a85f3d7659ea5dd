"""Anchor-free decoupled head: class scores and a box distribution per anchor point, DFL decode, -seg protos."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import Conv, Proto
from models.csp_blocks import depthwise_conv


class DenseRaw(NamedTuple):
    """What the head's training forward returns (and the eval forward passes on as its second element).

    `levels`: per level (B, 4 * reg_max + nc [+ nm], H_l, W_l) raw outputs of the one-to-many branch:
    box distribution logits (side-major: left, top, right, bottom, each `reg_max` bins), class logits,
    mask coefficients (None once a fused end-to-end model has dropped that branch). `one_to_one`: the same
    from the end-to-end branch (None without one), computed on detached features so its loss trains only
    its own convs. `semantic`: YOLO26-seg's training-only
    per-pixel class logits (B, nc, H/8, W/8), else None.
    """

    levels: list[torch.Tensor] | None
    one_to_one: list[torch.Tensor] | None = None
    semantic: torch.Tensor | None = None


def index_range(like: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """0, 1, ..., count - 1 (count,) in `dtype` on `like`'s device, made by an operation on `like`.

    torch.jit.trace records torch.arange's device as a constant, so a file traced on the CPU would
    build its grids there beside CUDA activations; an operation on a tensor of the graph follows that
    tensor's device. Counted in fp32: in bf16 a running sum stops at 256.
    """
    return (like.new_ones(count, dtype=torch.float32).cumsum(0) - 1).to(dtype)


def anchor_points(
    sizes: Sequence[tuple[int, int]], strides: Sequence[float], like: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (points (N, 2) cell centres x, y in grid units, point_strides (N, 1)) over all levels, row-major.

    Level l contributes H_l x W_l points (x + 0.5, y + 0.5); levels follow one another finest first,
    the order the head flattens its outputs in. On `like`'s device (see index_range).
    """
    points, point_strides = [], []
    for (height, width), stride in zip(sizes, strides, strict=True):
        ys = index_range(like, height, dtype) + 0.5
        xs = index_range(like, width, dtype) + 0.5
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        points.append(torch.stack((grid_x, grid_y), dim=-1).view(-1, 2))
        point_strides.append(like.new_full((height * width, 1), float(stride), dtype=dtype))
    return torch.cat(points), torch.cat(point_strides)


def distribution_to_distances(box_logits: torch.Tensor, reg_max: int, bins: torch.Tensor | None) -> torch.Tensor:
    """(..., 4 * reg_max) box logits -> (..., 4) left, top, right, bottom distances in grid units.

    With `reg_max` > 1 each side is a distribution over the bins 0 .. reg_max - 1 and its expectation is
    the distance (GFL's integral); with 1 the outputs are the distances themselves (YOLO26).
    """
    if reg_max == 1:
        return box_logits
    shape = box_logits.shape[:-1]
    probabilities = box_logits.view(*shape, 4, reg_max).softmax(dim=-1)
    # In the logits' dtype: autocast would run the product in fp16 / bf16 (bf16 is off by up to 0.06 grid units).
    with torch.autocast(probabilities.device.type, enabled=False):
        return probabilities @ bins.to(probabilities.dtype)


def distances_to_xywh(distances: torch.Tensor, points: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Left, top, right, bottom distances from `points`, both in the same units -> cx, cy, w, h along `dim`.

    Rows: (..., 4) distances and (N, 2) points. Channels first (`dim` 1): (B, 4, N) and (2, N).
    """
    left_top, right_bottom = distances.split(2, dim=dim)
    top_left, bottom_right = points - left_top, points + right_bottom
    return torch.cat(((top_left + bottom_right) / 2, bottom_right - top_left), dim=dim)


class DFLBins(nn.Module):
    """The bin values 0 .. reg_max - 1 a box distribution is averaged over, as a fixed (untrained) parameter.

    A parameter rather than a buffer because the published parameter counts of these models include
    it (and Ultralytics' checkpoints store it as a 1x1 conv weight); `requires_grad` stays False.
    """

    def __init__(self, reg_max: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(reg_max, dtype=torch.float32), requires_grad=False)


def _box_branch(in_channels: int, hidden: int, reg_max: int) -> nn.Sequential:
    return nn.Sequential(Conv(in_channels, hidden, 3), Conv(hidden, hidden, 3), nn.Conv2d(hidden, 4 * reg_max, 1))


def _class_branch(in_channels: int, hidden: int, num_classes: int, depthwise: bool) -> nn.Sequential:
    if not depthwise:  # YOLOv8: two full 3x3 convs
        return nn.Sequential(Conv(in_channels, hidden, 3), Conv(hidden, hidden, 3), nn.Conv2d(hidden, num_classes, 1))
    # YOLO11 / YOLO26: depthwise 3x3 then pointwise 1x1, twice: a fraction of the cost at the same width
    return nn.Sequential(
        nn.Sequential(depthwise_conv(in_channels, in_channels, 3), Conv(in_channels, hidden, 1)),
        nn.Sequential(depthwise_conv(hidden, hidden, 3), Conv(hidden, hidden, 1)),
        nn.Conv2d(hidden, num_classes, 1),
    )


def _mask_branch(in_channels: int, hidden: int, num_masks: int) -> nn.Sequential:
    return nn.Sequential(Conv(in_channels, hidden, 3), Conv(hidden, hidden, 3), nn.Conv2d(hidden, num_masks, 1))


class DenseHead(nn.Module):
    """Decoupled anchor-free head over P3/P4/P5: per anchor point, class logits and a box distribution.

    Widths follow the YOLOv8 layout rules: the box branch has max(16, C3 / 4, 4 x reg_max) hidden
    channels, the class branch max(C3, min(nc, 100)), where C3 is the P3 input width. With
    `end_to_end` a second pair of branches (one-to-one) is trained beside them and, when
    `use_one_to_one` is set, gives the eval output instead (each object predicted once: no NMS).

    Training forward returns `DenseRaw`; eval forward returns `(decoded (B, N, 4 + nc [+ nm]), DenseRaw)`
    with decoded rows [cx, cy, w, h (input pixels), class probabilities, raw mask coefficients].
    """

    def __init__(
        self,
        num_classes: int,
        strides: Sequence[float],
        in_channels: Sequence[int],
        *,
        reg_max: int = 16,
        depthwise_classes: bool = True,
        end_to_end: bool = False,
        num_masks: int = 0,
    ) -> None:
        super().__init__()
        self.num_classes, self.reg_max, self.num_masks = num_classes, reg_max, num_masks
        self.num_levels = len(in_channels)
        self.num_outputs = 4 * reg_max + num_classes + num_masks
        self.level_strides = tuple(float(stride) for stride in strides)
        self.register_buffer("stride", torch.tensor(self.level_strides))
        box_hidden = max(16, in_channels[0] // 4, 4 * reg_max)
        class_hidden = max(in_channels[0], min(num_classes, 100))
        self.box_branches = nn.ModuleList(_box_branch(c, box_hidden, reg_max) for c in in_channels)
        self.class_branches = nn.ModuleList(
            _class_branch(c, class_hidden, num_classes, depthwise_classes) for c in in_channels
        )
        self.bins = DFLBins(reg_max) if reg_max > 1 else None
        self.end_to_end = end_to_end
        self.use_one_to_one = end_to_end  # eval output branch; --nms turns it off (one-to-many + NMS)
        if end_to_end:
            self.one_to_one_box = copy.deepcopy(self.box_branches)
            self.one_to_one_class = copy.deepcopy(self.class_branches)
        self.init_biases()

    def add_mask_branches(self, num_masks: int, in_channels: Sequence[int]) -> None:
        """Add the per-point mask coefficient branches (segmentation); called by SegmentDenseHead."""
        hidden = max(in_channels[0] // 4, num_masks)
        self.mask_branches = nn.ModuleList(_mask_branch(c, hidden, num_masks) for c in in_channels)
        if self.end_to_end:
            self.one_to_one_mask = copy.deepcopy(self.mask_branches)

    @torch.no_grad()
    def init_biases(self, image_size: int = 640, objects_per_image: float = 5.0) -> None:
        """Start class logits near `objects_per_image` positives among the points of each level.

        Box outputs start at 1 (reg_max > 1: flat-ish distributions; YOLO26: one cell per side). Without
        the class prior the first steps are spent pushing every point's scores down.
        """
        pairs = [(self.box_branches, self.class_branches)]
        if self.end_to_end:
            pairs.append((self.one_to_one_box, self.one_to_one_class))
        for boxes, classes in pairs:
            for box, cls, stride in zip(boxes, classes, self.level_strides, strict=True):
                box[-1].bias.fill_(1.0)
                prior = objects_per_image / self.num_classes / (image_size / stride) ** 2
                cls[-1].bias.fill_(math.log(prior))

    def _branch_outputs(self, features: list[torch.Tensor], one_to_one: bool) -> list[torch.Tensor]:
        """Concatenate each level's box, class (and mask) outputs: (B, no, H_l, W_l) per level."""
        if one_to_one:
            boxes, classes = self.one_to_one_box, self.one_to_one_class
            masks = getattr(self, "one_to_one_mask", None)
        else:
            boxes, classes, masks = self.box_branches, self.class_branches, getattr(self, "mask_branches", None)
        outputs = []
        for level, feature in enumerate(features):
            parts = [boxes[level](feature), classes[level](feature)]
            if masks is not None:
                parts.append(masks[level](feature))
            outputs.append(torch.cat(parts, dim=1))
        return outputs

    def drop_one_to_many(self) -> None:
        """Inference only: delete the one-to-many branches an end-to-end head that decodes its one-to-one
        branch never reads (yolo26n: 0.15M parameters, 0.6 of 6.1 GFLOPs at 640). Their raw outputs are then
        None; --nms (`use_one_to_one` False) must be chosen before, as it decodes exactly those branches."""
        if self.end_to_end and self.use_one_to_one:
            self.box_branches = self.class_branches = None  # type: ignore[assignment]
            if hasattr(self, "mask_branches"):
                self.mask_branches = None

    def forward(self, features: list[torch.Tensor]) -> DenseRaw | tuple[torch.Tensor, DenseRaw]:
        """features: (B, C_l, H_l, W_l) per level, finest first. See the class docstring for outputs."""
        levels = self._branch_outputs(features, one_to_one=False) if self.box_branches is not None else None
        one_to_one = None
        if self.end_to_end and (self.training or self.use_one_to_one):
            # Detached: the one-to-one loss trains only these convs, the backbone learns from one-to-many.
            one_to_one = self._branch_outputs([f.detach() for f in features], one_to_one=True)
        raw = DenseRaw(levels, one_to_one)
        if self.training:
            return raw
        chosen = one_to_one if (self.end_to_end and self.use_one_to_one) else levels
        if chosen is None:
            raise RuntimeError("this head's one-to-many branches were dropped for inference; choose --nms before")
        return self.decode(chosen), raw

    def flatten(self, levels: list[torch.Tensor]) -> torch.Tensor:
        """Per-level (B, no, H_l, W_l) -> (B, N, no), points in `anchor_points` order."""
        return torch.cat([level.flatten(2) for level in levels], dim=2).transpose(1, 2)

    def decode(self, levels: list[torch.Tensor]) -> torch.Tensor:
        """Raw per-level outputs -> (B, N, 4 + nc + nm): xywh input pixels, class probabilities, mask coefficients.

        Computed channels first, (B, C, N), and returned as a transposed view: the softmax over bins and
        every elementwise step then run along the contiguous points axis, and an exporter that wants
        channels-first rows (Ultralytics' layout) transposes back for free (the two transposes cancel).
        """
        flat = torch.cat([level.flatten(2) for level in levels], dim=2)  # (B, no, N)
        batch, points_count = flat.shape[0], flat.shape[2]
        sizes = [tuple(level.shape[2:]) for level in levels]
        points, point_strides = anchor_points(sizes, self.level_strides, flat, flat.dtype)
        box_end = 4 * self.reg_max
        distances = flat[:, :box_end]  # (B, 4 * reg_max, N)
        if self.reg_max > 1:
            bins = self.bins.weight.to(flat.dtype).view(1, 1, self.reg_max, 1)
            probabilities = distances.reshape(batch, 4, self.reg_max, points_count).softmax(dim=2)
            distances = (probabilities * bins).sum(dim=2)  # (B, 4, N): each side's expected bin
        boxes = distances_to_xywh(distances, points.T, dim=1) * point_strides.T  # (B, 4, N) input pixels
        scores = flat[:, box_end : box_end + self.num_classes].sigmoid()
        return torch.cat((boxes, scores, flat[:, box_end + self.num_classes :]), dim=1).transpose(1, 2)


class MultiScaleProto(Proto):
    """YOLO26-seg prototypes: P4 and P5 projected to P3's width, upsampled and added to P3 before the proto chain.

    A training-only branch predicts per-pixel class logits from that sum (a semantic-segmentation
    auxiliary task); it is not part of inference and `fuse()` leaves it unused.
    """

    def __init__(self, in_channels: Sequence[int], num_protos: int, num_masks: int, num_classes: int) -> None:
        super().__init__(num_protos, num_protos, num_masks, learned_upsample=True)
        self.lateral = nn.ModuleList(Conv(c, in_channels[0], 1) for c in in_channels[1:])
        self.fuse_levels = Conv(in_channels[0], num_protos, 3)
        self.semantic = nn.Sequential(
            Conv(in_channels[0], num_protos, 3), Conv(num_protos, num_protos, 3), nn.Conv2d(num_protos, num_classes, 1)
        )

    def forward_all(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-level features -> (protos (B, nm, 2H3, 2W3), semantic logits (B, nc, H3, W3) or None out of training)."""
        summed = features[0]
        for level, (lateral, feature) in enumerate(zip(self.lateral, features[1:], strict=True), start=1):
            summed = summed + F.interpolate(lateral(feature), scale_factor=2**level, mode="nearest")
        protos = super().forward(self.fuse_levels(summed))
        return protos, (self.semantic(summed) if self.training else None)


class SegmentDenseHead(DenseHead):
    """DenseHead plus mask coefficients per point and a prototype branch (YOLOv8/11: on P3; YOLO26: multi-scale).

    Training forward returns `(DenseRaw, protos (B, nm, H/4, W/4))`; eval forward `(decoded (B, N, 4 + nc + nm),
    (DenseRaw, protos))`, so the eval output's second element is what the loss takes, as for detection.
    """

    def __init__(
        self,
        num_classes: int,
        strides: Sequence[float],
        in_channels: Sequence[int],
        *,
        num_masks: int,
        num_protos: int,
        multi_scale_protos: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(num_classes, strides, in_channels, num_masks=num_masks, **kwargs)  # type: ignore[arg-type]
        self.num_protos = num_protos
        if multi_scale_protos:
            self.proto: nn.Module = MultiScaleProto(in_channels, num_protos, num_masks, num_classes)
        else:
            self.proto = Proto(in_channels[0], num_protos, num_masks, learned_upsample=True)
        self.add_mask_branches(num_masks, in_channels)

    def forward(self, features: list[torch.Tensor]) -> tuple:
        """features: (B, C_l, H_l, W_l) per level, finest (stride 8) first. See the class docstring."""
        if isinstance(self.proto, MultiScaleProto):
            protos, semantic = self.proto.forward_all(features)
        else:
            protos, semantic = self.proto(features[0]), None
        output = super().forward(features)
        if self.training:
            return output._replace(semantic=semantic), protos
        decoded, raw = output
        return decoded, (raw, protos)
