"""DevicePrefetcher hands out exactly the batches the plain path would, in order, on CPU and (when present) CUDA;
WaitTimer counts the time spent waiting for them."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import utils.train.prefetch as prefetch
from utils.train.prefetch import DevicePrefetcher, WaitTimer


def _batches(count: int, pin: bool = False) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(count):
        images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator)
        targets = torch.rand((3 + i, 6), generator=generator)
        if pin:
            images, targets = images.pin_memory(), targets.pin_memory()
        batches.append({"images": images, "targets": targets, "paths": [f"{i}a.jpg", f"{i}b.jpg"]})
    return batches


def _mover(device: torch.device):
    def to_device(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        images = batch["images"].to(device, non_blocking=True).float() / 255
        return {"images": images, "targets": batch["targets"].to(device, non_blocking=True)}

    return to_device


def _check_against_plain_path(batches: list[dict[str, Any]], device: torch.device) -> None:
    prefetched = list(DevicePrefetcher(batches, _mover(device), device))
    assert [id(batch) for batch, _ in prefetched] == [id(batch) for batch in batches]  # the host batches, in order
    for batch, on_device in prefetched:
        assert on_device["images"].device.type == device.type
        torch.testing.assert_close(on_device["images"].cpu(), batch["images"].float() / 255, rtol=0, atol=0)
        torch.testing.assert_close(on_device["targets"].cpu(), batch["targets"], rtol=0, atol=0)


@pytest.mark.parametrize("count", [0, 1, 5])
def test_on_cpu_every_batch_comes_with_its_device_tensors(count: int) -> None:
    _check_against_plain_path(_batches(count), torch.device("cpu"))


def test_the_loader_is_read_lazily_on_cpu() -> None:
    """A batch is taken from the loader only when it is asked for (nothing read ahead off CUDA)."""
    taken: list[int] = []

    def loader():
        for i, batch in enumerate(_batches(3)):
            taken.append(i)
            yield batch

    iterator = iter(DevicePrefetcher(loader(), _mover(torch.device("cpu")), torch.device("cpu")))
    next(iterator)
    assert taken == [0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_side_stream_copies_equal_the_plain_path() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    batches = _batches(6, pin=True)
    prefetched = []
    for batch, on_device in DevicePrefetcher(batches, _mover(device), device):
        busy = torch.randn(2048, 2048, device=device)
        for _ in range(5):  # keep the training stream busy while the next batch is copied on the side stream
            busy = busy @ busy / 2048
        prefetched.append((batch, {key: value.clone() for key, value in on_device.items()}))
    torch.cuda.synchronize(device)
    assert [id(batch) for batch, _ in prefetched] == [id(batch) for batch in batches]
    for batch, on_device in prefetched:
        images = on_device["images"].cpu()
        # The copy is exact: every pixel reads back as its uint8 value. The division by 255 ran on the GPU, whose
        # float32 division may differ from the CPU's in the last bit (6e-8 seen on an H200): a few ulps at 1.0.
        assert torch.equal((images * 255).round().to(torch.uint8), batch["images"])
        torch.testing.assert_close(images, batch["images"].float() / 255, rtol=0, atol=5e-7)
        torch.testing.assert_close(on_device["targets"].cpu(), batch["targets"], rtol=0, atol=0)


def test_wait_timer_counts_time_in_next_and_not_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that moves only when producer or consumer says so: the sums are exact, however loaded the machine.
    now = [0.0]
    monkeypatch.setattr(prefetch, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def slow_source() -> Iterator[int]:
        for value in range(3):
            now[0] += 0.05  # the producer: counted
            yield value

    timer = WaitTimer(slow_source())
    seen = []
    for value in timer:
        seen.append(value)
        now[0] += 0.1  # the consumer's step: not counted
    assert seen == [0, 1, 2]
    assert timer.seconds == pytest.approx(0.15)  # counting the consumer would make it 0.45
    again = list(timer)  # a second pass over a list-like source adds to the same total
    assert again == [] and timer.seconds == pytest.approx(0.15)


def test_wait_timer_passes_a_failure_of_the_source_on() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise OSError("disk gone")

    timer = WaitTimer(failing())
    with pytest.raises(OSError, match="disk gone"):
        list(timer)
