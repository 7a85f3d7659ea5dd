"""tune.py: search-space files, the study's trials (complete, pruned, failed, interrupted, lost), resume, two workers.

Most tests run trials with tests/fake_trainer.py in place of train.py (a trial costs one Python start);
the `slow` ones run real tiny trainings or drive tune.py as a process and stop or kill it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import yaml

optuna = pytest.importorskip("optuna", reason="tune.py's tests need the optional optuna package")

import train  # noqa: E402
import tune  # noqa: E402
from tests.conftest import make_tiny_dataset  # noqa: E402
from utils.cli.entry import keyword_argv  # noqa: E402
from utils.config import ROOT  # noqa: E402
from utils.data.synthetic import SyntheticSpec  # noqa: E402
from utils.errors import ConfigError, StudyFailed  # noqa: E402
from utils.hyp import load_hyp  # noqa: E402
from utils.train.config import build_train_parser  # noqa: E402
from utils.train.records import FAMILY_TRAINING  # noqa: E402
from utils.tune import study as study_module  # noqa: E402
from utils.tune import tuner  # noqa: E402
from utils.tune.config import tune_config_from_argv  # noqa: E402
from utils.tune.space import load_space  # noqa: E402
from utils.tune.study import distributions as space_dists  # noqa: E402
from utils.tune.trial import COMPLETE, FAILED, PRUNED, TrialCommand, TrialWatch, run_trial  # noqa: E402

FAKE = Path(__file__).with_name("fake_trainer.py")
ANCHOR_FREE_SHORT = ROOT / "data/hyps/hyp.anchor-free.quickstart.yaml"
TINY = SyntheticSpec(num_train=8, num_val=4, min_side=64, max_side=96, max_objects=3)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("tune"), TINY)


@pytest.fixture
def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials run tests/fake_trainer.py, quickly, unless a test says otherwise."""
    monkeypatch.setitem(tuner.TRAIN_SCRIPTS, "detect", FAKE)
    monkeypatch.setattr(tuner, "POLL_S", 0.05)
    monkeypatch.setenv("FAKE_EPOCH_S", "0.02")
    monkeypatch.delenv("FAKE_TRAINER", raising=False)


def _flags(data: Path, project: Path, **extra: object) -> dict[str, object]:
    options = dict(cfg="yolov8n", data=data, imgsz=64, batch_size=4, epochs=3, workers=0, device="cpu",
                   project=project, trials=4, seed=3, noplots=True)  # fmt: skip
    return {**options, **extra}


def _study(project: Path, name: str = "exp") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{project / name / 'study.db'}")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- search spaces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("lr00: [0.1, 1]", r"'lr00' is not a hyperparameter"),
        ("obj: [0.5, 2]", r"'obj' is not read by this model family's loss \(its own keys: dfl\)"),
        ("lr0: [0.1]", r"'lr0' must be 'fixed' or \[low, high\]"),
        ("lr0: [0.1, 0.01]", r"'lr0': low 0.1 must be below high 0.01"),
        ("lr0: [0.0, 0.1, log]", r"'lr0': a log scale needs bounds above 0"),
        ("lr0: [0.1, 0.2, cubic]", r"'lr0': scale 'cubic' is not one of linear, log, int"),
        ("nbs: [8.5, 64, int]", r"'nbs': an int scale needs whole-number bounds"),
        ("lr0: [x0.1, xten]", r"'lr0': bound 'xten' must be a finite number or xF"),
        ("lr0: [x0.5, xinf, log]", r"'lr0': bound 'xinf' must be a finite number or xF"),
        ("lr0: [xnan, x2]", r"'lr0': bound 'xnan' must be a finite number or xF"),
        ("lr0: [a, 1]", r"'lr0': bound 'a' must be a finite number"),
        ("lr0: fixed", r"every key is fixed"),
        ("lr0: [-0.01, -0.001]", r"'lr0': bounds \[-0.01, -0.001\] must be above 0"),
        ("mosaic: [0.5, 3.0]", r"'mosaic': bounds \[0.5, 3\] leave its range \[0, 1\]"),
        ("degrees: [-5, 5]", r"'degrees': bounds \[-5, 5\] must be 0 or more"),
        (
            "lr0: [0.001, 0.01]\nmixup: [0, 0.2]\nlr0: [0.01, 0.1]",
            r"not valid YAML \(key 'lr0' given twice, the second",
        ),
    ],
)
def test_a_bad_search_space_is_one_line_naming_the_file_and_key(tmp_path: Path, entry: str, message: str) -> None:
    space = _write(tmp_path / "space.yaml", entry + "\n")
    with pytest.raises(ConfigError, match=str(space).replace(".", r"\.") + ": .*" + message) as error:
        load_space(space, load_hyp(ANCHOR_FREE_SHORT), ("dfl",))
    assert "\n" not in str(error.value)


def test_relative_bounds_scale_with_the_base_recipe_and_other_keys_stay_fixed(tmp_path: Path) -> None:
    base = load_hyp(ANCHOR_FREE_SHORT)
    space = load_space(_write(tmp_path / "s.yaml", "lr0: [x0.5, x4, log]\nnbs: [8, 32, int]\nmixup: fixed\n"), base,
                       ("dfl",))  # fmt: skip
    assert space.keys == ("lr0", "nbs")
    lr0 = space.dimensions[0]
    assert (lr0.low, lr0.high, lr0.scale) == pytest.approx((0.5 * base.lr0, 4 * base.lr0, "log"))
    hyp = space.hyp_for({"lr0": 0.003, "nbs": 24})
    assert (hyp.lr0, hyp.nbs, hyp.mixup, hyp.box) == (0.003, 24.0, base.mixup, base.box)
    assert space.base_params == {"lr0": base.lr0, "nbs": base.nbs} and space.base_inside() == []


