"""Surviving interruptions: a SIGTERM mid-epoch saves and exits for requeue, and the resumed run ends bit-identical."""

from __future__ import annotations

import csv
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import make_tiny_dataset
from tests.dist_helpers import PROCESS_TIMEOUT_S
from utils.data import workers
from utils.data.synthetic import SyntheticSpec
from utils.data.workers import outlast_stop_signals
from utils.errors import Preempted
from utils.train import step as step_module
from utils.train.faults import StopSignals, find_restarted_run, mark_run
from utils.train.state import FitResult

FORK = multiprocessing.get_context("fork")  # the child shares this test's code, not a re-import
TINY = SyntheticSpec(num_train=16, num_val=4, max_objects=3, min_object_frac=0.15)


@pytest.fixture
def terminal_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal, whatever the test process was started with."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("faults"), TINY)


def _args(data: Path, project: Path, name: str, workers: int, batch: int = 4) -> list[str]:
    return [
        "--cfg", "yolov5n", "--data", str(data), "--imgsz", "64", "--batch-size", str(batch), "--epochs", "2",
        "--workers", str(workers),
        "--device", "cpu", "--project", str(project), "--name", name, "--seed", "5", "--deterministic",
        "--noplots", "--save-period", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], FitResult]:
    """Train `_args(tiny_data, ..., workers, batch)` without a stop, once per (workers, batch) in this module.

    The run is deterministic (--deterministic, one seed), so the stop signals tested on the same loader and
    batch compare their resumed runs with one uninterrupted run; each caller only reads it or copies its folder.
    """
    runs: dict[tuple[int, int], FitResult] = {}

    def run(workers: int, batch: int) -> FitResult:
        if (workers, batch) not in runs:
            project = tmp_path_factory.mktemp("faults_uninterrupted")
            runs[workers, batch] = train.main(_args(tiny_data, project, "whole", workers, batch))
        return runs[workers, batch]

    return run


