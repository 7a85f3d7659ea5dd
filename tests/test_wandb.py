"""Weights & Biases logging of training runs in offline mode, read back from the run's .wandb files; resume; no server.

An offline run writes its records to `wandb/offline-run-*/run-<id>.wandb`: a 7-byte header (":W&B",
magic, version) and then LevelDB's log format (32 KiB blocks of records, each a 7-byte header:
CRC32, length, type FULL/FIRST/MIDDLE/LAST) holding wandb_internal_pb2.Record messages.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from tests.conftest import make_tiny_dataset
from utils.data.synthetic import SyntheticSpec
from utils.train.wandb_logger import wandb_target

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every Record of a .wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
        else:
            break
    parsed = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def _items(items: Any) -> dict[str, Any]:
    """A record's key/value items as a dict (a key may come as `key` or as the parts of `nested_key`)."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def offline_run(run_dir: Path) -> dict[str, Any]:
    """What the offline runs under `run_dir` recorded: run ids, config, history rows, summary keys, artifacts."""
    found: dict[str, Any] = {"ids": [], "config": {}, "history": [], "summary": {}, "artifacts": [], "exit": []}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in read_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["ids"].append(record.run.run_id)
                found["project"], found["entity"] = record.run.project, record.run.entity
                found["config"].update(_items(record.run.config.update))
            elif kind == "config":
                found["config"].update(_items(record.config.update))
            elif kind == "history":
                found["history"].append(_items(record.history.item))
            elif kind == "summary":
                found["summary"].update(_items(record.summary.update))
            elif kind == "artifact":
                found["artifacts"].append((record.artifact.type, [f.path for f in record.artifact.manifest.contents]))
            elif kind == "exit":
                found["exit"].append(record.exit.exit_code)
    return found


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("wandb"), TINY)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ("WANDB_PROJECT", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_DIR", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def _train(tiny_data: Path, project: Path, **extra: object):
    options = dict(cfg="yolov8n", data=tiny_data, imgsz=64, batch_size=4, epochs=2, workers=0, device="cpu",
                   project=project, noplots=True, seed=1)  # fmt: skip
    return train.run(**{**options, **extra})


@pytest.mark.slow
def test_an_offline_run_holds_options_every_epoch_best_pt_and_a_resume_continues_it(
    tiny_data: Path, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "shapes")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    first = _train(tiny_data, tmp_path / "runs" / "train", epochs=1, wandb=True)
    run_id = torch.load(first.last, weights_only=True)["callback_state"]["wandb"]["run_id"]
    logged = offline_run(first.run_dir)
    assert logged["ids"] == [run_id] and (logged["project"], logged["entity"]) == ("shapes", "team")
    assert logged["config"]["imgsz"] == 64 and logged["config"]["hyp"]["lr0"] == pytest.approx(0.001)
    rows = [row for row in logged["history"] if "metrics/mAP50-95" in row]
    columns = (first.run_dir / "results.csv").read_text().splitlines()[0].split(",")
    assert [row["epoch"] for row in rows] == [1] and set(columns) - {"time_s"} <= set(rows[0])
    assert "final/mAP50-95" in logged["summary"]
    kinds = dict(logged["artifacts"])
    assert kinds["model"] == ["best.pt"] and {"results.csv", "opt.yaml", "hyp.yaml"} <= set(kinds["results"])
    assert logged["exit"] == [0]

    monkeypatch.delenv("WANDB_PROJECT")  # resumed from another shell: the checkpoint says where the run logs
    monkeypatch.delenv("WANDB_ENTITY")
    resumed = _train(tiny_data, tmp_path / "runs" / "train", resume=str(first.last), epochs=2, wandb=True)
    assert resumed.run_dir == first.run_dir
    logged = offline_run(first.run_dir)
    assert logged["ids"] == [run_id, run_id], "the resumed run logs to the same W&B run"
    assert (logged["project"], logged["entity"]) == ("shapes", "team")
    assert [row["epoch"] for row in logged["history"] if "metrics/mAP50-95" in row] == [1, 2]


@pytest.mark.slow
def test_an_unreachable_server_costs_one_warning(
    tiny_data: Path, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_PROJECT", "nowhere")  # turns W&B on without --wandb
    with caplog.at_level(logging.WARNING):
        result = _train(tiny_data, tmp_path, epochs=1)
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B")]
    assert len(warnings) == 1 and warnings[0].startswith("W&B: no server at http://127.0.0.1:9")
    assert result.best.is_file() and not (result.run_dir / "wandb").exists()


def test_without_the_flag_or_a_project_w_and_b_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from utils.train.wandb_logger import wandb_wanted

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert not wandb_wanted(False) and wandb_wanted(True)
    monkeypatch.setenv("WANDB_PROJECT", "p")
    assert wandb_wanted(False)


@pytest.mark.parametrize("named_by", ["environment", "checkpoint"])
def test_without_an_api_key_w_and_b_is_one_warning_not_a_login_prompt(
    named_by: str, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A server that answers (as api.wandb.ai would) but no key anywhere: wandb.init would prompt on a terminal and
    # wait there, or end the run when stdin is closed. The logger asks for a key without a prompt and stays off.
    # The server is WANDB_BASE_URL's, or, for a resumed run, the one its checkpoint recorded (nothing else answers).
    import http.server
    import threading

    from utils.callbacks import TrainEvent
    from utils.train.wandb_logger import WandbLogger

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name is http.server's)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("WANDB_MODE", "online")
        url, state = f"http://127.0.0.1:{server.server_address[1]}", {}
        if named_by == "environment":
            monkeypatch.setenv("WANDB_BASE_URL", url)
        else:
            state = {"wandb": {"run_id": "abcd1234", "project": "train", "entity": None, "base_url": url}}
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
        monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
        logger = WandbLogger(explicit=True)
        event = TrainEvent(name="on_pretrain_routine_end", run_dir=tmp_path / "exp", options={}, epochs=1,
                           state=dict(state))  # fmt: skip
        with caplog.at_level(logging.WARNING):
            logger.on_pretrain_routine_end(event)
    finally:
        server.shutdown()
    assert logger.run is None and event.state == state
    assert "W&B: no API key (WANDB_API_KEY, or `wandb login` once); training goes on without W&B" in caplog.text


def test_a_resumed_run_logs_where_its_checkpoint_says_unless_a_variable_names_another_place(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "train" / "exp"
    fresh = wandb_target({}, {}, run_dir)
    assert (fresh.project, fresh.entity, fresh.base_url, fresh.warnings) == ("train", None, None, ())
    assert len(fresh.run_id) == 8 and fresh.run_id != wandb_target({}, {}, run_dir).run_id
    stored = {"run_id": "abcd1234", "project": "shapes", "entity": "team", "base_url": "https://wandb.example.org"}
    resumed = wandb_target(stored, {}, run_dir)
    assert (resumed.run_id, resumed.project, resumed.entity, resumed.base_url) == (
        "abcd1234", "shapes", "team", "https://wandb.example.org")  # fmt: skip
    assert resumed.warnings == ()
    same = {"WANDB_PROJECT": "shapes", "WANDB_BASE_URL": "https://wandb.example.org/"}
    assert wandb_target(stored, same, run_dir).warnings == ()
    moved = wandb_target(stored, {"WANDB_PROJECT": "other", "WANDB_ENTITY": ""}, run_dir)
    assert (moved.run_id, moved.project, moved.entity) == ("abcd1234", "other", "team")
    (warning,) = moved.warnings
    assert warning.startswith("W&B: WANDB_PROJECT=other, but this run's earlier epochs were logged with project "
                              "shapes;") and "unset WANDB_PROJECT" in warning  # fmt: skip