@pytest.mark.parametrize("family", sorted(FAMILY_TRAINING))
def test_each_familys_space_lists_every_key_its_hyp_has_and_holds_both_recipes(family: str) -> None:
    record = FAMILY_TRAINING[family]
    listed = set(yaml.safe_load(record.search_space.read_text()))
    for recipe in (record.recipe_files.short, record.recipe_files.long):
        base = load_hyp(recipe)
        assert listed == set(base.to_dict()), recipe
        space = load_space(record.search_space, base, record.hyp_keys)
        assert space.base_inside() == [], f"{recipe}'s values must be a point of the space (the first trial)"


# --- options ---------------------------------------------------------------------------------------


def test_train_flags_pass_to_trials_and_the_tuner_keeps_its_own() -> None:
    argv = ["--cfg", "yolov8n", "--epochs", "5", "--imgsz", "64", "--cache", "ram", "--trials", "7", "--project", "p",
            "--name", "s", "--hyp", str(ANCHOR_FREE_SHORT), "--no-channels-last"]  # fmt: skip
    cfg = tune_config_from_argv(argv)
    assert cfg.trials == 7 and cfg.study_dir == Path("p/s")
    words = list(cfg.train_argv)
    for flag, value in (("--cfg", "yolov8n"), ("--epochs", "5"), ("--imgsz", "64"), ("--cache", "ram")):
        assert words[words.index(flag) + 1] == value
    assert "--no-channels-last" in words
    assert not {"--trials", "--project", "--name", "--hyp"} & set(words)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trials", "0"], r"--trials 0 must be at least 1"),
        (["--resume"], r"--resume is train.py's: run the same tune command again"),
        (["--noval"], r"--noval leaves no per-epoch mAP to prune on"),
        (["--batch-size", "-1"], r"^--batch-size -1 \(AutoBatch\) would give trials on other GPUs other batches"),
        (["--evolve", "3"], r"^--evolve is train.py's spelling of tune.py; tune.py takes the number of trials as"),
    ],
)
def test_study_flags_that_cannot_work_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tune_config_from_argv(argv)


def test_a_storage_url_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    from utils.tune.study import open_storage

    cfg = tune_config_from_argv(["--storage", "foo://bar", "--project", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^--storage foo://bar: cannot open it \(NoSuchModuleError: ") as error:
        open_storage(cfg)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["folder", "sqlite", "text"])
def test_a_storage_file_that_is_no_journal_is_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "store"
    if kind == "folder":
        path.mkdir()
    elif kind == "sqlite":
        optuna.create_study(storage=f"sqlite:///{path}", study_name="exp")
    else:
        path.write_bytes(b"\xff\xfe not json lines\n")
    cfg = tune_config_from_argv(["--storage", str(path), "--project", str(tmp_path / "p"), "--cfg", "yolov8n"])
    want = {"folder": "a folder; give a journal file", "sqlite": f"an SQLite database, not a journal file; give "
            f"sqlite:///{path}", "text": "not an Optuna journal file"}[kind]  # fmt: skip
    with pytest.raises(ConfigError, match=f"^--storage {path}: {want}") as error:
        study_module.open_study(cfg, load_space(ROOT / "data/hyps/space.anchor-free.yaml",
                                                load_hyp(ANCHOR_FREE_SHORT), ("dfl",)), {})  # fmt: skip
    assert "\n" not in str(error.value)


def _running_trial(study: optuna.Study, **attrs: object) -> int:
    """A RUNNING trial with these user attributes, as another worker would leave it (none: it never named itself)."""
    trial = study.ask()
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    return trial.number


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_lost_trials_are_those_whose_worker_died_in_this_pid_space_or_went_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s")
    now, dead = time.time(), _dead_pid()
    same_space = _running_trial(study, worker="h:1:a", pid=dead, pid_space=study_module.PID_SPACE, heartbeat=now)
    # The same pid in another PID namespace (a container sharing the host name) says nothing of that worker.
    other_space = _running_trial(study, worker="h:1:b", pid=dead, pid_space="elsewhere", heartbeat=now)
    silent = _running_trial(study, worker="h:2:c", heartbeat=now - 2 * study_module.STALE_AFTER_S)
    unnamed = _running_trial(study)  # its tuner failed between creating it and naming itself
    mine = study.ask()
    study_module.mark_worker(mine)
    lost = {same_space, silent}
    study_module.fail_lost_trials(study)
    states = {t.number: study_module.state_name(t) for t in study.get_trials()}
    assert {n for n, state in states.items() if state == "lost"} == lost
    assert states[other_space] == states[unnamed] == states[mine.number] == "running"
    monkeypatch.setattr(study_module, "STALE_AFTER_S", -1.0)  # now every other worker's trial is silent
    study_module.fail_lost_trials(study)
    states = {t.number: study_module.state_name(t) for t in study.get_trials()}
    assert states[other_space] == states[unnamed] == "lost" and states[mine.number] == "running"
    assert study_module.WORKER != f"{socket.gethostname()}:{os.getpid()}", "a host:pid alone is used again"


def test_a_lost_trial_another_worker_just_ended_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two tuners look for lost trials at once: the other one marks (or its worker ends) the trial after this
    # one read it as running. The late look must not raise, or its worker would stop.
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s")
    number = _running_trial(study, worker="h:3:d", heartbeat=0.0)
    snapshot = study.get_trials(deepcopy=True)
    study.tell(number, 0.5)
    monkeypatch.setattr(study, "get_trials", lambda *args, **kwargs: snapshot)
    study_module.fail_lost_trials(study)
    assert optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}").trials[0].value == 0.5


