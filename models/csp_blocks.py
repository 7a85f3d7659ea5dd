"""Building blocks of the anchor-free layouts (YOLOv8, YOLO11, YOLO26): C2f, C3k2, C2PSA attention, SPPF."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.blocks import Conv

# Sub-modules are registered in the order Ultralytics' checkpoints store their tensors, so a converted
# checkpoint maps onto these blocks layer by layer in state-dict order (utils/convert.py checks every shape).


class KernelBottleneck(nn.Module):
    """Two convs of the given kernels (3x3, 3x3 in these layouts) with a residual when shapes allow.

    The hidden width is `expansion` x the output width: 0.5 inside C3k2, 1.0 inside C2f and C3k.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        shortcut: bool = True,
        kernels: tuple[int, int] = (3, 3),
        expansion: float = 0.5,
    ) -> None:
        super().__init__()
        hidden = int(out_channels * expansion)
        self.first = Conv(in_channels, hidden, kernels[0])
        self.second = Conv(hidden, out_channels, kernels[1])
        self.use_residual = shortcut and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        out = self.second(self.first(x))
        return x + out if self.use_residual else out


class C2f(nn.Module):
    """CSP block with a chain of bottlenecks whose every intermediate output is kept (YOLOv8's C2f).

    `split` makes 2 x hidden channels, halved; the second half runs through the chain and each
    link's output is concatenated with both halves before the 1x1 `merge`. Keeping every link gives
    the merge features of several depths. `inner` builds the chain's blocks (C3k2 swaps them).
    """

    def __init__(
        self, in_channels: int, out_channels: int, num_blocks: int = 1, shortcut: bool = False, expansion: float = 0.5
    ) -> None:
        super().__init__()
        self.hidden = int(out_channels * expansion)
        self.split = Conv(in_channels, 2 * self.hidden, 1)
        self.merge = Conv((2 + num_blocks) * self.hidden, out_channels, 1)
        self.blocks = nn.ModuleList(self.inner(shortcut) for _ in range(num_blocks))

    def inner(self, shortcut: bool) -> nn.Module:
        """One link of the chain: a 3x3-3x3 bottleneck at full hidden width."""
        return KernelBottleneck(self.hidden, self.hidden, shortcut, expansion=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        outputs = list(self.split(x).chunk(2, dim=1))
        for block in self.blocks:
            outputs.append(block(outputs[-1]))
        return self.merge(torch.cat(outputs, dim=1))


class C3k(nn.Module):
    """C3 whose bottlenecks use k x k kernels on both convs: a deep branch and a skip branch, mixed by 1x1."""

    def __init__(
        self, in_channels: int, out_channels: int, num_blocks: int = 2, shortcut: bool = True, kernel: int = 3
    ) -> None:
        super().__init__()
        hidden = out_channels // 2
        self.deep_in = Conv(in_channels, hidden, 1)
        self.skip = Conv(in_channels, hidden, 1)
        self.mix = Conv(2 * hidden, out_channels, 1)
        self.blocks = nn.Sequential(
            *(KernelBottleneck(hidden, hidden, shortcut, (kernel, kernel), 1.0) for _ in range(num_blocks))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        return self.mix(torch.cat((self.blocks(self.deep_in(x)), self.skip(x)), dim=1))


class C3k2(C2f):
    """YOLO11's C2f variant: each link is a bottleneck (0.5 expansion), a C3k (`use_c3k`), or a bottleneck
    followed by a PSA attention block (`attention`, YOLO26's last neck stage). Residuals are on by default."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_blocks: int = 1,
        use_c3k: bool = False,
        expansion: float = 0.5,
        attention: bool = False,
        shortcut: bool = True,
    ) -> None:
        self.use_c3k, self.attention = use_c3k, attention
        super().__init__(in_channels, out_channels, num_blocks, shortcut, expansion)

    def inner(self, shortcut: bool) -> nn.Module:
        """One link: see the class docstring."""
        if self.attention:
            heads = max(self.hidden // 64, 1)
            return nn.Sequential(
                KernelBottleneck(self.hidden, self.hidden, shortcut), PSABlock(self.hidden, heads, shortcut=shortcut)
            )
        if self.use_c3k:
            return C3k(self.hidden, self.hidden, 2, shortcut)
        return KernelBottleneck(self.hidden, self.hidden, shortcut)


class Attention(nn.Module):
    """Multi-head self-attention over the pixels of a feature map, with a depthwise positional term.

    One 1x1 conv makes, per head, a query and key of `key_dim` = head_dim x `key_ratio` channels and a
    value of head_dim channels. The output is softmax(q^T k / sqrt(key_dim)) applied to v, plus a 3x3
    depthwise conv of v (position information the dot products lack), projected by a 1x1 conv.
    Cost grows with (H x W)^2, which is why the layouts use it only at stride 32.
    """

    def __init__(self, channels: int, num_heads: int = 8, key_ratio: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = channels // num_heads
        self.key_dim = int(self.head_dim * key_ratio)
        self.scale = self.key_dim**-0.5
        self.qkv = Conv(channels, channels + 2 * self.key_dim * num_heads, 1, activation=False)
        self.proj = Conv(channels, channels, 1, activation=False)
        self.position = Conv(channels, channels, 3, groups=channels, activation=False)

    def quadratic_macs(self, height: int, width: int) -> int:
        """Multiply-adds of the two attention products on an H x W map (for GFLOPs counts)."""
        pixels = height * width
        return self.num_heads * pixels * pixels * (self.key_dim + self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        batch, channels, height, width = x.shape
        per_head = (self.key_dim, self.key_dim, self.head_dim)
        qkv = self.qkv(x).view(batch, self.num_heads, sum(per_head), height * width)
        query, key, value = qkv.split(per_head, dim=2)
        weights = ((query.transpose(-2, -1) @ key) * self.scale).softmax(dim=-1)  # (B, heads, HW, HW)
        attended = (value @ weights.transpose(-2, -1)).view(batch, channels, height, width)
        return self.proj(attended + self.position(value.reshape(batch, channels, height, width)))


class PSABlock(nn.Module):
    """Attention then a 2x-wide 1x1 feed-forward pair, each added to its input (a transformer layer in convs)."""

    def __init__(self, channels: int, num_heads: int, key_ratio: float = 0.5, shortcut: bool = True) -> None:
        super().__init__()
        self.attention = Attention(channels, num_heads, key_ratio)
        self.feed_forward = nn.Sequential(
            Conv(channels, 2 * channels, 1), Conv(2 * channels, channels, 1, activation=False)
        )
        self.use_residual = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        x = x + self.attention(x) if self.use_residual else self.attention(x)
        return x + self.feed_forward(x) if self.use_residual else self.feed_forward(x)


class C2PSA(nn.Module):
    """CSP block around `num_blocks` PSA blocks: half the channels pass through attention, half skip it."""

    def __init__(self, channels: int, num_blocks: int = 1, expansion: float = 0.5) -> None:
        super().__init__()
        self.hidden = int(channels * expansion)
        self.split = Conv(channels, 2 * self.hidden, 1)
        self.merge = Conv(2 * self.hidden, channels, 1)
        heads = max(self.hidden // 64, 1)
        self.blocks = nn.Sequential(*(PSABlock(self.hidden, heads) for _ in range(num_blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        skip, deep = self.split(x).split((self.hidden, self.hidden), dim=1)
        return self.merge(torch.cat((skip, self.blocks(deep)), dim=1))


class PoolPyramid(nn.Module):
    """SPPF generalised: `num_pools` chained k x k max-pools, all outputs concatenated and mixed by 1x1.

    YOLOv8 and YOLO11 use 3 pools after an activated 1x1 reduction. YOLO26 keeps the reduction linear
    and adds the input to the output (`residual`), so the block starts as an identity plus a correction.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int = 5,
        num_pools: int = 3,
        residual: bool = False,
        reduce_activation: bool = True,
    ) -> None:
        super().__init__()
        hidden = in_channels // 2
        self.reduce = Conv(in_channels, hidden, 1, activation=reduce_activation)
        self.mix = Conv(hidden * (num_pools + 1), out_channels, 1)
        self.pool = nn.MaxPool2d(kernel_size=kernel, stride=1, padding=kernel // 2)
        self.num_pools = num_pools
        self.use_residual = residual and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H, W)."""
        outputs = [self.reduce(x)]
        for _ in range(self.num_pools):
            outputs.append(self.pool(outputs[-1]))
        out = self.mix(torch.cat(outputs, dim=1))
        return x + out if self.use_residual else out


def depthwise_conv(in_channels: int, out_channels: int, kernel: int = 3) -> Conv:
    """A conv-BN-SiLU grouped by gcd(in, out): depthwise when the widths are equal."""
    return Conv(in_channels, out_channels, kernel, groups=math.gcd(in_channels, out_channels))
