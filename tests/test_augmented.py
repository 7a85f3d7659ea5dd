"""Tests for utils/backends/augmented.py: --augment's passes map boxes back, keep fixed shapes, pool with NMS."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from utils.backends.augmented import AUGMENTATIONS, AugmentedBackend
from utils.backends.base import BackendInfo, InferenceBackend
from utils.backends.metadata import END_TO_END
from utils.errors import ConfigError

HEIGHT, WIDTH = 96, 128  # not square: a swapped height and width shows
INFO = BackendInfo(
    path=None, file_format="pytorch", task="detect", family="anchor_free", layout="rows", names=("a", "b"),
    imgsz=(HEIGHT, WIDTH), fixed_shape=False, batch=None, dtype=torch.float32, stride=32, num_masks=0,
    end_to_end=False,
)  # fmt: skip


class BrightBoxFinder(InferenceBackend):
    """A stand-in model: one row per image, the box around its bright pixels (cx, cy, w, h in input pixels).

    Records the shape of every input it is given.
    """

    def __init__(self, info: BackendInfo = INFO) -> None:
        super().__init__(info)
        self.shapes: list[tuple[int, int]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.shapes.append(tuple(images.shape[-2:]))
        rows = []
        for image in images:
            ys, xs = torch.nonzero(image[0] > 0.65, as_tuple=True)  # half way from grey to white
            x0, x1, y0, y1 = xs.min().float(), xs.max().float() + 1, ys.min().float(), ys.max().float() + 1
            rows.append(
                torch.stack(((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0, torch.tensor(0.9), torch.tensor(0.1)))
            )
        return torch.stack(rows)[:, None], None


def _images_with_boxes(boxes_xyxy: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """A batch of grey images, each with one white rectangle (x0, y0, x1, y1 in pixels)."""
    images = torch.full((len(boxes_xyxy), 3, HEIGHT, WIDTH), 0.3)
    for image, (x0, y0, x1, y1) in zip(images, boxes_xyxy, strict=True):
        image[:, y0:y1, x0:x1] = 1.0
    return images


def test_every_pass_maps_its_box_back_to_the_input_pixels() -> None:
    boxes = [(10, 20, 50, 60), (70, 8, 120, 40)]  # off centre: an unmirrored flip would land elsewhere
    inner = BrightBoxFinder()
    rows, extra = AugmentedBackend(inner)(_images_with_boxes(boxes))
    assert extra is None and rows.shape == (2, len(AUGMENTATIONS), 6)
    for image_rows, (x0, y0, x1, y1) in zip(rows, boxes, strict=True):
        want = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
        # A shrunk edge falls within a pixel, half a pixel off at worst: 0.75 full-size pixels, per edge.
        torch.testing.assert_close(image_rows[:, :4], want.expand(len(AUGMENTATIONS), 4), atol=1.5, rtol=0)
    # The full-size pass, then the shrunk ones padded to the next multiple of the stride (not to the full size).
    assert inner.shapes == [(96, 128), (96, 128), (64, 96)]


def test_a_fixed_shape_file_gets_every_pass_at_its_one_size() -> None:
    inner = BrightBoxFinder(dataclasses.replace(INFO, fixed_shape=True))
    rows, _ = AugmentedBackend(inner)(_images_with_boxes([(10, 20, 50, 60)]))
    assert inner.shapes == [(HEIGHT, WIDTH)] * len(AUGMENTATIONS)
    torch.testing.assert_close(rows[0, :, 0], torch.full((len(AUGMENTATIONS),), 30.0), atol=1.5, rtol=0)


class LevelRows(InferenceBackend):
    """A stand-in model whose rows are per grid point, finest level first, with the level's stride as the score."""

    def __init__(self, per_cell: int) -> None:
        super().__init__(INFO)
        self.per_cell = per_cell

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Any]:
        height, width = images.shape[-2:]
        levels = [torch.full(((height // s) * (width // s) * self.per_cell,), float(s)) for s in (8, 16, 32)]
        strides = torch.cat(levels)
        rows = torch.zeros(len(images), len(strides), 6)
        rows[..., 4] = strides
        return rows, None


@pytest.mark.parametrize("per_cell", [1, 3])  # anchor-free heads, YOLOv5's three anchors
def test_the_full_pass_drops_its_coarsest_level_and_the_smallest_its_finest(per_cell: int) -> None:
    rows, _ = AugmentedBackend(LevelRows(per_cell))(torch.zeros(1, 3, HEIGHT, WIDTH))
    counts = [(h // s) * (w // s) * per_cell for (h, w), s in (((96, 128), 8), ((96, 128), 16), ((96, 128), 32))]
    shrunk = [(h // s) * (w // s) * per_cell for (h, w) in ((96, 128), (64, 96)) for s in (8, 16, 32)]
    full, middle, smallest = rows[0, :, 4].split([counts[0] + counts[1], sum(shrunk[:3]), shrunk[4] + shrunk[5]])
    assert set(full.tolist()) == {8.0, 16.0}  # no stride-32 rows at full size
    assert set(middle.tolist()) == {8.0, 16.0, 32.0}
    assert set(smallest.tolist()) == {16.0, 32.0}  # no stride-8 rows at 0.67x


def test_rows_in_another_layout_are_pooled_whole() -> None:
    rows, _ = AugmentedBackend(BrightBoxFinder())(_images_with_boxes([(10, 20, 50, 60)]))
    assert rows.shape[1] == len(AUGMENTATIONS)  # one detection-like row per pass: nothing dropped
    # An end-to-end file's top detections, as many as the grid has points: still detections, kept whole.
    end_to_end = LevelRows(per_cell=1)
    end_to_end.info = dataclasses.replace(INFO, layout=END_TO_END)
    rows, _ = AugmentedBackend(end_to_end)(torch.zeros(1, 3, HEIGHT, WIDTH))
    per_pass = [(h // s) * (w // s) for (h, w) in ((96, 128), (96, 128), (64, 96)) for s in (8, 16, 32)]
    assert rows.shape[1] == sum(per_pass)


def test_passes_are_pooled_with_nms_even_for_an_end_to_end_head() -> None:
    end_to_end = BrightBoxFinder(dataclasses.replace(INFO, end_to_end=True))
    rows, _ = AugmentedBackend(end_to_end)(_images_with_boxes([(10, 20, 50, 60)]))
    # The same object seen by three passes: the end-to-end top scores keep all three, NMS one.
    assert len(end_to_end.selector()(rows, 0.25, 0.45)[0]) == len(AUGMENTATIONS)
    assert len(AugmentedBackend(end_to_end).selector()(rows, 0.25, 0.45)[0]) == 1


def test_a_segmentation_model_is_refused_in_one_line() -> None:
    inner = BrightBoxFinder(dataclasses.replace(INFO, num_masks=32, task="segment"))
    with pytest.raises(ConfigError, match="--augment is for detection models") as error:
        AugmentedBackend(inner)
    assert "\n" not in str(error.value)