def test_a_worker_that_stops_on_an_error_fails_the_study_in_one_line(
    tiny_data: Path, tmp_path: Path, fake_trainer: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked, calls = tuner.ask_next, []

    def ask_once(*args: object) -> object:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the storage went away\nsecond line")
        return asked(*args)

    monkeypatch.setattr(tuner, "ask_next", ask_once)
    with pytest.raises(StudyFailed, match=r"^study 'exp' has 1 of its 3 trials: a worker stopped on RuntimeError: "
                                          r"the storage went away; run the same command") as error:  # fmt: skip
        tune.run(**_flags(tiny_data, tmp_path, trials=3))
    assert "\n" not in str(error.value)
    assert len((tmp_path / "exp" / "trials.csv").read_text().splitlines()) == 2  # the results are still written


def test_a_tuner_joining_a_finished_journal_study_writes_its_own_results(
    tiny_data: Path, tmp_path: Path, fake_trainer: None
) -> None:
    journal = str(tmp_path / "study.journal")
    tune.run(**_flags(tiny_data, tmp_path / "a", trials=2, storage=journal))
    summary = tune.run(**_flags(tiny_data, tmp_path / "b", trials=2, storage=journal))  # runs no trial
    assert summary.counts == {"complete": 2}
    assert len((tmp_path / "b" / "exp" / "trials.csv").read_text().splitlines()) == 3


def test_train_evolve_is_tune_with_that_many_trials_in_runs_evolve() -> None:
    from utils.cli.tune import evolve_argv

    assert evolve_argv(["--epochs", "3"], "detect") is None
    words = evolve_argv(["--evolve", "5", "--epochs", "3", "--cfg", "yolov8n"], "detect")
    assert words[-2:] == ["--trials", "5"] and "--evolve" not in words
    assert words[words.index("--project") + 1] == str(ROOT / "runs" / "evolve")
    assert evolve_argv(["--evolve"], "segment")[-2:] == ["--trials", "300"]
    # Bad input is refused in train.py's words, not as tune.py's --trials or "the tune command".
    with pytest.raises(ConfigError, match=r"^--evolve -3: give the number of trials, at least 1"):
        evolve_argv(["--evolve", "-3"], "detect")
    with pytest.raises(ConfigError, match=r"^--resume with --evolve: run the same train.py --evolve command again"):
        evolve_argv(["--evolve", "2", "--resume"], "detect")


def test_ray_without_ray_tune_is_one_line_before_any_work(tiny_data: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "ray.tune", None)  # `import ray.tune` now raises ImportError
    with pytest.raises(ConfigError, match=r"^--ray needs Ray Tune: pip install 'ray\[tune\]'$"):
        tune.run(**_flags(tiny_data, tmp_path, ray="local"))
    assert not (tmp_path / "exp").exists()


def test_tune_refuses_to_run_under_torchrun(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"runs without torchrun; --nproc-per-trial K"):
        tune.run(**_flags(tiny_data, tmp_path))


# --- studies with the fake trainer -------------------------------------------------------------------


def test_a_study_runs_its_trials_and_writes_what_a_person_reads(tiny_data: Path, tmp_path: Path,
                                                                 fake_trainer: None) -> None:  # fmt: skip
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=5, pruner="none", noplots=False))
    study_dir = tmp_path / "exp"
    study = _study(tmp_path)
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 5
    base = load_hyp(ANCHOR_FREE_SHORT)  # 8 images x 3 epochs: --optimizer auto picks AdamW's recipe
    assert trials[0].user_attrs["baseline"] and trials[0].params["lr0"] == base.lr0
    assert len({t.params["lr0"] for t in trials}) == 5
    argv = json.loads((study_dir / "trials" / "trial_0002" / "argv.json").read_text())
    for flag, value in (("--imgsz", "64"), ("--optimizer", "AdamW"), ("--name", "trial_0002"), ("--device", "cpu")):
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--callbacks") + 1] == "utils.tune.report"
    trial_hyp = load_hyp(Path(argv[argv.index("--hyp") + 1]))
    assert trial_hyp.lr0 == trials[2].params["lr0"] and trial_hyp.nbs == base.nbs
    best = max(trials, key=lambda t: t.value)
    assert summary.best_number == best.number and summary.best_fitness == best.value
    assert summary.baseline_fitness == trials[0].value
    assert load_hyp(study_dir / "best_hyp.yaml").lr0 == pytest.approx(best.params["lr0"])
    # The study's optimizer: the hyp file alone would pick one by its lr0, perhaps the other.
    assert (
        f"python train.py --hyp {study_dir / 'best_hyp.yaml'} --optimizer AdamW ("
        in (study_dir / "best_hyp.yaml").read_text()
    )
    rows = (study_dir / "trials.csv").read_text().splitlines()
    assert len(rows) == 6 and rows[0].startswith("trial,state,mAP50-95,epochs,seconds,baseline,worker,reason,run_dir")
    kept = sorted(p.parent.name for p in (study_dir / "trials").glob("*/weights"))
    assert kept == [f"trial_{best.number:04d}"], "only the best trial keeps its weights"
    assert (study_dir / "tune_fitness.png").stat().st_size > 0 and (study_dir / "tune_params.png").stat().st_size > 0
    assert summary.line("mAP50-95").startswith("tune: 5 trials (5 complete); best trial ")


