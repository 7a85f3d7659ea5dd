"""--multi-scale (sizes from the iteration, the batch resize, a run using them) and --noautoanchor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import segment.train
import train
from tests.conftest import make_tiny_dataset
from utils.data.synthetic import SyntheticSpec
from utils.train import multi_scale, records
from utils.train.multi_scale import largest_size, multi_scale_size, resize_batch


def test_sizes_are_strided_within_half_to_one_and_a_half_and_depend_only_on_seed_and_iteration() -> None:
    sizes = [multi_scale_size(i, imgsz=640, stride=32, seed=0) for i in range(400)]
    assert set(sizes) == set(range(320, 960 + 1, 32))  # YOLOv5's range: every multiple of the stride in it
    assert sizes[::-1] == [multi_scale_size(i, 640, 32, 0) for i in reversed(range(400))]  # no hidden state
    assert sizes != [multi_scale_size(i, 640, 32, 1) for i in range(400)]  # another seed, other sizes


def test_a_batch_is_resized_to_the_long_side_with_strided_sides() -> None:
    images = torch.rand(2, 3, 64, 96)
    resized = resize_batch(images, 192, 32)
    assert resized.shape == (2, 3, 128, 192)
    assert resize_batch(images, 160, 32).shape == (2, 3, 128, 160)  # 64 * 160/96 = 106.7: up to the next 32
    assert resize_batch(images, 96, 32) is images  # already that size: no copy
    assert resize_batch(torch.rand(1, 3, 608, 608), 672, 32).shape[-2:] == (672, 672)  # no float round-up
    flat = torch.full((1, 3, 64, 64), 0.25)
    assert torch.allclose(resize_batch(flat, 32, 32), torch.full((1, 3, 32, 32), 0.25))  # bilinear, no new values


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["detect", "segment"])
def test_multi_scale_training_feeds_the_model_several_sizes(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_tiny_dataset(tmp_path / "data", SyntheticSpec(num_train=8, num_val=2, max_objects=2))
    seen: list[tuple[int, int]] = []

    def recording_resize(images: torch.Tensor, long_side: int, stride: int) -> torch.Tensor:
        resized = resize_batch(images, long_side, stride)
        seen.append(tuple(resized.shape[-2:]))
        return resized

    monkeypatch.setattr(multi_scale, "resize_batch", recording_resize)
    main, model = (train.main, "yolov8n") if entry == "detect" else (segment.train.main, "yolov8n-seg")
    args = ["--data", str(data), "--cfg", model, "--imgsz", "64", "--epochs", "2", "--batch-size", "2", "--multi-scale"]
    result = main([*args, "--device", "cpu", "--workers", "0", "--project", str(tmp_path / "runs"), "--noplots"])
    assert result.last.is_file()
    assert len(seen) == 8 and len(set(seen)) > 1  # 4 batches x 2 epochs, not all one size
    assert all(h % 32 == 0 and w % 32 == 0 and 32 <= max(h, w) <= 96 for h, w in seen)


@pytest.mark.slow
@pytest.mark.parametrize("flag", [[], ["--noautoanchor"]])
def test_noautoanchor_skips_the_from_scratch_anchor_check(
    flag: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beside --multi-scale: the other YOLOv5 train.py flag of this kind that users pass.
    data = make_tiny_dataset(tmp_path / "data", SyntheticSpec(num_train=4, num_val=2, max_objects=2))
    checked: list[int] = []
    monkeypatch.setattr(records, "check_anchors", lambda labels_wh, model, **kwargs: checked.append(len(labels_wh)))
    args = ["--data", str(data), "--cfg", "yolov5n", "--imgsz", "64", "--epochs", "1", "--batch-size", "2", *flag]
    train.main([*args, "--device", "cpu", "--workers", "0", "--project", str(tmp_path / "runs"), "--noplots"])
    assert len(checked) == (0 if flag else 1)


@pytest.mark.parametrize("imgsz", [64, 100, 640])
def test_largest_size_is_the_largest_any_iteration_draws(imgsz: int) -> None:
    # What AutoBatch measures at under --multi-scale: a batch that fits there fits every iteration.
    drawn = {multi_scale_size(iteration, imgsz, 32, seed=3) for iteration in range(5000)}
    assert max(drawn) == largest_size(imgsz, 32)
