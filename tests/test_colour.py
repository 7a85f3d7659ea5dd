"""Tests for utils/data/colour.py: the HSV jitter in the worker (OpenCV) and on the device (torch) agree."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from utils.data.augment import AugmentParams
from utils.data.batch import collate_batch, images_on_device, to_model_input
from utils.data.colour import IDENTITY_GAINS, apply_hsv, draw_hsv_gains, hsv_jitter
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
from utils.distributed import DistContext
from utils.plots import batch_drawer

CTX = DistContext()
GAINS = [(1.0, 1.0, 1.0), (1.015, 1.7, 1.4), (0.985, 0.3, 0.6), (1.5, 1.2, 0.8), (0.6, 1.0, 1.0)]


def _colourful(seed: int, height: int = 48, width: int = 64) -> np.ndarray:
    """A smooth BGR image over the whole colour range (blurred noise, stretched to 0..255)."""
    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return cv2.normalize(cv2.GaussianBlur(noise, (7, 7), 3), None, 0, 255, cv2.NORM_MINMAX)


def _to_float_rgb(images_bgr: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack([image[:, :, ::-1].transpose(2, 0, 1) for image in images_bgr])).float() / 255


def test_apply_hsv_changes_colours_by_drawn_gains_in_place() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    original = image.copy()
    gains = np.random.default_rng(5).uniform(-1, 1, 3) * [0.0, 0.0, 0.4] + 1
    out = apply_hsv(image, draw_hsv_gains(np.random.default_rng(5), 0.0, 0.0, 0.4))
    assert out is image and out.shape == (40, 50, 3) and out.dtype == np.uint8
    value_before = cv2.cvtColor(original, cv2.COLOR_BGR2HSV)[:, :, 2].astype(float)
    value_after = cv2.cvtColor(out, cv2.COLOR_BGR2HSV)[:, :, 2].astype(float)
    expected = np.clip(value_before * gains[2], 0, 255)
    assert np.abs(value_after - np.floor(expected)).max() <= 2
    colourful = apply_hsv(original.copy(), draw_hsv_gains(np.random.default_rng(1), 0.5, 0.7, 0.4))
    assert np.abs(colourful.astype(int) - original).mean() > 5
    assert draw_hsv_gains(rng, 0.0, 0.0, 0.0) is None  # no gains: nothing to apply (the dataset skips it)
    strided = original.copy()[:, ::-1]  # a view OpenCV cannot write into directly
    flip_gains = draw_hsv_gains(np.random.default_rng(2), 0.5, 0.7, 0.4)
    expected_flipped = apply_hsv(np.ascontiguousarray(strided), flip_gains)
    assert apply_hsv(strided, flip_gains) is strided
    np.testing.assert_array_equal(strided, expected_flipped)
    rgb = apply_hsv(original.copy(), flip_gains, to_rgb=True)  # the same change, written in RGB order
    np.testing.assert_array_equal(rgb, apply_hsv(original.copy(), flip_gains)[:, :, ::-1])


@pytest.mark.parametrize("gains", GAINS)
def test_device_jitter_matches_the_worker_path_to_its_rounding(gains: tuple[float, float, float]) -> None:
    image = _colourful(0)
    expected = apply_hsv(image.copy(), np.array(gains))[:, :, ::-1].astype(np.float32)
    out = hsv_jitter(_to_float_rgb([image]), torch.tensor([gains]))[0].permute(1, 2, 0).numpy() * 255
    difference = np.abs(out - expected)
    # OpenCV's uint8 round trip alone (gains 1) moves pixels by up to 3 levels, 0.4 on average.
    assert difference.mean() < 1.5 and np.percentile(difference, 99) <= 8, (difference.mean(), difference.max())
    assert np.abs(out - image[:, :, ::-1]).mean() > 5 or gains == (1.0, 1.0, 1.0)  # the jitter did something


def test_device_jitter_per_image_gains_grey_and_identity() -> None:
    images = _to_float_rgb([_colourful(1), _colourful(2)])
    out = hsv_jitter(images, torch.tensor([IDENTITY_GAINS, (1.0, 1.0, 0.5)]))
    torch.testing.assert_close(out[0], images[0], atol=1e-5, rtol=0)  # identity gains: unchanged
    torch.testing.assert_close(out[1], images[1] * 0.5, atol=1e-5, rtol=0)  # value gain scales every channel
    grey = torch.full((1, 3, 4, 4), 0.4)
    torch.testing.assert_close(hsv_jitter(grey, torch.tensor([(1.4, 1.7, 1.0)])), grey)  # no hue, no saturation
    assert hsv_jitter(torch.ones(1, 3, 2, 2), torch.tensor([(1.0, 1.0, 2.0)])).max() == 1  # clipped to white
    with pytest.raises(ValueError, match="do not match"):
        hsv_jitter(images, torch.ones(3, 3))


def test_device_jitter_keeps_the_layout_and_dtype_and_is_finite_in_half_precision() -> None:
    images = _to_float_rgb([_colourful(3), _colourful(4)]).contiguous()
    gains = torch.tensor([(1.01, 1.5, 0.7), (0.99, 0.4, 1.3)])
    plain = hsv_jitter(images, gains)
    nhwc = hsv_jitter(images.contiguous(memory_format=torch.channels_last), gains)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and plain.is_contiguous()
    torch.testing.assert_close(nhwc, plain)
    black = torch.zeros((1, 3, 4, 4), dtype=torch.float16)  # value 0: the guarded divisions
    half = hsv_jitter(black, torch.tensor([(1.02, 1.6, 1.4)], dtype=torch.float16))
    assert half.dtype == torch.float16 and torch.isfinite(half).all() and not half.any()
    half = hsv_jitter(images.half(), gains.half())
    torch.testing.assert_close(half.float(), plain, atol=2e-3, rtol=0)


def test_draw_hsv_gains_ranges_and_no_draw_without_gains() -> None:
    rng = np.random.default_rng(0)
    draws = np.stack([draw_hsv_gains(rng, 0.015, 0.7, 0.4) for _ in range(500)])
    assert np.all(np.abs(draws - 1) <= [0.015, 0.7, 0.4]) and np.all(np.abs(draws - 1).max(0) > [0.014, 0.6, 0.3])
    state = rng.bit_generator.state
    assert draw_hsv_gains(rng, 0.0, 0.0, 0.0) is None and rng.bit_generator.state == state


def _dataset(
    root: Path, hsv_on_device: bool, hsv: tuple[float, float, float] = (0.015, 0.7, 0.4)
) -> LoadImagesAndLabels:
    images, labels = root / "images", root / "labels"
    if not images.is_dir():
        images.mkdir(parents=True)
        labels.mkdir()
        for i in range(6):
            cv2.imwrite(str(images / f"{i}.png"), _colourful(10 + i, 60, 80))
            (labels / f"{i}.txt").write_text(f"{i % 2} 0.5 0.5 0.4 0.3\n")
    aug = AugmentParams(hsv_h=hsv[0], hsv_s=hsv[1], hsv_v=hsv[2], degrees=5, mixup=0.5)
    options = DatasetOptions(
        img_size=64, num_classes=2, workers=1, augment=True, aug=aug, hsv_on_device=hsv_on_device, seed=4
    )
    return LoadImagesAndLabels(images, options, CTX)


def test_dataset_defers_the_jitter_to_the_device_with_the_same_draws(tmp_path: Path) -> None:
    in_worker, deferred = _dataset(tmp_path, False), _dataset(tmp_path, True)
    keys = [(i, epoch) for i in range(6) for epoch in (0, 1)]
    items_worker, items_deferred = [in_worker[key] for key in keys], [deferred[key] for key in keys]
    for item_worker, item_deferred in zip(items_worker, items_deferred, strict=True):
        assert "hsv" not in item_worker and item_deferred["hsv"].shape == (3,)
        torch.testing.assert_close(item_deferred["labels"], item_worker["labels"])  # the same geometry draws
    batch = collate_batch(items_deferred)
    assert batch["hsv_gains"].shape == (len(keys), 3) and "hsv_gains" not in collate_batch(items_worker)
    cpu = torch.device("cpu")
    on_device = images_on_device(batch, cpu)
    expected = to_model_input(collate_batch(items_worker)["images"], cpu)
    assert on_device.dtype == torch.float32 and on_device.shape == expected.shape == (len(keys), 3, 64, 64)
    assert on_device.is_contiguous(memory_format=torch.channels_last)  # the model's layout, jitter or not
    difference = (on_device - expected).abs() * 255
    unjittered = (to_model_input(batch["images"], cpu, bgr=True) - expected).abs() * 255
    assert difference.mean() < 1.5 < unjittered.mean(), (difference.mean(), unjittered.mean())


def test_no_hsv_gains_give_identity_gains_on_the_device(tmp_path: Path) -> None:
    item = _dataset(tmp_path, True, hsv=(0.0, 0.0, 0.0))[(0, 0)]
    assert item["hsv"].tolist() == list(IDENTITY_GAINS)
    in_worker = _dataset(tmp_path, False, hsv=(0.0, 0.0, 0.0))[(0, 0)]["image"]
    assert torch.equal(item["image"].flip(-1), in_worker)  # left BGR for the device; made RGB in the worker


def test_train_batch_plot_shows_the_deferred_jitter(tmp_path: Path) -> None:
    batch = collate_batch([_dataset(tmp_path, True)[(i, 0)] for i in range(4)])
    plain = {key: value for key, value in batch.items() if key != "hsv_gains"}
    for name, drawn in (("jittered", batch), ("plain", plain)):
        batch_drawer(tmp_path / name, ["a", "b"])(0, drawn)
    jittered, unjittered = (cv2.imread(str(tmp_path / name / "train_batch0.jpg")) for name in ("jittered", "plain"))
    assert jittered.shape == unjittered.shape and np.abs(jittered.astype(int) - unjittered).mean() > 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_images_on_device_jitters_on_cuda_as_on_cpu(tmp_path: Path) -> None:
    batch = collate_batch([_dataset(tmp_path, True)[(i, 0)] for i in range(4)])
    on_gpu = images_on_device({**batch, "images": batch["images"].pin_memory()}, torch.device("cuda"))
    torch.testing.assert_close(on_gpu.cpu(), images_on_device(batch, torch.device("cpu")), atol=1e-5, rtol=0)