def test_crashes_oom_and_nan_are_failed_trials_with_reasons_and_the_study_finishes(
    tiny_data: Path, tmp_path: Path, fake_trainer: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes = {"trial_0001": "crash", "trial_0002": "oom", "trial_0003": "nan", "trial_0004": "refused"}
    monkeypatch.setenv("FAKE_TRAINER", json.dumps(modes))
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=6))
    trials = _study(tmp_path).get_trials()
    states = [t.state.name for t in trials]
    assert states == ["COMPLETE", "FAIL", "FAIL", "FAIL", "FAIL", "COMPLETE"]
    reasons = [t.user_attrs.get("reason", "") for t in trials]
    assert reasons[1] == "RuntimeError: the fake trainer crashed"
    assert reasons[2].startswith("out of memory: torch.OutOfMemoryError: CUDA out of memory")
    assert reasons[3] == "final mAP50-95 is nan"
    assert reasons[4] == "error: --imgsz 64 is refused by the fake trainer"
    assert summary.counts == {"complete": 2, "failed": 4}
    rows = list(csv.DictReader((tmp_path / "exp" / "trials.csv").open()))
    assert rows[1]["reason"] == "RuntimeError: the fake trainer crashed"
    # A trial that never made its run folder names none (its log beside the folders says what happened).
    assert [bool(row["run_dir"]) for row in rows] == [True, True, True, True, False, True]
    assert all(Path(row["run_dir"]).is_dir() for row in rows if row["run_dir"])


