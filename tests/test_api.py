"""The keyword API (train.run / val.run / detect.run / export.run) and training callbacks, in this process."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import detect
import export
import train
import val
from tests.conftest import make_tiny_dataset
from utils.callbacks import EVENTS, Callbacks, TrainEvent, load_callback_modules
from utils.cli.entry import keyword_argv
from utils.data.synthetic import SyntheticSpec
from utils.errors import ConfigError
from utils.train.config import build_train_parser

TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2)


def test_keywords_become_the_flags_the_command_line_would_give() -> None:
    parser = build_train_parser()
    argv = keyword_argv(
        parser,
        {"batch_size": 8, "cfg": "yolo11n", "cos_lr": True, "rect": False, "freeze": [1, 2], "multi_label": False,
         "cache": True, "label_smoothing": None, "img": 64},
        "train.run",
    )  # fmt: skip
    assert argv == ["--batch-size", "8", "--cfg", "yolo11n", "--cos-lr", "--freeze", "1", "2", "--no-multi-label",
                    "--cache", "--img", "64"]  # fmt: skip
    args = parser.parse_args(argv)
    assert (args.model, args.cache, args.imgsz, args.multi_label) == ("yolo11n", "ram", 64, False)
    # A value that starts with a dash is still a value (a run named -x), not a flag.
    argv = keyword_argv(parser, {"name": "-x", "seed": 7}, "train.run")
    assert argv == ["--name=-x", "--seed", "7"] and parser.parse_args(argv).name == "-x"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epoch": 3}, "train.run: unknown option 'epoch'"),
        ({"epochs": "three"}, "train.run: argument --epochs: invalid int value: 'three'"),
        ({"amp": "fp8"}, "train.run: argument --amp: invalid choice: 'fp8'"),
        ({"cos_lr": "yes"}, "train.run: cos_lr='yes' must be True or False"),
    ],
)
def test_a_bad_keyword_raises_the_command_lines_message(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        train.run(**options)


@pytest.mark.slow  # reaches run_entry (no training)
def test_checks_after_parsing_raise_too_and_leave_no_process_group(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--epochs 0 must be at least 1"):
        train.run(epochs=0, device="cpu", project=tmp_path)
    with pytest.raises(ConfigError, match="val.run: the following arguments are required: --weights"):
        val.run(data=tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="^export.run: unknown option 'format'"):
        export.run(weights="x.pt", format="onnx")
    assert not dist.is_initialized()


def test_a_callback_that_raises_is_one_warning_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def broken(event: TrainEvent) -> None:
        raise RuntimeError("tracker down")

    callbacks = Callbacks.from_mapping({"on_fit_epoch_end": [broken, lambda event: seen.append(event.epoch)]})
    with caplog.at_level(logging.WARNING):
        callbacks.fire("on_fit_epoch_end", run_dir=Path("."), options={}, epochs=3, epoch=1, row={"epoch": 1})
    assert seen == [1]
    [record] = caplog.records
    assert "broken (on_fit_epoch_end) failed, training goes on: RuntimeError: tracker down" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_callbacks_refuse_unknown_events_and_are_silent_off_rank_0() -> None:
    with pytest.raises(ConfigError, match="callback event 'on_epoch_end' is not one of on_pretrain_routine_end"):
        Callbacks.from_mapping({"on_epoch_end": print})
    seen = []
    callbacks = Callbacks.from_mapping({"teardown": seen.append})
    callbacks.enabled = False
    callbacks.fire("teardown", run_dir=Path("."), options={}, epochs=1)
    assert seen == []


def test_callback_modules_from_a_file_or_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every handler appends "<who> <event> <epoch>" to seen.txt: the test reads which ones ran, and with what.
    seen = tmp_path / "seen.txt"
    record = (
        "def record(who, event):\n"
        f"    with open({str(seen)!r}, 'a') as file:\n"
        "        file.write(f'{who} {event.name} {event.epoch}\\n')\n"
    )
    (tmp_path / "follow.py").write_text(record + "def on_train_end(event):\n    record('file', event)\n")
    (tmp_path / "run_followers").mkdir()
    (tmp_path / "run_followers" / "__init__.py").write_text("")
    (tmp_path / "run_followers" / "by_name.py").write_text(
        record + "def on_fit_epoch_end(event):\n    record('name', event)\n"
        "class Tracker:\n    def on_fit_epoch_end(self, event):\n        record('object', event)\n"
        "callbacks = [Tracker()]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    callbacks = load_callback_modules([str(tmp_path / "follow.py"), "run_followers.by_name"])
    assert sum(map(len, callbacks.handlers.values())) == 3
    for event, epoch in (("on_fit_epoch_end", 2), ("on_train_end", None), ("on_val_end", 2)):
        callbacks.fire(event, run_dir=tmp_path, options={}, epochs=2, epoch=epoch)
    # A module's functions, then its `callbacks` objects; an event reaches only its own handlers.
    assert (seen.read_text().splitlines() if seen.exists() else []) == [
        "name on_fit_epoch_end 2",
        "object on_fit_epoch_end 2",
        "file on_train_end None",
    ]
    # A file whose dataclass needs its module in sys.modules while it runs (postponed annotations).
    (tmp_path / "tracked.py").write_text(
        "from __future__ import annotations\nimport dataclasses\n"
        "@dataclasses.dataclass\nclass Seen:\n    epochs: int = 0\n"
        "def on_train_end(event):\n    pass\n"
    )
    assert load_callback_modules([str(tmp_path / "tracked.py")]).handlers["on_train_end"]
    assert not any(name.startswith("_yolo_callbacks_") for name in sys.modules)  # not left behind
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"empty.py: defines no function named like an event"):
        load_callback_modules([str(tmp_path / "empty.py")])
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match=r"broken.py: import failed: ModuleNotFoundError: No module named"):
        load_callback_modules([str(tmp_path / "broken.py")])
    with pytest.raises(ConfigError, match=r"--callbacks no.such.module: import failed"):
        load_callback_modules(["no.such.module"])


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("api"), TINY)


def _tiny(tiny_data: Path, project: Path, **extra: object) -> dict[str, object]:
    options = dict(cfg="yolov5n", data=tiny_data, imgsz=64, batch_size=4, epochs=2, workers=0, device="cpu",
                   project=project, noplots=True, seed=1)  # fmt: skip
    return {**options, **extra}


@pytest.mark.slow
def test_train_run_twice_in_one_process_with_callbacks(tiny_data: Path, tmp_path: Path) -> None:
    events: list[tuple[str, int | None]] = []
    rows: list[dict] = []

    saves: list[tuple[int | None, int | None]] = []

    def record(event: TrainEvent) -> None:
        events.append((event.name, event.epoch))
        if event.name == "on_model_save":
            saves.append((event.epoch, event.batch))

    def explode(event: TrainEvent) -> None:
        raise ValueError("a broken tracker")

    def keep_row(event: TrainEvent) -> None:
        rows.append(dict(event.row))
        event.state["seen"] = event.epoch  # kept in last.pt

    handlers = {name: [record, explode] for name in EVENTS}
    handlers["on_fit_epoch_end"].append(keep_row)
    root = logging.getLogger()
    before = (root.level, list(root.handlers), torch.get_num_threads())
    given = Callbacks.from_mapping(handlers)
    first = train.run(callbacks=given, **_tiny(tiny_data, tmp_path, save_period_steps=1))
    assert given.state == {}  # the run's state (MLflow's or W&B's run id) stays with it, not with a reused object
    assert (root.level, list(root.handlers), torch.get_num_threads()) == before
    assert not dist.is_initialized()
    names = [name for name, _ in events]
    assert names[0] == "on_pretrain_routine_end" and names[-2:] == ["on_train_end", "teardown"]
    assert [epoch for name, epoch in events if name == "on_train_epoch_start"] == [1, 2]
    assert names.count("on_val_end") == 3  # each epoch, and the final validation of best.pt
    # Every write of last.pt: after batch 1 of each epoch's 2 (--save-period-steps 1), and at each epoch's end.
    assert saves == [(1, 1), (1, None), (2, 1), (2, None)]
    with (first.run_dir / "results.csv").open() as file:
        written = list(csv.DictReader(file))
    assert [float(row["metrics/mAP50-95"]) for row in rows] == pytest.approx(
        [float(row["metrics/mAP50-95"]) for row in written], abs=1e-6
    )
    assert torch.load(first.last, weights_only=True)["callback_state"] == {"seen": 2}
    # Again in the same process, with the --callbacks flag's form (a module file): a fresh run folder.
    module = tmp_path / "ends.py"
    module.write_text("ENDED = []\ndef on_train_end(event):\n    (event.run_dir / 'ended.txt').write_text('yes')\n")
    second = train.run(callbacks=[str(module)], **_tiny(tiny_data, tmp_path, deterministic=True))
    assert not torch.are_deterministic_algorithms_enabled()  # the run's process-wide settings do not outlive it
    assert second.run_dir != first.run_dir and (second.run_dir / "ended.txt").read_text() == "yes"
    assert second.best.is_file() and first.best.is_file()
    assert set(second.metrics) == set(first.metrics)


@pytest.mark.slow
def test_val_and_detect_run_in_process(tiny_data: Path, tmp_path: Path) -> None:
    trained = train.run(**_tiny(tiny_data, tmp_path, epochs=1))
    images = tiny_data.parent / "shapes" / "images" / "val"
    for _ in range(2):
        result = val.run(weights=trained.best, data=tiny_data, imgsz=64, batch_size=4, workers=0, device="cpu",
                         project=tmp_path / "val")  # fmt: skip
        assert 0.0 <= result.as_dict()["mAP50-95"] <= 1.0
    predicted = detect.run(weights=trained.best, source=images, imgsz=64, device="cpu", project=tmp_path / "detect",
                           save_txt=True)  # fmt: skip
    assert len(list(predicted.save_dir.glob("*.jpg"))) == TINY.num_val
    assert not dist.is_initialized()
