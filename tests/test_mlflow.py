"""MLflow logging of training runs, read back with the MLflow client: local store, a real server, resume, no server."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

import train
from tests.conftest import make_tiny_dataset
from tests.dist_helpers import free_port
from utils.callbacks import TrainEvent
from utils.data.synthetic import SyntheticSpec
from utils.train.mlflow_logger import MLflowLogger, absolute_store_uri, metric_name

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2)


def test_metric_names_keep_results_csv_columns_readable() -> None:
    assert metric_name("metrics/mAP50-95") == "metrics/mAP50-95"
    assert metric_name("metrics/mAP50(B)") == "metrics/mAP50_B_"


def test_relative_store_uris_are_kept_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert absolute_store_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert absolute_store_uri(f"sqlite:///{tmp_path}/x.db") == f"sqlite:///{tmp_path}/x.db"
    assert absolute_store_uri("./mlruns") == str(tmp_path / "mlruns")
    for uri in ("http://127.0.0.1:5000", "databricks", "file:///srv/mlruns", ""):
        assert absolute_store_uri(uri) == uri


def _logger_session(run_dir: Path, state: dict[str, object], options: dict[str, object]) -> MLflowLogger:
    """An MLflowLogger started and torn down around no training, as fit() calls it; returns it (run_id set)."""
    logger = MLflowLogger(explicit=True)
    event = dict(run_dir=run_dir, options=options, epochs=1, state=state)
    logger.on_pretrain_routine_end(TrainEvent(name="on_pretrain_routine_end", **event))
    logger.teardown(TrainEvent(name="teardown", **event))
    return logger


def test_a_resume_without_the_tracking_uri_goes_on_in_the_checkpoints_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tracking_env: None
) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # relative: kept absolute in the state
    state: dict[str, object] = {}
    run_id = _logger_session(tmp_path / "runs" / "exp", state, {"epochs": 1}).run_id
    assert state["mlflow"] == {"run_id": run_id, "tracking_uri": f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}"}
    # --resume in another folder, without the variable: the same run in the same store, not ./mlflow.db there.
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path / "later")
    assert _logger_session(tmp_path / "runs" / "exp", state, {"epochs": 1}).run_id == run_id
    assert list((tmp_path / "later").iterdir()) == []
    client = MlflowClient(f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1


def test_a_resume_that_changes_options_tags_the_new_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tracking_env: None
) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    run_dir, state = tmp_path / "runs" / "exp", {}
    run_id = _logger_session(run_dir, state, {"epochs": 1, "seed": 1, "hyp": {"lr0": 0.01}}).run_id
    _logger_session(
        run_dir, state, {"epochs": 3, "seed": 1, "hyp": {"lr0": 0.01}, "patience": 5}
    )  # --resume --epochs 3
    run = MlflowClient(store).get_run(run_id)
    assert run.data.params == {"epochs": "1", "seed": "1", "hyp/lr0": "0.01"}  # MLflow's params cannot change
    resumed = {key: value for key, value in run.data.tags.items() if key.startswith("resumed/")}
    assert resumed == {"resumed/epochs": "3", "resumed/patience": "5"}
    _logger_session(run_dir, state, {"epochs": 1, "seed": 1, "hyp": {"lr0": 0.01}})  # back to the params' values
    assert not [key for key in MlflowClient(store).get_run(run_id).data.tags if key.startswith("resumed/")]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("mlflow"), TINY)


@pytest.fixture
def no_tracking_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)


def _train(tiny_data: Path, project: Path, **extra: object):
    options = dict(cfg="yolov5n", data=tiny_data, imgsz=64, batch_size=4, epochs=2, workers=0, device="cpu",
                   project=project, noplots=True, seed=1)  # fmt: skip
    return train.run(**{**options, **extra})


def _metric_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {item.path for item in client.list_artifacts(run_id, path)}


@pytest.mark.slow
def test_local_store_gets_params_metrics_artifacts_and_a_resume_continues_the_run(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tracking_env: None
) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default store is in the working folder
    first = _train(tiny_data, tmp_path / "runs" / "train", epochs=1, mlflow=True)
    run_id = torch.load(first.last, weights_only=True)["callback_state"]["mlflow"]["run_id"]
    client = MlflowClient(mlflow.get_tracking_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == first.run_dir.name
    assert run.data.params["epochs"] == "1" and run.data.params["model"] == "yolov5n"
    assert run.data.params["hyp/lr0"] == "0.001"  # the quick start's AdamW recipe, as resolved
    assert client.get_experiment(run.info.experiment_id).name == "train"
    assert _metric_steps(client, run_id, "metrics/mAP50-95") == [1]
    assert {"results.csv", "opt.yaml", "hyp.yaml", "weights"} <= _artifacts(client, run_id)
    assert _artifacts(client, run_id, "weights") == {"weights/best.pt"}
    # --resume with more epochs continues the same MLflow run (its id is in last.pt).
    resumed = _train(tiny_data, tmp_path / "runs" / "train", resume=str(first.last), epochs=2, mlflow=True)
    assert resumed.run_dir == first.run_dir
    assert torch.load(resumed.last, weights_only=True)["callback_state"]["mlflow"]["run_id"] == run_id
    assert _metric_steps(client, run_id, "metrics/mAP50-95") == [1, 2]
    assert _metric_steps(client, run_id, "train/box_loss") == [1, 2]
    assert _metric_steps(client, run_id, "final/mAP50-95") == [1, 2]  # each end at its epoch count, not both at 0
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.params["epochs"] == "1"  # params are immutable: the new value is a tag
    assert client.get_run(run_id).data.tags["resumed/epochs"] == "2"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # its HTTP settings do not outlive the run


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """A real `mlflow server` on a free localhost port, stopped after the test."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
               "--artifacts-destination", str(tmp_path / "server-artifacts")]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    # Without its job runner, which would leave a task-queue folder in /dev/shm behind each test (and start slower).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()


