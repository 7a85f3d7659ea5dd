"""--cuda-graph: the training forward and backward replayed from CUDA graphs, not launched kernel by kernel."""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

LOGGER = logging.getLogger(__name__)


class _TensorOutputs(nn.Module):
    """`model` with its output flattened to the tensors in it, what graph capture takes.

    The anchor-free heads' `DenseRaw` holds None fields; `rebuild` puts the replayed tensors back in
    the model's output structure.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.leaves: list[Any] = []  # the last output's leaves: the non-tensor ones are kept as they were
        self.spec: Any = None
        self.tensor_slots: list[int] = []

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.leaves, self.spec = tree_flatten(self.model(images))
        self.tensor_slots = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        return tuple(self.leaves[i] for i in self.tensor_slots)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = tensor
        return tree_unflatten(leaves, self.spec)


class GraphedForward:
    """Call `model` as the training step does; batches of the captured shape replay CUDA graphs.

    A small detector's GPU step is bound by the host: yolov8n at batch 32 and 640 px launches
    about 1,800 kernels per batch, and on an H200 the GPU was busy for about 20 ms of each batch
    while a batch took 65 ms (`benchmarks/gpu.py --profile-steps`). A CUDA graph
    replays the model's forward, and then its backward, with one launch each; the loss, the
    optimizer and the EMA stay eager. The graphs are captured at the first training batch
    (`torch.cuda.make_graphed_callables`: three warm-up passes on a side stream, then the
    capture) and replayed for every batch of that shape, dtype and strides. Other batches (the epoch's
    short last batch, --rect shapes) and eval mode or no-grad calls run the model eagerly, on the
    same parameters.

    Two differences from eager training are undone here:
    - the warm-up passes update BatchNorm's running statistics; the buffers are restored after
      the capture, so the run (and a resumed one) sees each batch once;
    - the backward graph returns parameter gradients in its own buffers, and autograd adopts such
      a buffer as `.grad` when a parameter has none, so the next replay would overwrite it (with
      accumulation, the last micro-batch would count twice). So every parameter keeps a gradient
      tensor of its own: missing ones are made before each replay, and the optimizer step zeroes
      gradients instead of dropping them (`TrainState.keep_grads`).
    One process only: under DDP the forward's collectives (SyncBatchNorm) and the reducer's
    hooks have not been run inside graphs here (`utils/train/config.py: validate`). If the capture
    fails, one warning says why and the run trains eagerly.
    """

    def __init__(self, model: nn.Module, amp_dtype: torch.dtype | None) -> None:
        self.model = model
        self.amp_dtype = amp_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.outputs = _TensorOutputs(model)  # what is captured; the model itself is never changed
        self.graphed: Any = None
        self.key: tuple[Any, ...] | None = None  # (shape, dtype, strides) the graphs were captured at
        self.failed = False

    def __call__(self, images: torch.Tensor) -> Any:
        if self.failed or not (self.model.training and torch.is_grad_enabled()):
            return self.model(images)
        if self.graphed is None:
            self._capture(images)
            if self.failed:
                return self.model(images)
        if (images.shape, images.dtype, images.stride()) != self.key:
            return self.model(images)
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return self.outputs.rebuild(self.graphed(images))

    @property
    def replays(self) -> bool:
        """Whether the graphs were captured (a later failure or an odd shape runs eagerly)."""
        return self.graphed is not None and not self.failed

    def _capture(self, images: torch.Tensor) -> None:
        """Capture the forward and backward graphs at `images`' shape; restore BatchNorm's statistics after."""
        buffers = list(self.model.buffers())
        saved = [buffer.clone() for buffer in buffers]
        sample = images.detach().clone()  # the graphs' input buffer: later batches are copied into it
        options: dict[str, Any] = {"allow_unused_input": True}  # a parameter the training forward skips gets None
        if "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters:
            options["capture_error_mode"] = "thread_local"  # the loader's pinning thread keeps using CUDA meanwhile
        dtype = self.amp_dtype or torch.float16
        try:
            # The casts autocast makes are captured too; its weight cache would hold tensors of the capture.
            with (
                torch.autocast("cuda", dtype=dtype, enabled=self.amp_dtype is not None, cache_enabled=False),
                warnings.catch_warnings(),
            ):
                # make_graphed_callables warms up and captures on a side stream; during that, torch warned once
                # (H200, torch 2.11) that a gradient accumulator's stream differs from the incoming gradient's.
                # The replays that followed trained at 797 images/s against 509 eager, the same mAP.
                warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
                self.graphed = torch.cuda.make_graphed_callables(self.outputs, (sample,), **options).forward
        except Exception as error:  # noqa: BLE001  (the flag is an optimisation: any failure trains eagerly, said once)
            self.failed, self.graphed = True, None
            text = str(error).strip()
            reason = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
            LOGGER.warning(f"--cuda-graph: capturing the training step failed ({reason}); training eagerly")
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved, strict=True):
                    buffer.copy_(value)
        if not self.failed:
            self.key = (images.shape, images.dtype, images.stride())
            shape = "x".join(str(v) for v in images.shape)
            LOGGER.info(f"--cuda-graph: forward and backward captured at {shape}; other shapes run eagerly")


def graphed_forward(forward: Any, cuda_graph: bool, amp_dtype: torch.dtype | None) -> Any:
    """`forward` (the model, one process) wrapped in a `GraphedForward` with --cuda-graph; else unchanged."""
    return GraphedForward(forward, amp_dtype) if cuda_graph else forward
