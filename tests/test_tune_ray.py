"""tune.py --ray: the study's trials through Ray Tune on a local Ray cluster (skipped without ray[tune])."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_tune import FAKE, _flags, _study, _tune_process, _wait_for, fake_trainer, tiny_data  # noqa: F401
from utils.config import ROOT
from utils.hyp import load_hyp
from utils.train.records import FAMILY_TRAINING
from utils.tune.ray_trial import FITNESS, NUMBER, SCORE, RayTrialJob, run_ray_trial
from utils.tune.space import load_space
from utils.tune.trial import TrialRecipe

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune.search.optuna")
optuna = pytest.importorskip("optuna")
COMPLETE, PRUNED, FAIL = (optuna.trial.TrialState[name] for name in ("COMPLETE", "PRUNED", "FAIL"))

pytestmark = pytest.mark.slow


def _run_tune(data: Path, project: Path, *extra: str, env: dict[str, str]) -> str:
    """tune.py --ray local as a process, to its end: Ray's signal handlers and threads stay out of pytest's
    process, where a later test's forked loader workers would inherit them (and could hang)."""
    process = _tune_process(data, project, "--ray", "local", *extra, env=env)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    return output


@pytest.mark.distributed  # tune.py --ray local as a process
def test_a_ray_study_records_its_trials_resumes_and_stops_on_sigterm_as_on_ctrl_c(
    tiny_data: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Six epochs: ASHA's first rung is at epoch 3 (a third, plus one); epochs slow enough for Ray to stop a trial.
    # Three trials, each costing a Ray worker's start (seconds): the base recipe, a sampled one (seed 3: it scores
    # above the base), and a poor one, which scores below both at the rung, so ASHA stops it. The second run's
    # trial 3 crashes and its trial 4 hangs: that run is stopped by SIGTERM.
    modes = {"trial_0002": "poor", "trial_0003": "crash", "trial_0004": "hang"}
    env = {"FAKE_EPOCH_S": "0.2", "FAKE_TRAINER": json.dumps(modes)}  # Ray's workers inherit it
    study_flags = ("--epochs", "6", "--pruner", "halving")
    output = _run_tune(tiny_data, tmp_path, *study_flags, "--trials", "3", env=env)
    study = _study(tmp_path)
    trials = study.get_trials()
    states = [t.state for t in trials]
    assert len(trials) == 3 and states[0] == COMPLETE and trials[0].user_attrs["baseline"]
    assert states[2] == PRUNED, "ASHA stopped no trial"
    for trial in trials:
        rows = (Path(trial.user_attrs["run_dir"]) / "results.csv").read_text().splitlines()
        if trial.state == PRUNED:  # Ray stopped it at a rung, and its training process stopped with it
            epochs = trial.user_attrs["epochs"]
            assert trial.user_attrs["reason"] == f"pruned after epoch {epochs}" and epochs < 6
            # Ray's stop reaches the trainer asynchronously: it may finish the epoch it is in, never the run.
            assert epochs <= len(rows) - 1 < 6 and max(trial.intermediate_values) == epochs
        elif trial.state == COMPLETE:  # the fitness is the run's final score, its epochs reported on the way
            assert trial.user_attrs["epochs"] == 6 and len(trial.intermediate_values) == 6
            assert trial.value == pytest.approx(json.loads((Path(trial.user_attrs["run_dir"]) / "trial.json")
                                                           .read_text())["metrics"]["mAP50-95"])  # fmt: skip
    argv = json.loads((tmp_path / "exp" / "trials" / "trial_0001" / "argv.json").read_text())
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--name") + 1] == "trial_0001"
    best = max((t for t in trials if t.state == COMPLETE), key=lambda t: t.value)
    assert f"; best trial {best.number}: " in output
    assert load_hyp(tmp_path / "exp" / "best_hyp.yaml").lr0 == pytest.approx(best.params["lr0"])
    assert len((tmp_path / "exp" / "trials.csv").read_text().splitlines()) == 4

    # The same command with more trials continues the numbering and trains no point twice. It is also how a job
    # scheduler stops a job (one Ray cluster's start for both checks): SIGTERM while trial 4 trains interrupts it,
    # the results are written, and the exit status is 75, to requeue the job.
    process = _tune_process(tiny_data, tmp_path, "--ray", "local", *study_flags, "--trials", "5", env=env)
    _wait_for(tmp_path / "exp" / "trials" / "trial_0004" / "argv.json", process, timeout=300)
    time.sleep(1.0)  # its trainer is running
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 75, output[-3000:]
    assert "stopped: study 'exp' stopped; run the same command to resume it" in output
    trials = _study(tmp_path).get_trials()
    assert [t.number for t in trials[:5]] == list(range(5)) and len({t.params["lr0"] for t in trials[:5]}) == 5
    # The crash: a trial that ended before the signal keeps how it ended.
    assert trials[0].state == COMPLETE and trials[3].state == FAIL
    assert trials[3].user_attrs["reason"] == "RuntimeError: the fake trainer crashed"
    assert trials[4].state == FAIL and trials[4].user_attrs["reason"].startswith("interrupted")
    assert [t.state.name for t in trials[5:]] == ["WAITING"], "its point is queued again"
    assert trials[5].system_attrs["fixed_params"] == trials[4].params
    rows = (tmp_path / "exp" / "trials.csv").read_text().splitlines()
    assert rows[1].startswith("0,complete,") and [row.split(",")[1] for row in rows[1:]] == [
        "complete", "complete", "pruned", "failed", "interrupted"
    ]  # fmt: skip


def test_a_trials_last_epoch_reaches_ray_only_in_its_final_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A scheduler stopping a trial on its last epoch's result (the median rule has no max_t) would stop it while it
    # validates best.pt and lose its final score: that epoch's score is sent once, with the outcome.
    from ray import tune as ray_tune

    reports: list[dict] = []
    monkeypatch.setattr(ray_tune, "report", reports.append)
    monkeypatch.setenv("FAKE_EPOCH_S", "0")
    record = FAMILY_TRAINING["anchor_free"]
    space = load_space(record.search_space, load_hyp(record.recipe_files.short), record.hyp_keys)
    recipe = TrialRecipe(FAKE, ("--epochs", "3"), "AdamW", ("utils.tune.report",), tmp_path / "trials", space)
    job = RayTrialJob(recipe, "cpu", "metrics/mAP50-95", "mAP50-95", 0.01, epochs=3)
    run_ray_trial({NUMBER: 0, **space.base_params}, job)
    assert [report["epoch"] for report in reports] == [1, 2, 3], reports
    assert "state" not in reports[1] and reports[2]["state"] == "complete"
    assert reports[2][FITNESS] == pytest.approx(reports[2][SCORE])


def test_a_ray_worker_imports_neither_torch_nor_the_tuner() -> None:
    # Each trial's Ray worker imports run_ray_trial's module: with torch it started seconds slower and held
    # several hundred MB more, only to start and follow a training process.
    probed = ("torch", "optuna", "utils.tune.study", "utils.tune.ray_tune")
    code = f"import sys, utils.tune.ray_trial; print(sorted(n for n in {probed!r} if n in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
