"""HSV colour jitter: gains drawn per training item, applied in the loader worker (OpenCV) or on the device (torch).

The colour work of an item is done in one place: in the worker, where the jitter's conversion
back from HSV also turns OpenCV's BGR into the model's RGB, or, on CUDA, on the device, where
the batch arrives still BGR and `utils.data.batch.to_model_input` reorders the channels.

Each gain g of (hsv_h, hsv_s, hsv_v) draws a factor in [1 - g, 1 + g]; hue is multiplied modulo
a full turn (OpenCV's uint8 hue 0..179), saturation and value are multiplied and clipped, as
YOLOv5 does. The worker path (`apply_hsv`) costs two colour conversions and a lookup per image,
about 1.5 ms for 640 x 640 on one core, the largest cost of a mosaic item after its warp. On a
CUDA run the dataset only draws the gains and `hsv_jitter` applies them to the whole batch on the
GPU (`DatasetOptions.hsv_on_device`), where the same maths takes microseconds; the gains come from
the item's own random stream either way, so both paths train on the same draws.
"""

from __future__ import annotations

import cv2
import numpy as np
import torch

IDENTITY_GAINS = (1.0, 1.0, 1.0)  # hue, saturation, value factors that change nothing


def draw_hsv_gains(rng: np.random.Generator, hgain: float, sgain: float, vgain: float) -> np.ndarray | None:
    """Draw (hue, saturation, value) factors, each in [1 - gain, 1 + gain]; None (and no draw) when all gains are 0."""
    if not (hgain or sgain or vgain):
        return None
    return rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain]) + 1


def apply_hsv(image: np.ndarray, gains: np.ndarray, to_rgb: bool = False) -> np.ndarray:
    """Apply `draw_hsv_gains` factors to a BGR uint8 image IN PLACE and return it (RGB with `to_rgb`).

    The change goes through 256-entry lookup tables on the uint8 HSV image (much faster than
    float maths). The conversion back from HSV writes either channel order at the same cost, so
    the dataset gets its RGB output for free. Callers must not pass a cached image they want to keep.
    """
    levels = np.arange(256, dtype=np.float32)
    lut_hue = ((levels * gains[0]) % 180).astype(np.uint8)
    lut_saturation = np.clip(levels * gains[1], 0, 255).astype(np.uint8)
    lut_value = np.clip(levels * gains[2], 0, 255).astype(np.uint8)
    table = np.stack((lut_hue, lut_saturation, lut_value), axis=1)[None]  # (1, 256, 3): one table per channel
    hsv = cv2.LUT(cv2.cvtColor(image, cv2.COLOR_BGR2HSV), table)
    back = cv2.COLOR_HSV2RGB if to_rgb else cv2.COLOR_HSV2BGR
    if image.flags.c_contiguous:
        cv2.cvtColor(hsv, back, dst=image)
    else:  # OpenCV cannot write into a strided view (e.g. a numpy flip)
        image[...] = cv2.cvtColor(hsv, back)
    return image


def hsv_jitter(images: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """Return float RGB `images` (B, 3, H, W) in [0, 1] with per-image `gains` (B, 3) applied: batched `apply_hsv`.

    Float maths, so it differs from the uint8 worker path only by that path's rounding (OpenCV
    keeps hue in steps of 2 degrees). Runs on whatever device the tensors are on, in float32
    whatever the input's float type (in half precision the 1e-12 guards below round to 0 and black
    pixels would become NaN); the result has the input's dtype and memory format (channels-last
    stays channels-last, the layout the model runs in).
    """
    if images.ndim != 4 or images.shape[1] != 3 or gains.shape != (images.shape[0], 3):
        raise ValueError(f"hsv_jitter: images {tuple(images.shape)} and gains {tuple(gains.shape)} do not match")
    out = torch.empty_like(images)
    images = images.float()
    gains = gains.float()[:, :, None, None]
    red, green, blue = images.unbind(1)
    value, _ = images.max(1)
    spread = value - images.min(1).values
    saturation = spread / value.clamp_min(1e-12)
    safe = spread.clamp_min(1e-12)  # grey pixels: every difference below is 0, so the hue is 0 as OpenCV's
    hue = torch.where(
        value == red,
        (green - blue) / safe,
        torch.where(value == green, 2 + (blue - red) / safe, 4 + (red - green) / safe),
    )
    hue = (hue / 6 % 1 * gains[:, 0]) % 1  # fraction of a turn in [0, 1), multiplied as OpenCV's hue table does
    saturation = (saturation * gains[:, 1]).clamp(0, 1)
    value = (value * gains[:, 2]).clamp(0, 1)
    chroma = value * saturation
    # HSV -> R, G, B: v - v s clamp(min(k, 4 - k), 0, 1) with k = (offset + 6 hue) mod 6
    for channel, offset in enumerate((5, 3, 1)):
        k = (offset + 6 * hue) % 6
        out[:, channel] = value - chroma * torch.minimum(k, 4 - k).clamp(0, 1)
    return out
