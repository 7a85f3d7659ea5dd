"""Family-neutral facts about a built model: its GFLOPs, its one-line summary and its weights' memory layout."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def memory_format(channels_last: bool) -> torch.memory_format:
    """The layout for a model's 4-D weights: NHWC when `channels_last`, else NCHW.

    A conv whose weight is channels_last produces channels_last output on CPU (oneDNN) and CUDA
    (cuDNN) whatever its input's layout, so converting the model converts every activation after
    the first conv. Apply it again after `fuse()`, which builds new convs.
    """
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.no_grad()
def estimate_gflops(model: nn.Module, imgsz: int | tuple[int, int] = 640, probe_size: int = 64) -> float:
    """Estimate forward GFLOPs (2 x multiply-adds) for one (imgsz) image, counted with hooks on a probe image.

    Convolutions (transposed ones per input pixel) are counted on a `probe_size` square and scaled
    by area, exact when the sides are multiples of 32. Attention modules (`quadratic_macs(h, w)`)
    cost the square of their pixel count and are counted at the real size. A model whose
    `counts_norm_flops` is True also counts its batch norms (4 operations per element), the
    convention its publisher's figures use; YOLOv5's figures count convolutions only.
    """
    height, width = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
    area_scale = (height * width) / probe_size**2
    count_norms = bool(getattr(model, "counts_norm_flops", False))
    macs, quadratic = 0.0, 0.0

    def count(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        nonlocal macs, quadratic
        if isinstance(module, nn.ConvTranspose2d):
            macs += inputs[0][0].numel() * module.out_channels // module.groups * math.prod(module.kernel_size)
        elif isinstance(module, nn.Conv2d):
            kernel_h, kernel_w = module.kernel_size
            macs += output[0].numel() * (module.in_channels // module.groups) * kernel_h * kernel_w
        elif isinstance(module, nn.BatchNorm2d):
            macs += 4 * output[0].numel()
        else:  # attention: its cost at the probe scales with the area squared; count it at the real size
            probe_h, probe_w = output.shape[-2:]
            full_h, full_w = round(probe_h * height / probe_size), round(probe_w * width / probe_size)
            quadratic += module.quadratic_macs(full_h, full_w)

    kinds = (nn.Conv2d, nn.ConvTranspose2d) + ((nn.BatchNorm2d,) if count_norms else ())
    counted = [m for m in model.modules() if isinstance(m, kinds) or hasattr(m, "quadratic_macs")]
    hooks = [m.register_forward_hook(count) for m in counted]
    was_training = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        model(torch.zeros(1, 3, probe_size, probe_size, device=device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return 2 * (macs * area_scale + quadratic) / 1e9


def model_info(model: nn.Module, imgsz: int | tuple[int, int] = 640) -> str:
    """Return a one-line summary: layers, parameters, trainable parameters and GFLOPs at `imgsz`.

    `model` is a plain model (callers unwrap a DDP wrapper first: utils.distributed.unwrap_model).
    """
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_layers = len(list(model.modules()))
    gflops = estimate_gflops(model, imgsz)
    return (
        f"{type(model).__name__}: {num_layers} layers, {num_params:,} parameters, "
        f"{num_trainable:,} trainable, {gflops:.1f} GFLOPs at {imgsz}"
    )