class PruneFromTrialOne(optuna.pruners.BasePruner):
    """Prunes every trial but the first once it has reported two epochs."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number > 0 and len(trial.intermediate_values) >= 2


def test_a_pruned_trial_stops_early_with_its_last_score(tiny_data: Path, tmp_path: Path, fake_trainer: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(study_module, "make_pruner", lambda cfg: PruneFromTrialOne())
    monkeypatch.setenv("FAKE_EPOCH_S", "0.5")  # trial 1's epochs: long enough to be stopped right after its second
    monkeypatch.setenv("FAKE_TRAINER", json.dumps({"trial_0000": "quick"}))  # all 10 of trial 0's, in 0.5 s
    started = time.monotonic()
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=2, epochs=10))
    trials = _study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED"]
    pruned = trials[1]
    assert pruned.user_attrs["epochs"] == 2 and pruned.value == pruned.intermediate_values[2]
    assert pruned.user_attrs["reason"] == "pruned after epoch 2"
    assert not (tmp_path / "exp" / "trials" / "trial_0001" / "trial.json").exists(), "stopped before its end"
    assert time.monotonic() - started < 5 + 10 * 0.5 + 2 * 0.5 + 60, "the pruned trial did not run its 10 epochs"
    assert summary.counts == {"complete": 1, "pruned": 1}


def test_a_trial_is_not_pruned_while_its_final_validation_runs(tiny_data: Path, tmp_path: Path, fake_trainer: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Trial 1's last row (epoch 2) is where the pruner would stop it, while it validates best.pt for 1 s (20 polls).
    monkeypatch.setattr(study_module, "make_pruner", lambda cfg: PruneFromTrialOne())
    monkeypatch.setenv("FAKE_EPOCH_S", "0.1")
    monkeypatch.setenv("FAKE_TRAINER", json.dumps({"trial_0001": "slow_final"}))
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=2, epochs=2))
    trial = _study(tmp_path).get_trials()[1]
    assert trial.state.name == "COMPLETE" and len(trial.intermediate_values) == 2
    final = json.loads((tmp_path / "exp" / "trials" / "trial_0001" / "trial.json").read_text())
    assert trial.value == pytest.approx(final["metrics"]["mAP50-95"])
    assert summary.counts == {"complete": 2}


def test_the_median_and_halving_pruners_wait_a_third_of_the_epochs() -> None:
    cfg = tune_config_from_argv(["--epochs", "30"])
    assert study_module.make_pruner(cfg)._n_warmup_steps == 11  # epochs 1-10 never pruned
    halving = study_module.make_pruner(tune_config_from_argv(["--epochs", "30", "--pruner", "halving"]))
    assert isinstance(halving, optuna.pruners.SuccessiveHalvingPruner) and halving._min_resource == 11
    assert isinstance(study_module.make_pruner(tune_config_from_argv(["--pruner", "none"])), optuna.pruners.NopPruner)


@pytest.mark.parametrize("sampler", ["cmaes", "ga", "random"])
def test_every_sampler_runs_a_study(tiny_data: Path, tmp_path: Path, fake_trainer: None, sampler: str) -> None:
    if sampler == "cmaes":
        pytest.importorskip("cmaes")
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=3, sampler=sampler))
    assert summary.counts == {"complete": 3}


def test_a_study_resumed_with_other_settings_is_refused(tiny_data: Path, tmp_path: Path, fake_trainer: None) -> None:
    tune.run(**_flags(tiny_data, tmp_path, trials=1))
    with pytest.raises(ConfigError, match=r"study 'exp' was made with epochs 3, this command gives 4; give the same"):
        tune.run(**_flags(tiny_data, tmp_path, trials=2, epochs=4))
    # Any training option that changes what a trial learns, not only the sizes.
    for flags, message in (
        ({"seed": 5}, "seed 3, this command gives 5"),
        ({"rect": True}, "rect False"),
        ({"cos_lr": True}, "cos_lr False"),
        ({"cache": "shm"}, "cache_order 'per rank'"),
        ({"nproc_per_trial": 2}, "nproc_per_trial 1"),
        ({"nosave": True}, "nosave False"),  # scores last.pt, not best.pt
        ({"noval": True, "pruner": "none"}, "noval False"),  # best.pt is then the last epoch's
    ):
        with pytest.raises(ConfigError, match=message):
            tune.run(**_flags(tiny_data, tmp_path, trials=2, **flags))
    tune.run(**_flags(tiny_data, tmp_path, trials=2, workers=1))  # how a trial runs may differ
    # A study made before a setting was recorded takes it on at its next run, and holds to it after.
    study = _study(tmp_path)
    study.set_user_attr("settings", {k: v for k, v in study.user_attrs["settings"].items() if k != "seed"})
    tune.run(**_flags(tiny_data, tmp_path, trials=2, seed=5))
    assert _study(tmp_path).user_attrs["settings"]["seed"] == 5
    with pytest.raises(ConfigError, match="seed 5, this command gives 3"):
        tune.run(**_flags(tiny_data, tmp_path, trials=2))


def test_a_refused_resume_names_the_first_difference_not_a_whole_hyp(tiny_data: Path, tmp_path: Path,
                                                                    fake_trainer: None) -> None:  # fmt: skip
    tune.run(**_flags(tiny_data, tmp_path, trials=1))
    # Another model: named as such (it also changes the base hyp, which used to be dumped whole instead).
    with pytest.raises(ConfigError, match=r"was made with model 'yolov8n', this command gives 'yolov5n'; give"):
        tune.run(**_flags(tiny_data, tmp_path, trials=2, cfg="yolov5n"))
    # Another base hyp or space: only the key that differs, in a line of reasonable length.
    hyp = (ROOT / "data/hyps/hyp.anchor-free.quickstart.yaml").read_text().replace("lr0: 0.001", "lr0: 0.002")
    with pytest.raises(ConfigError, match=r"was made with base_hyp lr0 0.001, this command gives 0.002; give") as error:
        tune.run(**_flags(tiny_data, tmp_path, trials=2, hyp=_write(tmp_path / "hyp.yaml", hyp), optimizer="AdamW"))
    assert len(str(error.value)) < 300
    space = _write(tmp_path / "space.yaml", "lr0: [x0.2, x5, log]\n")
    with pytest.raises(ConfigError, match=r"was made with space lrf \[0.01, 0.5, 'log'\], this command gives 'fixed'"):
        tune.run(**_flags(tiny_data, tmp_path, trials=2, space=space))


def test_the_same_command_again_adds_trials_up_to_the_new_count(tiny_data: Path, tmp_path: Path,
                                                                 fake_trainer: None, caplog) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="utils.tune.tuner")
    tune.run(**_flags(tiny_data, tmp_path, trials=2))
    assert "; 0 trials already in it" in caplog.text, "a new study's queued base recipe is not a trial yet"
    caplog.clear()
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=4))
    assert "; 2 trials already in it" in caplog.text
    trials = _study(tmp_path).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3] and summary.counts == {"complete": 4}
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1
    assert len({t.params["lr0"] for t in trials}) == 4, "a resumed study does not ask for the same points again"


def test_train_evolve_runs_the_study(tiny_data: Path, tmp_path: Path, fake_trainer: None) -> None:
    options = _flags(tiny_data, tmp_path)
    options.pop("trials")
    argv = keyword_argv(build_train_parser(), options, "test")
    summary = train.main([*argv, "--evolve", "2"])
    assert summary.counts == {"complete": 2} and (tmp_path / "exp" / "best_hyp.yaml").exists()


def test_a_segmentation_study_is_scored_on_mask_map(tiny_data: Path, tmp_path: Path, fake_trainer: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import segment.tune

    monkeypatch.setitem(tuner.TRAIN_SCRIPTS, "segment", FAKE)
    summary = segment.tune.run(**_flags(tiny_data, tmp_path, cfg="yolov8n-seg", trials=2))
    trials = _study(tmp_path).get_trials()
    for trial in trials:
        result = json.loads((Path(trial.user_attrs["run_dir"]) / "trial.json").read_text())
        assert trial.value == result["metrics"]["mask_mAP50-95"] != result["metrics"]["mAP50-95"]
        assert trial.intermediate_values[3] == pytest.approx(trial.value)
    header = (tmp_path / "exp" / "trials.csv").read_text().splitlines()[0]
    assert header.startswith("trial,state,mask_mAP50-95,") and summary.counts == {"complete": 2}


def test_trials_share_the_gpus_and_cores_and_mlflow_sees_one_experiment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(tuner.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    cfg = tune_config_from_argv(["--nproc-per-trial", "2", "--mlflow", "--name", "study1"])
    slots = tuner.trial_slots(cfg)
    assert [(s.device, s.env["CUDA_VISIBLE_DEVICES"], s.cpus) for s in slots] == [
        ("0,1", "0,1", tuple(range(8))), ("0,1", "2,3", tuple(range(8, 16)))]  # fmt: skip
    picked = tuner.trial_slots(tune_config_from_argv(["--device", "1,3", "--parallel", "2"]))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in picked] == ["1", "3"]
    with pytest.raises(ConfigError, match=r"--parallel 3 x --nproc-per-trial 2: more than the 4 GPUs given"):
        tuner.trial_slots(tune_config_from_argv(["--nproc-per-trial", "2", "--parallel", "3"]))
    # --device as train.py reads it: cuda:1 is GPU 1, cuda every GPU; what it would refuse is refused here.
    for device, visible in (("cuda:1", ["1"]), ("cuda", ["0", "1", "2", "3"]), ("CUDA:2,3", ["2", "3"])):
        given = tuner.trial_slots(tune_config_from_argv(["--device", device]))
        assert [s.env["CUDA_VISIBLE_DEVICES"] for s in given] == visible and {s.device for s in given} == {"0"}
    for device, message in (("mps", "expected cpu, cuda or GPU numbers"), ("4", "no GPU 4 on this machine")):
        with pytest.raises(ConfigError, match=f"--device {device}: {message}"):
            tuner.trial_slots(tune_config_from_argv(["--device", device]))
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device 0 asks for CUDA but no CUDA device is available"):
        tuner.trial_slots(tune_config_from_argv(["--device", "0"]))
    assert tuner.trial_slots(tune_config_from_argv(["--device", ""]))[0].device == "cpu"
    # Three trials on two cores: each gets a core, none the whole machine.
    monkeypatch.setattr(tuner.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    shares = [s.cpus for s in tuner.trial_slots(tune_config_from_argv(["--device", "cpu", "--parallel", "3"]))]
    assert all(len(share) == 1 for share in shares) and {core for share in shares for core in share} == {0, 1}
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    space = load_space(_write(tmp_path / "s.yaml", "lr0: [0.001, 0.1, log]\n"), load_hyp(ANCHOR_FREE_SHORT), ("dfl",))
    plan = types.SimpleNamespace(cfg=types.SimpleNamespace(optimizer="SGD"))  # the command reads only the optimizer
    run = tuner.StudyRun(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, project=tmp_path)), plan, space,
                         study=None)  # fmt: skip
    asked = study_module.AskedTrial(types.SimpleNamespace(number=7), {"lr0": 0.02})
    command = tuner.trial_command(run, asked, slots[1])
    assert command.argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc-per-node=2" in command.argv
    assert command.env == {"CUDA_VISIBLE_DEVICES": "2,3", "MLFLOW_EXPERIMENT_NAME": "tune-study1"}
    assert command.argv[command.argv.index("--device") + 1] == "0,1" and "--mlflow" in command.argv
    assert load_hyp(Path(command.argv[command.argv.index("--hyp") + 1])).lr0 == 0.02


# --- one trial ---------------------------------------------------------------------------------------


def _watch(stop: threading.Event | None = None, prune_at: int = 0) -> TrialWatch:
    return TrialWatch(report=lambda epoch, score: bool(prune_at) and epoch >= prune_at, heartbeat=lambda: None,
                      stop=stop or threading.Event(), score_column="metrics/mAP50-95", fitness_key="mAP50-95",
                      poll_s=0.05)  # fmt: skip


def test_a_trial_killed_by_a_signal_is_failed_with_the_signal(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    outcome = run_trial(TrialCommand([sys.executable, "-c", code], tmp_path / "run", tmp_path / "run.log"), _watch())
    assert (outcome.state, outcome.reason) == (FAILED, "killed by SIGKILL")


def test_a_trial_whose_watch_fails_is_stopped_not_left_training(tmp_path: Path) -> None:
    def heartbeat() -> None:
        raise RuntimeError("the study's storage went away")

    watch = dataclasses.replace(_watch(), heartbeat=heartbeat, heartbeat_s=0.1)
    code = f"import time; time.sleep(60)  # {tmp_path}"  # its command line names this test's folder
    command = TrialCommand([sys.executable, "-c", code], tmp_path / "run", tmp_path / "log")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="storage went away"):
        run_trial(command, watch)
    assert time.monotonic() - started < 30
    assert not _processes_naming("time.sleep(60)", str(tmp_path))


def test_a_stop_request_ends_a_trial_and_its_process_group(tmp_path: Path) -> None:
    child = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    code = f"import subprocess, sys, time; {child}; time.sleep(60)"
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    started = time.monotonic()
    command = TrialCommand([sys.executable, "-c", code], tmp_path / "run", tmp_path / "run.log")
    outcome = run_trial(command, _watch(stop))
    assert outcome.state == "interrupted" and outcome.reason.startswith("interrupted")
    assert time.monotonic() - started < 30


def test_an_interrupted_trial_counts_the_epochs_it_finished_while_stopping(tmp_path: Path) -> None:
    # train.py stops at its next optimizer step: an epoch may end (its results.csv row written) after the SIGTERM.
    run_dir = tmp_path / "run"
    code = (
        "import pathlib, signal, sys, time\n"
        f"run = pathlib.Path({str(run_dir)!r}); run.mkdir(parents=True, exist_ok=True)\n"
        "def stop(*_):\n"
        "    (run / 'results.csv').write_text('epoch,metrics/mAP50-95\\n1,0.25\\n'); sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop); (run / 'ready').touch(); time.sleep(60)\n"
    )
    stop = threading.Event()

    def stop_when_ready() -> None:
        while not (run_dir / "ready").exists():
            time.sleep(0.02)
        stop.set()

    threading.Thread(target=stop_when_ready, daemon=True).start()
    outcome = run_trial(TrialCommand([sys.executable, "-c", code], run_dir, tmp_path / "run.log"), _watch(stop))
    assert (outcome.state, outcome.epochs) == ("interrupted", 1)


def test_scores_are_read_only_from_whole_rows(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = (
        "import sys, time; f = open(sys.argv[1], 'w'); f.write('epoch,metrics/mAP50-95\\n1,0.1\\n2,0.'); f.flush();"
        "time.sleep(0.5); f.write('2\\n3,0.3\\n'); f.close(); time.sleep(0.3)"  # 10 polls see the half row
    )
    seen: list[tuple[int, float]] = []

    def report(epoch: int, score: float) -> bool:
        seen.append((epoch, score))
        return False

    watch = _watch()
    watch.report = report
    command = TrialCommand([sys.executable, "-c", code, str(run_dir / "results.csv")], run_dir, tmp_path / "log")
    run_trial(command, watch)
    assert seen == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_pruning_stops_the_trial_at_the_epoch_it_was_decided(tmp_path: Path) -> None:
    env = {"FAKE_EPOCH_S": "0.3"}
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(ANCHOR_FREE_SHORT.read_text())
    argv = [sys.executable, str(FAKE), "--hyp", str(hyp), "--project", str(tmp_path), "--name", "t", "--epochs", "20"]
    outcome = run_trial(TrialCommand(argv, tmp_path / "t", tmp_path / "t.log", env), _watch(prune_at=2))
    assert (outcome.state, outcome.epochs) == (PRUNED, 2)
    assert outcome.fitness == pytest.approx(0.4 * 2 / 20, abs=0.05)


def test_a_trial_that_ends_between_polls_is_complete_not_pruned(tmp_path: Path) -> None:
    # All its epochs, trial.json and its exit land within one poll: the pruner's answer for a row read after
    # that must not turn a finished trial into a pruned one and drop its final score.
    env = {"FAKE_EPOCH_S": "0"}
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(ANCHOR_FREE_SHORT.read_text())
    argv = [sys.executable, str(FAKE), "--hyp", str(hyp), "--project", str(tmp_path), "--name", "t", "--epochs", "4"]
    watch = dataclasses.replace(_watch(prune_at=2), poll_s=3.0)
    outcome = run_trial(TrialCommand(argv, tmp_path / "t", tmp_path / "t.log", env), watch)
    assert (outcome.state, outcome.epochs) == (COMPLETE, 4)
    assert outcome.fitness == json.loads((tmp_path / "t" / "trial.json").read_text())["metrics"]["mAP50-95"]


# --- processes: stop, kill, resume, two workers -----------------------------------------------------------


DRIVER = (
    "import sys; from pathlib import Path; from utils.tune import tuner; "
    "tuner.TRAIN_SCRIPTS['detect'] = Path(sys.argv[1]); sys.argv[1:2] = []; "
    "import tune; from utils.errors import exit_on_user_error; exit_on_user_error(tune.main)"
)


def _tune_process(data: Path, project: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = ["--cfg", "yolov8n", "--data", str(data), "--imgsz", "64", "--batch-size", "4", "--epochs", "3",
            "--workers", "0", "--device", "cpu", "--project", str(project), "--trials", "4", "--seed", "3",
            "--noplots", *extra]  # fmt: skip
    full_env = {**os.environ, "FAKE_EPOCH_S": "0.02", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(FAKE), *argv], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _processes_naming(*texts: str) -> list[int]:
    """Pids of live processes whose command line contains every one of `texts`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode() if entry.name.isdigit() else ""
            if command and all(text in command for text in texts):
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:  # a zombie has exited
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigterm_leaves_a_study_to_resume_and_a_killed_tuners_trial_is_lost_and_not_counted(
    tiny_data: Path, tmp_path: Path
) -> None:
    # One study, three tuner processes (each start costs seconds): stopped by SIGTERM, killed, then resumed.
    process = _tune_process(tiny_data, tmp_path, env={"FAKE_TRAINER": json.dumps({"trial_0002": "hang"})})
    _wait_for(tmp_path / "exp" / "trials" / "trial_0002" / "argv.json", process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 75, output[-3000:]
    assert "stopped: study 'exp' stopped; run the same command to resume it" in output
    assert "tune: 3 trials (2 complete, 1 interrupted); best trial" in output, "queued values are not a trial"
    trials = _study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "WAITING"]
    assert trials[2].user_attrs["reason"].startswith("interrupted")
    assert trials[3].system_attrs["fixed_params"] == trials[2].params and trials[3].user_attrs["retry_of"] == 2
    rows = (tmp_path / "exp" / "trials.csv").read_text().splitlines()[1:]
    assert [row.split(",")[1] for row in rows] == ["complete", "complete", "interrupted"], "queued values: no row"

    # The same command trains the interrupted trial's point first (trial 3); then trial 4 hangs, 3 epochs of 10 s:
    # long past the 5 s it has to die in below, once its tuner is killed.
    env = {"FAKE_TRAINER": json.dumps({"trial_0004": "hang"}), "FAKE_EPOCH_S": "0.2"}
    process = _tune_process(tiny_data, tmp_path, env=env)
    _wait_for(tmp_path / "exp" / "trials" / "trial_0004" / "argv.json", process)
    process.kill()  # no handler runs: the trial stays RUNNING in the storage
    process.communicate(timeout=60)
    # Its trainer is not left training as an orphan: Linux sends it SIGTERM when the tuner's thread dies.
    deadline = time.monotonic() + 5
    while _processes_naming(str(tmp_path), "trial_0004") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(str(tmp_path), "trial_0004"), "the killed tuner's trial trains on"

    resumed = _tune_process(tiny_data, tmp_path)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    trials = _study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "FAIL", "COMPLETE"]
    assert trials[3].params == trials[2].params, "the interrupted trial's point is trained first"
    assert trials[4].user_attrs["reason"].startswith("lost: worker ")
    assert trials[5].params == trials[4].params and trials[5].user_attrs["retry_of"] == 4
    assert len({t.params["lr0"] for t in trials if t.state.name == "COMPLETE"}) == 4, "no trial repeated"
    assert "trial 4 was lost with worker" in output and "queued again" in output
    assert "; 3 trials already in it" in output, "neither the interrupted nor the lost trial is counted at the start"
    assert "tune: 6 trials (4 complete, 1 interrupted, 1 lost)" in output
    assert [row.split(",")[1] for row in (tmp_path / "exp" / "trials.csv").read_text().splitlines()[1:]] == [
        "complete", "complete", "interrupted", "complete", "lost", "complete"
    ]  # fmt: skip