def _weights(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {"model": checkpoint["model"], "ema": checkpoint["ema"]}


def _assert_identical(a: Path, b: Path) -> None:
    first, second = _weights(a), _weights(b)
    for part in ("model", "ema"):
        assert first[part].keys() == second[part].keys()
        for key, tensor in first[part].items():
            assert torch.equal(tensor, second[part][key]), f"{part}.{key} differs"


def _rows_but_time(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "results.csv").open(newline="") as file:
        return [{key: value for key, value in row.items() if key != "time_s"} for row in csv.DictReader(file)]


def _epochs(run_dir: Path) -> list[str]:
    with (run_dir / "results.csv").open(newline="") as file:
        return [row["epoch"] for row in csv.DictReader(file)]


@pytest.mark.slow
@pytest.mark.usefixtures("terminal_sigint")
@pytest.mark.parametrize(
    ("workers", "batch", "signal_after", "batches_done", "signal_name"),
    # Stop inside epoch 1 (4 batches of 4); stop at its last batch, which is short (16 images in 6 batches
    # of 3): the resumed epoch has no batch left, and its position is the epoch's end, not 6 x 3 samples.
    # A signal after the epoch's last step stops its validation: saved as the epoch's end, validated on resume.
    # SIGTERM as launchers send it; Ctrl-C as a terminal does, to the workers too.
    [(2, 4, 2, 3, "SIGTERM"), (0, 3, 5, 6, "SIGTERM"), (2, 4, 4, 4, "SIGTERM"), (2, 4, 2, 3, "SIGINT")],
)
def test_a_stop_signal_mid_epoch_then_resume_is_bit_identical(
    tiny_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
    batch: int,
    signal_after: int,
    batches_done: int,
    signal_name: str,
    caplog: pytest.LogCaptureFixture,
    uninterrupted_run: Callable[[int, int], FitResult],
) -> None:
    uninterrupted = uninterrupted_run(workers, batch)  # trained once for SIGTERM and SIGINT on 2 workers
    # The second run gets a real SIGTERM after an optimizer step (one step per batch in warmup), and so do its
    # loader workers, as torchrun (killpg) and SLURM signal them; every rank agrees on it at the next step,
    # which is then saved while the workers still serve it batches.
    steps = {"count": 0}
    real_step = step_module._optimizer_step

    def step_then_signal(state: step_module.TrainState) -> None:
        real_step(state)
        steps["count"] += 1
        if steps["count"] == signal_after:
            for child in multiprocessing.active_children():
                os.kill(child.pid, getattr(signal, signal_name))
            os.kill(os.getpid(), getattr(signal, signal_name))

    handler_before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(step_module, "_optimizer_step", step_then_signal)
    with pytest.raises(Preempted) as stopped:
        train.main(_args(tiny_data, tmp_path, "cut", workers, batch))
    monkeypatch.setattr(step_module, "_optimizer_step", real_step)
    # Its loader's workers were stopped with the run, not left to the garbage collector (5 s each there).
    assert multiprocessing.active_children() == []
    checkpoint = torch.load(stopped.value.checkpoint, map_location="cpu", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["batches_done"]) == (-1, batches_done)
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the run's handler is gone after it
    total = -(-16 // batch)
    validated = "validation of epoch 1 stopped (evaluation interrupted after 0 of 1 batches on this rank)"
    assert (validated in caplog.text) == (signal_after == total)  # no validation, so no results.csv row yet
    assert not (stopped.value.checkpoint.parent.parent / "results.csv").exists()
    caplog.set_level(logging.INFO, logger="utils.train")
    caplog.clear()
    resumed = train.main(["--resume", str(stopped.value.checkpoint), "--device", "cpu", "--workers", str(workers)])
    assert resumed.run_dir == stopped.value.checkpoint.parent.parent
    # The log says where the resumed epoch goes on; after its last batch, that nothing of it is left to train.
    assert f"in epoch 1, after its batch {batches_done}" in caplog.text
    where = f"goes on at batch {batches_done + 1}, {total - batches_done} left"
    if batches_done == total:
        where = "has no batch left: it is validated and saved, then epoch 2 starts"
    assert f"{total} batches/epoch (resumed epoch 1 {where})" in caplog.text
    assert _epochs(resumed.run_dir) == ["1", "2"]
    _assert_identical(uninterrupted.last, resumed.last)
    # Its rows too, losses, metrics and learning rates (warmup's, also of an epoch resumed with no batch left).
    assert _rows_but_time(resumed.run_dir) == _rows_but_time(uninterrupted.run_dir)
    if (batch, signal_name) != (4, "SIGTERM"):  # the resume from epoch1.pt below does not depend on where the stop
        return  # came, nor how: it resumes the shared uninterrupted run, once is enough
    # And from the end of epoch 1 (epoch1.pt of the uninterrupted run), in a copy of its folder.
    copy = tmp_path / "from-epoch1"
    shutil.copytree(uninterrupted.run_dir, copy)
    again = train.main(["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", str(workers)])
    assert _epochs(again.run_dir) == ["1", "2"]  # the row of epoch 2 was dropped and written again
    _assert_identical(uninterrupted.last, again.last)


def test_stop_signals_set_a_flag_and_restore_the_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
    stop.release_workers()  # what fit() does once its loaders are closed
    assert not workers._STOPS_HANDLED.value


def test_after_an_error_under_torchrun_one_stop_signal_lets_the_exit_finish(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun's SIGTERM to the group must not cut short a rank that is already leaving with an error."""
    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(RuntimeError), StopSignals():
        raise RuntimeError("a peer is gone")
    assert signal.getsignal(signal.SIGUSR1) is not before  # still caught while the error unwinds
    os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this process
    assert "SIGUSR1 received while exiting after an error" in caplog.text
    assert signal.getsignal(signal.SIGUSR1) is before  # a second signal acts as before
    # Outside torchrun, or without an error, the handlers come back at once.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(RuntimeError), StopSignals():
        raise RuntimeError("plain run")
    assert signal.getsignal(signal.SIGUSR1) is before


def test_restarted_job_finds_its_own_newest_run_folder(tmp_path: Path) -> None:
    for name, run_id in (("exp", "job-a"), ("exp2", "job-b"), ("exp3", "job-a"), ("other", "job-a")):
        (tmp_path / name).mkdir()
        mark_run(tmp_path / name, run_id)
    os.utime(tmp_path / "exp" / ".torchelastic_run_id", (1, 1))
    assert find_restarted_run(tmp_path, "job-a", "exp") == tmp_path / "exp3"
    assert find_restarted_run(tmp_path, "job-a", "other") == tmp_path / "other"  # only folders of the run's --name
    assert find_restarted_run(tmp_path, "job-a", "today") is None  # died before making "today": a new run
    assert find_restarted_run(tmp_path, "job-c", "exp") is None
    assert find_restarted_run(tmp_path, "", "exp") is None


def test_a_job_without_rdzv_id_never_takes_another_jobs_folder(tmp_path: Path) -> None:
    # Every torchrun job without --rdzv-id has the id "none". Yesterday's finished "exp" must not be continued by
    # today's job whose first attempt died before making its own folder; a folder this agent made is.
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / ".torchelastic_run_id").write_text("none\n1:12345\n")  # another agent's job
    (tmp_path / "exp2").mkdir()
    (tmp_path / "exp2" / ".torchelastic_run_id").write_text("none")  # written before agents were recorded
    assert find_restarted_run(tmp_path, "none", "exp") is None
    (tmp_path / "exp3").mkdir()
    mark_run(tmp_path / "exp3", "none")  # by this process's agent (its parent)
    assert find_restarted_run(tmp_path, "none", "exp") == tmp_path / "exp3"


def _signal_self_then_report(name: str, handled: bool, results: multiprocessing.Queue) -> None:
    flag = multiprocessing.RawValue(ctypes.c_bool, handled)
    outlast_stop_signals(flag)
    try:
        os.kill(os.getpid(), getattr(signal, name))
    except KeyboardInterrupt:
        results.put("KeyboardInterrupt")
        return
    results.put("alive")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_while_training_handles_stops_a_loader_worker_outlives_them(name: str) -> None:
    # A worker that gets the group's stop signal keeps serving the training process, which saves first and
    # then stops it (or, if that process dies, DataLoader's parent watchdog in the worker ends it).
    results = FORK.Queue()
    worker = FORK.Process(target=_signal_self_then_report, args=(name, True, results))
    worker.start()
    worker.join(PROCESS_TIMEOUT_S)
    assert worker.exitcode == 0 and results.get(timeout=5) == "alive"


@pytest.mark.parametrize(("name", "exitcode"), [("SIGTERM", -signal.SIGTERM), ("SIGUSR1", -signal.SIGUSR1)])
def test_at_other_times_a_stop_signal_ends_a_loader_worker_at_once(name: str, exitcode: int) -> None:
    # E.g. a failing run's exit handlers stop its daemonic workers with SIGTERM: they must not linger.
    results = FORK.Queue()
    worker = FORK.Process(target=_signal_self_then_report, args=(name, False, results))
    worker.start()
    worker.join(PROCESS_TIMEOUT_S)
    assert worker.exitcode == exitcode and results.empty()


@pytest.mark.usefixtures("terminal_sigint")
def test_at_other_times_ctrl_c_interrupts_a_loader_worker() -> None:
    results = FORK.Queue()
    worker = FORK.Process(target=_signal_self_then_report, args=("SIGINT", False, results))
    worker.start()
    worker.join(PROCESS_TIMEOUT_S)
    assert results.get(timeout=5) == "KeyboardInterrupt"


def test_stop_signals_tell_the_workers_while_entered_even_when_left_by_an_error() -> None:
    with pytest.raises(RuntimeError), StopSignals():
        assert workers._STOPS_HANDLED.value
        raise RuntimeError("a failing loop")
    assert not workers._STOPS_HANDLED.value
    with StopSignals():  # an inner loop (a fit inside a fit) gives the outer one its setting back
        with StopSignals():
            pass
        assert workers._STOPS_HANDLED.value
    assert not workers._STOPS_HANDLED.value


@pytest.mark.usefixtures("terminal_sigint")
def test_a_first_ctrl_c_asks_for_a_stop_and_a_second_interrupts() -> None:
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT" and stop._watchdog is None  # a person, not a launcher with a deadline
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # A worker may still run its handler for that stop late: the flag stays set until the loaders are closed.
    assert workers._STOPS_HANDLED.value
    stop.release_workers()
    assert not workers._STOPS_HANDLED.value


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    # A shell script's background job starts with SIGINT ignored: Ctrl-C is for the script, not for it.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_a_stop_in_a_later_epoch_with_accumulation_resumes_bit_identical(tiny_data: Path, tmp_path: Path) -> None:
    # No warmup and a nominal batch of 8 over batches of 4: one optimizer step per 2 batches from the start
    # (iterations 1, 3 | 5, 7). A stop asked for after the step at epoch 1's end is saved at epoch 2's first
    # step (batch 2 of 4): --noval, no validation to stop at in between; the resumed run must count its steps on
    # the whole epoch's 4 batches, not the 2 left.
    hyp = tmp_path / "hyp.yaml"
    source = Path(train.__file__).parent / "data" / "hyps" / "hyp.scratch-low.yaml"
    text = source.read_text().replace("warmup_epochs: 3.0", "warmup_epochs: 0.0").replace("nbs: 64", "nbs: 8")
    hyp.write_text(text)
    args = [*_args(tiny_data, tmp_path, "whole", 0), "--hyp", str(hyp), "--noval"]
    uninterrupted = train.main(args)
    real_step = step_module._optimizer_step
    steps = {"count": 0}

    def step_then_stop(state: step_module.TrainState) -> None:
        real_step(state)
        steps["count"] += 1
        if steps["count"] == 2:
            state.stop.request("SIGTERM")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "_optimizer_step", step_then_stop)
        with pytest.raises(Preempted) as stopped:
            train.main([*_args(tiny_data, tmp_path, "cut", 0), "--hyp", str(hyp), "--noval"])
    checkpoint = torch.load(stopped.value.checkpoint, map_location="cpu", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["batches_done"]) == (0, 2)
    resumed = train.main(["--resume", str(stopped.value.checkpoint), "--device", "cpu", "--workers", "0"])
    _assert_identical(uninterrupted.last, resumed.last)


@pytest.mark.slow
def test_a_resume_on_another_batch_size_trains_the_rest_of_its_epoch_once(tiny_data: Path, tmp_path: Path) -> None:
    # One optimizer step per batch of 4 (nbs 4, no warmup), 4 per epoch; a stop asked for after step 4 is saved at
    # step 5 (--noval: no validation in between to stop): epoch 2's first batch, 4 of its 16 images. With batches
    # of 2, position 1 names other images: the rest of epoch 2 must be exactly its 12 untrained images, in the
    # epoch's last 6 batches, stepping every 2 batches (nbs 4) as any epoch does.
    from utils.data.loader import TrainLoader

    hyp = tmp_path / "hyp.yaml"
    source = Path(train.__file__).parent / "data" / "hyps" / "hyp.scratch-low.yaml"
    hyp.write_text(source.read_text().replace("warmup_epochs: 3.0", "warmup_epochs: 0.0").replace("nbs: 64", "nbs: 4"))
    real_step, real_lent = step_module._optimizer_step, TrainLoader.lent
    steps, drawn, stepped = {"count": 0}, {"cut": [], "resumed": []}, []
    attempt = "cut"

    def step_then_stop(state: step_module.TrainState) -> None:
        real_step(state)
        steps["count"] += 1
        if steps["count"] == 4:
            state.stop.request("SIGTERM")

    def counted_step(state: step_module.TrainState) -> None:
        real_step(state)
        stepped.append(drawn["resumed"][-1][0])  # the epoch of the batch just trained

    def recording_lent(self: TrainLoader) -> Iterator[dict]:
        for batch in real_lent(self):
            drawn[attempt].append((self.sampler.epoch, list(batch["paths"])))
            yield batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "_optimizer_step", step_then_stop)
        patch.setattr(TrainLoader, "lent", recording_lent)
        with pytest.raises(Preempted) as stopped:
            train.main([*_args(tiny_data, tmp_path, "cut", 0), "--hyp", str(hyp), "--epochs", "3", "--noval"])
        checkpoint = torch.load(stopped.value.checkpoint, map_location="cpu", weights_only=True)
        patch.setattr(step_module, "_optimizer_step", counted_step)
        attempt = "resumed"
        resume = ["--resume", str(stopped.value.checkpoint), "--device", "cpu", "--workers", "0", "--batch-size", "2"]
        train.main(resume)
    assert (checkpoint["epoch"], checkpoint["batches_done"]) == (0, 1)
    assert checkpoint["epoch_geometry"]["per_rank_batch"] == 4 and len(checkpoint["epoch_seen"]) == 4
    trained_first = set(next(paths for epoch, paths in drawn["cut"] if epoch == 1))  # its one batch before the stop
    trained_after = [path for epoch, paths in drawn["resumed"] if epoch == 1 for path in paths]
    every = {str(path) for path in (tiny_data.parent / "shapes" / "images" / "train").glob("*.jpg")}
    assert len(trained_first) == 4 and len(every) == TINY.num_train
    assert sorted(trained_after) == sorted(every - trained_first)  # each image of the epoch exactly once
    assert [len(paths) for epoch, paths in drawn["resumed"] if epoch == 1] == [2] * 6
    assert sorted(path for epoch, paths in drawn["resumed"] if epoch == 2 for path in paths) == sorted(every)
    assert stepped == [1] * 3 + [2] * 4  # a step per 2 batches of 2, in the rest of epoch 2 as in epoch 3