@pytest.mark.slow
@pytest.mark.distributed  # starts a server process
def test_a_real_tracking_server_named_by_the_environment_gets_the_run(
    tiny_data: Path, tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # enables MLflow without --mlflow
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "shapes")
    result = _train(tiny_data, tmp_path / "runs")
    run_id = torch.load(result.last, weights_only=True)["callback_state"]["mlflow"]["run_id"]
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "shapes"
    assert run.info.status == "FINISHED" and run.data.params["imgsz"] == "64"
    assert _metric_steps(client, run_id, "metrics/mAP50") == [1, 2]
    assert set(run.data.metrics) >= {"train/box_loss", "val/cls_loss", "lr/pg0", "final/mAP50-95"}
    assert "weights/best.pt" in _artifacts(client, run_id, "weights")
    assert (tmp_path / "server-artifacts").is_dir()  # uploaded through the server, not written beside the run


@pytest.mark.slow
def test_a_tracking_uri_nobody_listens_on_costs_one_warning(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING):
        result = _train(tiny_data, tmp_path / "runs", epochs=1)
    assert result.best.is_file()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("utils.train.mlflow")]
    assert len(warnings) == 1 and "no tracking server at http://127.0.0.1:" in warnings[0]
    assert "mlflow" not in torch.load(result.last, weights_only=True)["callback_state"]


@pytest.mark.slow
def test_a_file_store_named_by_the_environment(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow 3 keeps the plain ./mlruns file store behind MLFLOW_ALLOW_FILE_STORE; older versions use it by default.
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    result = _train(tiny_data, tmp_path / "runs" / "train", epochs=1)
    run_id = torch.load(result.last, weights_only=True)["callback_state"]["mlflow"]["run_id"]
    run = MlflowClient(store.as_uri()).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["seed"] == "1"
    assert run.data.params["mlflow"] == "True"  # what ran, though no --mlflow was given; opt.yaml says so too
    assert yaml.safe_load((result.run_dir / "opt.yaml").read_text())["mlflow"] is True
    assert "metrics/mAP50-95" in run.data.metrics and "final/fitness" in run.data.metrics
    assert list(store.rglob("best.pt")) and list(store.rglob("results.csv"))  # artifacts inside the store