@pytest.mark.slow
def test_two_workers_share_one_study_through_a_journal_file(tiny_data: Path, tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    env = {"FAKE_EPOCH_S": "0.4"}
    workers = [_tune_process(tiny_data, tmp_path / f"machine{i}", "--storage", str(journal), "--trials", "6",
                             env=env) for i in range(2)]  # fmt: skip
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [out[-2000:] for out in outputs]
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name="exp", storage=storage)
    trials = study.get_trials()
    complete = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]  # the median pruner may stop one
    states = [(t.number, t.state.name, t.user_attrs.get("reason", "")) for t in trials]
    assert 6 <= len(complete) <= 7, f"each worker stops once the study has its trials (one may be in flight): {states}"
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    assert len({t.user_attrs["worker"] for t in complete}) == 2, "both workers ran trials"
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1


# --- real trainings ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_trials_score_best_pt_and_the_best_hyp_trains(tiny_data: Path, tmp_path: Path) -> None:
    # Both at once, each on its own CPU share (one core of two): half the wall time of one after the other, and
    # less CPU than two torch threads each contending for both cores; the label cache is written atomically.
    summary = tune.run(**_flags(tiny_data, tmp_path, trials=2, epochs=1, parallel=2))
    trials = _study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], [t.user_attrs for t in trials]
    best = trials[summary.best_number]
    result = json.loads((Path(best.user_attrs["run_dir"]) / "trial.json").read_text())
    assert best.value == result["metrics"]["mAP50-95"] and Path(best.user_attrs["best"]).is_file()
    hyp = load_hyp(tmp_path / "exp" / "best_hyp.yaml")
    assert hyp.lr0 == pytest.approx(best.params["lr0"])
    log = (tmp_path / "exp" / "trials" / "trial_0001.log").read_text()
    assert "Final (" in log and "Done: 1 epochs." in log