@pytest.mark.slow
def test_a_remainder_stopped_again_and_resumed_on_a_third_batch_size_still_trains_each_image_once(
    tiny_data: Path, tmp_path: Path
) -> None:
    # Batches of 4 stopped early in epoch 2; resumed at batches of 2 and stopped again inside the rest; resumed at
    # batches of 8. The second checkpoint must hold everything epoch 2 trained in both attempts, and the third
    # attempt exactly the other images.
    from utils.data.loader import TrainLoader

    hyp = tmp_path / "hyp.yaml"
    source = Path(train.__file__).parent / "data" / "hyps" / "hyp.scratch-low.yaml"
    hyp.write_text(source.read_text().replace("warmup_epochs: 3.0", "warmup_epochs: 0.0").replace("nbs: 64", "nbs: 4"))
    real_step, real_lent = step_module._optimizer_step, TrainLoader.lent
    last_drawn: list[tuple[int, list[str]]] = []

    def stop_after(count: int):  # noqa: ANN202
        steps = {"count": 0}

        def step(state: step_module.TrainState) -> None:
            real_step(state)
            steps["count"] += 1
            if steps["count"] == count:
                state.stop.request("SIGTERM")

        return step

    def recording_lent(self: TrainLoader) -> Iterator[dict]:
        for batch in real_lent(self):
            last_drawn.append((self.sampler.epoch, list(batch["paths"])))
            yield batch

    def seen(path: Path) -> set[int]:
        return set(torch.load(path, map_location="cpu", weights_only=True)["epoch_seen"].tolist())

    resume = ["--device", "cpu", "--workers", "0", "--resume"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainLoader, "lent", recording_lent)
        patch.setattr(step_module, "_optimizer_step", stop_after(4))  # saved at step 5: epoch 2, batch 1 of 4
        with pytest.raises(Preempted) as first:
            train.main([*_args(tiny_data, tmp_path, "chain", 0), "--hyp", str(hyp), "--epochs", "3", "--noval"])
        first_seen = seen(first.value.checkpoint)
        patch.setattr(step_module, "_optimizer_step", stop_after(1))  # saved at the rest's second step
        with pytest.raises(Preempted) as second:
            train.main([*resume, str(first.value.checkpoint), "--batch-size", "2"])
        second_seen = seen(second.value.checkpoint)
        patch.setattr(step_module, "_optimizer_step", real_step)
        last_drawn.clear()
        train.main([*resume, str(second.value.checkpoint), "--batch-size", "8"])
    every = sorted(str(path) for path in (tiny_data.parent / "shapes" / "images" / "train").glob("*.jpg"))
    index_of = {path: index for index, path in enumerate(every)}  # the dataset's order: sorted paths
    assert len(first_seen) == 4 and first_seen < second_seen and len(second_seen) == 4 + 2 * 2 * 2
    third = [index_of[path] for epoch, paths in last_drawn if epoch == 1 for path in paths]
    assert sorted(third) == sorted(set(range(len(every))) - second_seen)  # each of the rest once, no seen one
