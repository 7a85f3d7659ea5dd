"""Building blocks: conv-BN-SiLU, CSP bottleneck (C3), SPPF, Concat, 2x upsampling and the -seg prototype branch."""

from __future__ import annotations

import logging

import torch
from torch import nn

LOGGER = logging.getLogger(__name__)


def autopad(kernel: int, padding: int | None = None, dilation: int = 1) -> int:
    """Return the padding that keeps the spatial size for stride 1 ("same" padding) unless given.

    With stride s the output is then exactly ceil(input / s), which is what makes every
    feature map of a 32-multiple input an exact fraction of it.
    """
    if padding is not None:
        return padding
    effective = dilation * (kernel - 1) + 1
    return effective // 2


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU, the basic unit of every YOLO stage.

    `groups` > 1 makes a grouped (depthwise when equal to the channels) convolution; `activation`
    False leaves the output linear (attention projections, YOLO26's SPPF input). `fuse()` folds the
    batch norm into the convolution for inference; afterwards `bn` is an Identity and the
    convolution carries the bias, so outputs are unchanged (eval mode).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int = 1,
        stride: int = 1,
        padding: int | None = None,
        *,
        groups: int = 1,
        activation: bool = True,
    ) -> None:
        super().__init__()
        padding = autopad(kernel, padding)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding, groups=groups, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(out_channels)
        self.act: nn.Module = nn.SiLU() if activation else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply conv, norm and activation: (B, C_in, H, W) -> (B, C_out, H / stride, W / stride)."""
        return self.act(self.bn(self.conv(x)))

    @torch.no_grad()
    def fuse(self) -> None:
        """Fold the batch norm's running statistics and affine parameters into the conv weights."""
        if not isinstance(self.bn, nn.BatchNorm2d):
            return  # already fused
        bn = self.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (C_out,)
        fused = nn.Conv2d(
            self.conv.in_channels,
            self.conv.out_channels,
            self.conv.kernel_size,
            self.conv.stride,
            self.conv.padding,
            groups=self.conv.groups,
            bias=True,
        ).to(self.conv.weight)
        fused.weight.copy_(self.conv.weight * scale.view(-1, 1, 1, 1))
        fused.bias.copy_(bn.bias - bn.running_mean * scale)
        self.conv = fused
        self.bn = nn.Identity()


class Bottleneck(nn.Module):
    """1x1 conv then 3x3 conv, with a residual connection when asked and the shapes allow it."""

    def __init__(self, in_channels: int, out_channels: int, shortcut: bool = True, expansion: float = 0.5) -> None:
        super().__init__()
        hidden = int(out_channels * expansion)
        self.reduce = Conv(in_channels, hidden, 1, 1)
        self.spatial = Conv(hidden, out_channels, 3, 1)
        self.use_residual = shortcut and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        out = self.spatial(self.reduce(x))
        return x + out if self.use_residual else out


class C3(nn.Module):
    """CSP bottleneck with three convs: a bottleneck branch and a shortcut branch, concatenated and mixed.

    Half the hidden channels go through `num_blocks` bottlenecks, the other half skip them;
    this keeps gradients flowing through a short path while the deep path adds capacity.
    """

    def __init__(
        self, in_channels: int, out_channels: int, num_blocks: int = 1, shortcut: bool = True, expansion: float = 0.5
    ) -> None:
        super().__init__()
        hidden = int(out_channels * expansion)
        self.deep_in = Conv(in_channels, hidden, 1, 1)
        self.skip = Conv(in_channels, hidden, 1, 1)
        self.mix = Conv(2 * hidden, out_channels, 1, 1)
        self.blocks = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, expansion=1.0) for _ in range(num_blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        return self.mix(torch.cat((self.blocks(self.deep_in(x)), self.skip(x)), dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained max-pools whose outputs are concatenated.

    Chaining k x k pools gives receptive fields k, 2k-1, 3k-2 at the cost of one small pool each,
    the same result as SPP's parallel 5/9/13 pools for k=5.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: int = 5) -> None:
        super().__init__()
        hidden = in_channels // 2
        self.reduce = Conv(in_channels, hidden, 1, 1)
        self.mix = Conv(hidden * 4, out_channels, 1, 1)
        self.pool = nn.MaxPool2d(kernel_size=kernel, stride=1, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        x = self.reduce(x)
        pooled1 = self.pool(x)
        pooled2 = self.pool(pooled1)
        pooled3 = self.pool(pooled2)
        return self.mix(torch.cat((x, pooled1, pooled2, pooled3), dim=1))


class Concat(nn.Module):
    """Concatenate a list of tensors along one dimension (channels by default)."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Tensors must agree on every dimension except `dim`."""
        return torch.cat(tensors, dim=self.dim)


def fuse_convs(model: nn.Module) -> None:
    """Fold the batch norm of every Conv in `model` into its convolution (inference only; outputs unchanged)."""
    for module in model.modules():
        if isinstance(module, Conv):
            module.fuse()
    LOGGER.info("Fused conv and batch-norm layers")


def upsample2x() -> nn.Upsample:
    """Return a nearest-neighbour 2x upsampling layer, as used in the PAN neck."""
    return nn.Upsample(scale_factor=2.0, mode="nearest")


class Proto(nn.Module):
    """Mask prototype branch of both families' -seg heads: 3x3 Conv, 2x upsample, 3x3 Conv, 1x1 Conv to `num_masks`.

    On the stride-8 P3 feature it yields `num_masks` prototype masks at stride 4 (input size / 4);
    each detection's mask is a linear combination of them (see segment/ops.assemble_masks). The
    upsampling is YOLOv5-seg's nearest-neighbour one by default, or with `learned_upsample` the
    anchor-free heads' transposed 2x2 conv (weights and bias). Only the upsample differs, so the
    sub-modules keep one name and order: the state-dict keys both converters pair layer by layer.
    """

    def __init__(self, in_channels: int, num_protos: int, num_masks: int, *, learned_upsample: bool = False) -> None:
        super().__init__()
        self.expand = Conv(in_channels, num_protos, 3)
        self.upsample = (
            nn.ConvTranspose2d(num_protos, num_protos, 2, 2, 0, bias=True) if learned_upsample else upsample2x()
        )
        self.refine = Conv(num_protos, num_protos, 3)
        self.project = Conv(num_protos, num_masks, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, num_masks, 2H, 2W)."""
        return self.project(self.refine(self.upsample(self.expand(x))))