def test_the_summary_names_the_machine_holding_the_best_weights(tmp_path: Path) -> None:
    from utils.tune.results import write_results

    space = load_space(_write(tmp_path / "s.yaml", "lr0: [0.001, 0.1, log]\n"), load_hyp(ANCHOR_FREE_SHORT), ("dfl",))
    study = optuna.create_study(direction="maximize")
    elsewhere = str(tmp_path / "b" / "best.pt")  # a path on the machine that ran the trial, not on this one
    study.add_trial(optuna.trial.create_trial(value=0.5, params={"lr0": 0.01}, distributions=space_dists(space),
                                              user_attrs={"best": elsewhere, "worker": "nodeB:12:ab"}))  # fmt: skip
    summary = write_results(study, space, tmp_path, "mAP50-95", plots=False)
    assert summary.best_weights == f"{elsewhere} on nodeB"
    here = tmp_path / "best.pt"
    here.write_bytes(b"")
    study.add_trial(optuna.trial.create_trial(value=0.7, params={"lr0": 0.02}, distributions=space_dists(space),
                                              user_attrs={"best": str(here), "worker": "nodeB:12:ab"}))  # fmt: skip
    assert write_results(study, space, tmp_path, "mAP50-95", plots=False).best_weights == str(here)


def test_trials_that_do_not_count_are_named_for_what_became_of_them() -> None:
    from utils.tune.results import state_name

    def failed(**attrs: str) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs=attrs)

    assert state_name(failed(reason="RuntimeError: boom")) == "failed"
    assert state_name(failed(reason="interrupted: the study was stopped")) == "interrupted"
    assert state_name(failed(reason="lost: worker h:1 stopped")) == "lost"
    assert state_name(failed()) == "lost"  # failed by Optuna's heartbeat check: not counted either
    assert state_name(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=0.5)) == "complete"
