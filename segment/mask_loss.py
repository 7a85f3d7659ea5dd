"""The one `__call__` of every family's segmentation loss: its detection terms, then mask terms on the same matches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from segment.mask_targets import MaskTargets


class MaskTermLoss(MaskTargets):
    """Mixed in before a family's detection loss, it turns that loss into the family's segmentation loss.

    `__call__((raw, protos), targets, reduce_counts=None, *, masks)`: raw is the detection head's
    training output, protos (B, nm, h, w), targets (N, 6) normalised as for detection; masks are the
    batch's ground truth (docs/CONTRACTS.md): per-instance (N, h', w') 0/1 aligned with the target
    rows, or with `overlap` (B, h', w') holding i + 1 where an image's i-th instance is. Masks of
    another size than the prototypes are resized to it first, centred (MaskTargets._prepare_masks).
    Returns (loss (1,) multiplied by the batch size, items in `item_names` order, detached).

    A family's loss supplies the two steps that differ:
    - `_detection_items(raw, targets, reduce_counts)` -> (its detection items by name, gained, 0-d;
      the matches its mask term reuses);
    - `_mask_items(raw, matches, protos, masks, targets, reduce_counts)` -> the mask items by name
      ("seg", and any other mask-side term), gained, 0-d. It runs in fp32 with autocast off, on
      fp32 `protos`, resized `masks` and fp32 `targets` on the prototypes' device.
    """

    item_names: tuple[str, ...]

    def __init__(self, model: nn.Module, gains: Any, *, overlap: bool = False, **kwargs: Any) -> None:
        super().__init__(model, gains, **kwargs)  # type: ignore[call-arg]  # the family's detection loss
        self.overlap = overlap
        self.one_graph = False  # the mask term lists its matches (nonzero): torch.compile would break there

    def __call__(
        self,
        outputs: tuple[Any, torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        masks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the loss for one batch; see the class docstring."""
        raw, protos = outputs
        items, matches = self._detection_items(raw, targets, reduce_counts)
        targets = targets.to(device=protos.device, dtype=torch.float32)
        with torch.autocast(protos.device.type, enabled=False):
            protos = protos.float()
            masks = self._prepare_masks(masks.to(protos.device), targets, len(protos), tuple(protos.shape[-2:]))
            items |= self._mask_items(raw, matches, protos, masks, targets, reduce_counts)
        losses = torch.stack([items[name] for name in self.item_names])
        return losses.sum().view(1) * len(protos), losses.detach()

    def _detection_items(
        self, raw: Any, targets: torch.Tensor, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """The family's detection items by name and the matches its mask term reuses."""
        raise NotImplementedError

    def _mask_items(
        self,
        raw: Any,
        matches: Any,
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """The mask items by name on `matches` (see the class docstring)."""
        raise NotImplementedError
