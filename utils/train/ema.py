"""Exponential moving average of model weights, the weights we validate and ship."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from utils.distributed import unwrap_model


class ModelEMA:
    """Keep an exponential moving average of a model's state (parameters and buffers).

    `ema` is a deep copy in eval mode with gradients off. Its decay ramps up as
    `decay * (1 - exp(-updates / tau))`, so early updates follow the fast-changing
    model closely and later ones average over ~1/(1 - decay) steps. Every rank can keep
    one (they stay identical under DDP, since the models are); rank 0's is saved.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0) -> None:
        self.ema = copy.deepcopy(unwrap_model(model)).eval()
        self.ema.requires_grad_(False)
        self.decay = decay
        self.tau = tau
        self.updates = updates

    def decay_at(self, updates: int) -> float:
        """Return the decay used by update number `updates` (1-based): near 0 at first, `decay` in the limit."""
        return self.decay * (1 - math.exp(-updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards `model` (DDP-wrapped or not); call after each optimizer step.

        Floating-point tensors become `d * ema + (1 - d) * model`; integer buffers (BatchNorm
        `num_batches_tracked`) are copied, since an average of counters means nothing.
        """
        self.updates += 1
        decay = self.decay_at(self.updates)
        source = unwrap_model(model)
        # The live tensors through parameters() and buffers(), the same order on both sides (the EMA is a copy):
        # state_dict() builds its dict module by module, milliseconds of host time per step on a GPU run.
        pairs = zip(
            (*self.ema.parameters(), *self.ema.buffers()), (*source.parameters(), *source.buffers()), strict=True
        )
        averaged, current, counters, counts = [], [], [], []
        for ema_value, value in pairs:
            if ema_value.dtype.is_floating_point:
                averaged.append(ema_value)
                current.append(value if value.dtype == ema_value.dtype else value.to(ema_value.dtype))
            else:
                counters.append(ema_value)
                counts.append(value)
        if counters:
            torch._foreach_copy_(counters, counts)
        if averaged:  # ema += (1 - d) * (model - ema): one multi-tensor op, not two per tensor (~300 here)
            torch._foreach_lerp_(averaged, current, 1 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return the averaged model's state dict: loads straight into a model for validation or export.

        The update count is not in it; save `updates` next to it (checkpoint key `ema_updates`).
        """
        return self.ema.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        """Restore the averaged weights and the update count, which positions the decay ramp."""
        self.ema.load_state_dict(state)
        self.updates = int(updates)
