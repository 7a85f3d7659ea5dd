"""Shared test helpers: tiny built-in-style datasets generated under a temporary folder."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import torch.distributed
import yaml

import utils.cli.entry
import utils.cpus
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset


def make_tiny_dataset(root: Path, spec: SyntheticSpec) -> Path:
    """Generate a shapes dataset with `spec` under `root/shapes` and return the path of its dataset YAML."""
    ensure_synthetic_dataset(root / "shapes", spec)
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(
        yaml.safe_dump({"path": "shapes", "train": "images/train", "val": "images/val", "names": list(SHAPE_NAMES)})
    )
    return yaml_file


class MessageRecorder(logging.Handler):
    """Keeps the INFO-and-above messages of the logger it is added to (runs set up their own logging)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def compile_without_codegen() -> Iterator[list[str | None]]:
    """Within: torch.compile uses the aot_eager backend and records each call's mode in the yielded list.

    Dynamo still captures the graph and AOTAutograd its backward, as for inductor, but no C++ is
    generated: inductor takes about a minute on 2 cores even for yolov5n, which the suite cannot pay.
    """
    real_compile = torch.compile
    modes: list[str | None] = []

    def compile_(model: torch.nn.Module, **options: object) -> torch.nn.Module:
        modes.append(options.get("mode"))  # type: ignore[arg-type]
        return real_compile(model, backend="aot_eager", **options)  # type: ignore[arg-type]

    torch.compile = compile_  # type: ignore[assignment]
    try:
        yield modes
    finally:
        torch.compile = real_compile


@pytest.fixture(autouse=True)
def no_cgroup_cpu_quota(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """In-process tests see CPUs as the affinity says, whatever CPU quota the machine running them has.

    Tests that fake the affinity (`os.sched_getaffinity`) expect worker and pool sizes from it alone;
    tests/test_cpus.py passes its own cgroup files. Spawned processes read the real cgroup.
    """
    monkeypatch.setattr(utils.cpus, "PROC", tmp_path_factory.getbasetemp() / "no-such-proc")


@pytest.fixture(autouse=True)
def stop_signal_handlers_restored() -> Iterator[None]:
    """Each test ends with the SIGTERM / SIGINT handlers it started with.

    A run that fails under torchrun (TORCHELASTIC_RUN_ID set) deliberately leaves handlers that let its exit
    finish, since its process ends next; in pytest's process they would reach whichever test runs after it.
    """
    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in saved.items():
        if signal.getsignal(number) is not handler:
            signal.signal(number, handler)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's model-heavy tests on one intra-op thread, restoring the previous count after.

    Two threads on a loaded 2-core machine made single yolov5n steps up to 20x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> object:
    """tests/exports.py's Exports: random checkpoints of the named models exported once per session (read-only)."""
    from tests.exports import Exports  # imported here: most modules export nothing

    return Exports(tmp_path_factory)


def tiny_val_argv(weights: Path, data: Path, project: Path, *extra: str) -> list[str]:
    """val.py / segment/val.py flags that validate `weights` on a tiny dataset as its training run did.

    Training on the tiny sets validates 64 px images with a global batch of 2 x 8 = 16 rect batches;
    the same batch gives the same padding and so the same numbers.
    """
    return ["--weights", str(weights), "--data", str(data), "--imgsz", "64", "--batch-size", "16",
            "--workers", "0", "--device", "cpu", "--project", str(project), *extra]  # fmt: skip


def _refuse(item: pytest.Item, what: str, marker: str, why: str) -> Callable[..., NoReturn]:
    """A stand-in for `what` that fails `item`, telling the author to mark it `marker`."""

    def refused(*args: object, **kwargs: object) -> NoReturn:
        pytest.fail(
            f"{item.nodeid} called {what} but is not marked {marker}: {why}, so add "
            f"@pytest.mark.{marker} (or a module-level pytestmark) to keep it out of "
            f'the fast `pytest -m "not slow and not distributed"` run'
        )

    return refused


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Enforce the markers for the whole of each test, its (module-scoped) fixtures' set-up and teardown included.

    Not marked `distributed`: `torch.distributed.init_process_group` fails the test (the attribute is
    patched on the module, so the library's `dist.init_process_group` is caught; single-process
    `init_distributed()` never calls it). Not marked `slow`: `utils.cli.entry.run_entry`, which
    train.py, val.py, segment/train.py and segment/val.py's main() all run through, fails the test.
    Spawned processes start fresh interpreters, so `distributed` tests' children are unaffected.
    """
    with pytest.MonkeyPatch.context() as patch:
        if item.get_closest_marker("distributed") is None and torch.distributed.is_available():
            why = "tests that start a process group (or spawn processes) are marked distributed"
            patch.setattr(
                torch.distributed,
                "init_process_group",
                _refuse(item, "torch.distributed.init_process_group", "distributed", why),
            )
        if item.get_closest_marker("slow") is None:
            why = "tests that run train.py / val.py / segment/train.py / segment/val.py end to end are marked slow"
            patch.setattr(
                utils.cli.entry,
                "run_entry",
                _refuse(item, "a train/val entry point (utils.cli.entry.run_entry)", "slow", why),
            )
        return (yield)
