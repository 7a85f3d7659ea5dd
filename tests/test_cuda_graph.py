"""GraphedForward's bookkeeping on CPU: which calls replay, what the capture leaves behind, a failed capture.

CUDA graphs need a GPU (tests/test_cuda.py runs the real capture and compares it with eager steps). Here
`torch.cuda.make_graphed_callables` is replaced by a stand-in that does what the real one does to the
module: three warm-up passes (which move BatchNorm's running statistics) and an instance `forward`.
"""

from __future__ import annotations

import copy
import logging
import pickle
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_leaves

from segment.task import SEGMENT
from utils.families import build_model
from utils.tasks import DETECT
from utils.train import cuda_graph
from utils.train.cuda_graph import GraphedForward


class FakeCapture:
    """Warm up like make_graphed_callables, then set `module.forward` to a replay that counts its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.replays, self.sample_shapes = fail, 0, []

    def __call__(self, module: torch.nn.Module, sample_args: tuple[torch.Tensor, ...], **options: Any) -> Any:
        assert not torch.is_autocast_cache_enabled() or not torch.is_autocast_enabled()
        self.sample_shapes.append(tuple(sample_args[0].shape))
        for _ in range(3):
            module(*sample_args)
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        original = module.forward

        def replay(*args: Any) -> Any:
            self.replays += 1
            return original(*args)

        module.forward = replay
        return module


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(DETECT.spec_from_cfg("yolov8n", 3)).train()


def _bn_state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [buffer.clone() for buffer in model.buffers()]


def test_batches_of_the_captured_shape_replay_and_the_rest_run_eagerly(monkeypatch) -> None:
    fake = FakeCapture()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    model = _model()
    before = _bn_state(model)
    forward = GraphedForward(model, amp_dtype=None)
    images = torch.rand(2, 3, 64, 64)
    out = forward(images)
    assert fake.sample_shapes == [(2, 3, 64, 64)] and fake.replays == 1
    # The capture sees tensors only; the head's output comes back in its own structure, None fields included.
    assert type(out).__name__ == "DenseRaw" and out.one_to_one is None and len(out.levels) == 3
    # The warm-up passes' BatchNorm updates were undone: the replay alone counted this batch.
    eager = _model()
    eager(images)
    for got, want in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(got, want)
    assert any(not torch.equal(a, b) for a, b in zip(before, _bn_state(model), strict=True))
    forward(torch.rand(1, 3, 64, 64))  # the epoch's short last batch
    forward(torch.rand(2, 3, 96, 64))  # a --rect shape
    forward(images.to(memory_format=torch.channels_last))  # same shape, other strides: not what was captured
    with torch.no_grad():
        forward(images)
    model.eval()
    forward(images)
    model.train()
    forward(images)
    assert fake.replays == 2 and fake.sample_shapes == [(2, 3, 64, 64)]
    # The model itself stays a plain module: what the EMA copies and checkpoints pickle.
    assert "forward" not in vars(model)
    pickle.dumps(copy.deepcopy(model))


def test_every_trainable_parameter_gets_a_gradient_tensor_before_a_replay(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", FakeCapture())
    model = _model()
    model.backbone.requires_grad_(False)  # --freeze: frozen layers keep no gradient
    forward = GraphedForward(model, amp_dtype=None)
    forward(torch.rand(2, 3, 64, 64))
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.backbone.parameters())


def test_a_failed_capture_warns_once_and_trains_eagerly(monkeypatch, caplog) -> None:
    fake = FakeCapture(fail=True)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    model = _model()
    forward = GraphedForward(model, amp_dtype=None)
    images = torch.rand(2, 3, 64, 64)
    with caplog.at_level(logging.WARNING, logger=cuda_graph.LOGGER.name):
        out = forward(images)
        forward(images)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--cuda-graph: capturing the training step failed (RuntimeError: operation not permitted when stream is "
        "capturing); "
        "training eagerly"
    ]
    assert not forward.replays and fake.replays == 0 and len(fake.sample_shapes) == 1
    assert isinstance(out, (list, tuple, dict)) or torch.is_tensor(out)
    eager = _model()
    eager(images)
    eager(images)
    for got, want in zip(model.buffers(), eager.buffers(), strict=True):  # no warm-up pass left in the statistics
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("task", "cfg"),
    [
        (DETECT, "yolov5n"),
        (DETECT, "yolo26n"),
        (SEGMENT, "yolov5n-seg"),
        (SEGMENT, "yolov8n-seg"),
        (SEGMENT, "yolo26n-seg"),
    ],
)
def test_every_family_comes_back_in_its_own_output_structure(monkeypatch, task: Any, cfg: str) -> None:
    """Lists, tuples and DenseRaw with None fields (no one-to-one branch, no semantic head) through the capture."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", FakeCapture())
    torch.manual_seed(0)
    model = build_model(task.spec_from_cfg(cfg, 3)).train()
    eager = copy.deepcopy(model)
    images = torch.rand(2, 3, 64, 64)
    got, want = GraphedForward(model, amp_dtype=None)(images), eager(images)
    assert type(got) is type(want)
    got_leaves, want_leaves = (
        tree_leaves(got, is_leaf=lambda x: x is None),
        tree_leaves(want, is_leaf=lambda x: x is None),
    )
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


@pytest.mark.parametrize("enabled", [False, True])
def test_graphed_forward_only_with_the_flag(enabled: bool) -> None:
    model = _model()
    wrapped = cuda_graph.graphed_forward(model, enabled, None)
    assert isinstance(wrapped, GraphedForward) if enabled else wrapped is model
