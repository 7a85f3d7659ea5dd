"""Detection head (per-level 1x1 convs predicting anchor boxes, decoded to pixels) and its segmentation variant."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from models.blocks import Proto
from models.dense_head import index_range

# Training output: raw list [(B, na, H_l, W_l, no)], plus protos (B, nm, H/4, W/4) for segmentation.
TrainOutput = list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor]
# Eval output: (decoded (B, N, no), the training output).
HeadOutput = TrainOutput | tuple[torch.Tensor, TrainOutput]


class DetectHead(nn.Module):
    """Predict `num_anchors` boxes per grid cell on each feature level (P3/P4/P5).

    Each prediction has `num_outputs = 5 + num_classes + num_masks` values:
    x, y, w, h, objectness, class logits, then (segmentation only) mask coefficients.

    Buffers (saved in checkpoints, so anchors changed by AutoAnchor travel with the weights):
    - `anchors`: (num_levels, num_anchors, 2) float, anchor w, h in *grid units* (pixels / stride)
    - `stride`: (num_levels,) float, pixels per grid cell of each level

    Training forward returns the raw list `[(B, na, H_l, W_l, num_outputs)]`; eval forward returns
    `(decoded (B, N, num_outputs), raw list)` where decoded boxes are xywh in input-image pixels,
    objectness and class scores are sigmoid probabilities and mask coefficients stay raw.
    """

    def __init__(
        self,
        num_classes: int,
        anchors_px: torch.Tensor,
        strides: torch.Tensor,
        in_channels: Sequence[int],
        num_masks: int = 0,
    ) -> None:
        super().__init__()
        if anchors_px.dim() != 3 or anchors_px.shape[-1] != 2 or len(anchors_px) != len(in_channels):
            raise ValueError(f"anchors must be (num_levels={len(in_channels)}, na, 2), got {tuple(anchors_px.shape)}")
        self.num_classes = num_classes
        self.num_masks = num_masks
        self.num_outputs = 5 + num_classes + num_masks
        self.num_levels = len(in_channels)
        self.num_anchors = anchors_px.shape[1]
        strides = strides.float()
        self.register_buffer("stride", strides.clone())
        self.register_buffer("anchors", anchors_px.float() / strides.view(-1, 1, 1))
        self.convs = nn.ModuleList(nn.Conv2d(c, self.num_outputs * self.num_anchors, 1) for c in in_channels)
        # Cell offsets depend only on the feature size; cached so eval does not rebuild them per batch.
        self._grids: dict[tuple[int, int, str, torch.dtype], torch.Tensor] = {}
        self.init_biases()

    @torch.no_grad()
    def init_biases(self, image_size: int = 640, objects_per_image: float = 8.0, class_prior: float = 0.6) -> None:
        """Start objectness and class logits at sensible priors instead of 0.5 probability.

        Objectness starts at ~`objects_per_image` positives among the (image_size / stride)^2 cells
        of each level, classes at `class_prior` spread over the classes. Without this the first
        iterations are dominated by a huge loss pushing every cell towards "no object".
        """
        for conv, stride in zip(self.convs, self.stride.tolist(), strict=True):
            bias = conv.bias.view(self.num_anchors, self.num_outputs)
            bias[:, 4] += math.log(objects_per_image / (image_size / stride) ** 2)
            bias[:, 5 : 5 + self.num_classes] += math.log(class_prior / (self.num_classes - 0.99))

    def forward(self, features: list[torch.Tensor]) -> HeadOutput:
        """features: (B, C_l, H_l, W_l) per level, finest first. See the class docstring for outputs."""
        raw: list[torch.Tensor] = []
        for feature, conv in zip(features, self.convs, strict=True):
            batch, _, height, width = feature.shape
            out = conv(feature).view(batch, self.num_anchors, self.num_outputs, height, width)
            raw.append(out.permute(0, 1, 3, 4, 2).contiguous())
        if self.training:
            return raw
        decoded = torch.cat([self.decode(level_raw, level) for level, level_raw in enumerate(raw)], dim=1)
        return decoded, raw

    def decode(self, raw: torch.Tensor, level: int) -> torch.Tensor:
        """Turn one level's raw (B, na, H, W, no) into (B, na*H*W, no) with xywh in pixels (YOLOv5 v6).

        xy = (2 sigmoid - 0.5 + cell) * stride lets a centre sit up to half a cell outside its cell;
        wh = (2 sigmoid)^2 * anchor bounds the size to 4x the anchor, matching the loss's anchor_t.
        """
        batch, num_anchors, height, width, num_outputs = raw.shape
        grid = self._grid(height, width, raw)
        stride = self.stride[level].to(raw.dtype)
        anchor_px = (self.anchors[level] * self.stride[level]).to(raw.dtype).view(1, num_anchors, 1, 1, 2)
        score_end = 5 + self.num_classes
        xy = (raw[..., 0:2].sigmoid() * 2 - 0.5 + grid) * stride
        wh = (raw[..., 2:4].sigmoid() * 2) ** 2 * anchor_px
        scores = raw[..., 4:score_end].sigmoid()
        decoded = torch.cat((xy, wh, scores, raw[..., score_end:]), dim=-1)
        return decoded.view(batch, num_anchors * height * width, num_outputs)

    def _grid(self, height: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """(1, 1, H, W, 2) cell offsets (x, y) on `like`'s device in its dtype, cached per size, device and dtype."""
        key = (height, width, str(like.device), like.dtype)
        if key not in self._grids:
            ys, xs = torch.meshgrid(
                index_range(like, height, like.dtype), index_range(like, width, like.dtype), indexing="ij"
            )
            self._grids[key] = torch.stack((xs, ys), dim=-1).view(1, 1, height, width, 2)
        return self._grids[key]


class SegmentHead(DetectHead):
    """DetectHead whose predictions end in `num_masks` mask coefficients, plus a `proto` branch on P3.

    Training forward returns `(raw list, protos (B, num_masks, H/4, W/4))`; eval forward returns
    `(decoded (B, N, 5 + nc + nm), (raw list, protos))`, so the eval output's second element is
    exactly what the training forward returns (what the loss takes).
    """

    def __init__(
        self,
        num_classes: int,
        anchors_px: torch.Tensor,
        strides: torch.Tensor,
        in_channels: Sequence[int],
        num_masks: int,
        num_protos: int,
    ) -> None:
        if num_masks < 1 or num_protos < 1:
            raise ValueError(f"SegmentHead needs num_masks and num_protos >= 1, got {num_masks}, {num_protos}")
        super().__init__(num_classes, anchors_px, strides, in_channels, num_masks)
        self.num_protos = num_protos
        self.proto = Proto(in_channels[0], num_protos, num_masks)

    def forward(self, features: list[torch.Tensor]) -> HeadOutput:
        """features: (B, C_l, H_l, W_l) per level, finest (stride 8) first. See the class docstring for outputs."""
        protos = self.proto(features[0])
        detections = super().forward(features)
        if self.training:
            return detections, protos
        decoded, raw = detections
        return decoded, (raw, protos)
