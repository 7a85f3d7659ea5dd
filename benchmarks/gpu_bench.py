"""The GPU benchmark's shared machinery: its report, the checkouts it compares, subprocess runs and the data."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from utils.cpus import usable_cpus
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset

FLAG = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")


@dataclass
class Report:
    """The benchmark's output: gpu.log (everything printed), gpu.md and gpu.csv (the tables), rewritten per row."""

    out: Path
    tables: dict[str, tuple[tuple[str, ...], list[list[str]]]] = field(default_factory=dict)

    def say(self, line: str) -> None:
        """Print `line` and append it to gpu.log."""
        print(line, flush=True)
        with open(self.out / "gpu.log", "a") as handle:
            handle.write(line + "\n")

    def add(self, table: str, columns: tuple[str, ...], row: list[str]) -> None:
        """Add a row to `table`, print it, and rewrite gpu.md and gpu.csv."""
        self.tables.setdefault(table, (columns, []))[1].append(row)
        self.say(f"[{table}] " + " | ".join(f"{c}: {v}" for c, v in zip(columns, row, strict=True)))
        self.write()

    def markdown(self) -> str:
        """All tables as Markdown."""
        parts = []
        for name, (columns, rows) in self.tables.items():
            lines = [f"## {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            parts.append("\n".join(lines))
        return "\n\n".join(parts) + "\n"

    def write(self) -> None:
        """Rewrite gpu.md and gpu.csv from the rows so far."""
        (self.out / "gpu.md").write_text(self.markdown())
        with open(self.out / "gpu.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            for name, (columns, rows) in self.tables.items():
                writer.writerow(["table", *columns])
                writer.writerows([name, *row] for row in rows)


@dataclass(frozen=True)
class Checkout:
    """A code directory to measure; `label` is the path as given on the command line."""

    label: str
    path: Path

    def flags(self, *scripts: str) -> set[str]:
        """The --flags its `scripts` and `utils/` mention (a superset of what the parsers accept)."""
        files = [self.path / script for script in scripts] + sorted((self.path / "utils").rglob("*.py"))
        return {flag for file in files if file.is_file() for flag in FLAG.findall(file.read_text(errors="ignore"))}


@dataclass
class Bench:
    """What every part needs: options, checkouts, output, work folders and the deadline."""

    args: argparse.Namespace
    checkouts: list[Checkout]
    report: Report
    work: Path
    started: float
    datasets: dict[int, Path] = field(default_factory=dict)  # train size -> generated dataset root
    first_weights: Path | None = None  # best.pt of the first training run: what the val part validates
    first_data: Path | None = None  # and its dataset YAML

    @property
    def cuda(self) -> bool:
        return self.args.device != "cpu"

    def seconds_left(self) -> float:
        return self.args.deadline_s - (time.time() - self.started)


def run_logged(
    command: list[str], cwd: Path, log: Path, bench: Bench, extra_env: dict[str, str] | None = None
) -> tuple[int, float]:
    """Run `command` in `cwd` (with `extra_env` set), output to `log`; killed at the deadline. Returns (rc, s)."""
    extra_env = extra_env or {}
    config_dir = str(bench.work / "ultralytics-config")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "YOLO_CONFIG_DIR": config_dir, **extra_env}
    assignments = "".join(f"{key}={value} " for key, value in extra_env.items())
    bench.report.say(f"$ (cd {cwd} && {assignments}{' '.join(command)}) > {log}")
    start = time.time()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = process.wait(timeout=max(bench.seconds_left(), 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
            bench.report.say(f"  killed at the deadline (--deadline-s {bench.args.deadline_s:.0f})")
    seconds = time.time() - start
    if rc != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-8:]
        bench.report.say(f"  exit status {rc} after {seconds:.1f} s; last lines:\n    " + "\n    ".join(tail))
    return rc, seconds


def make_datasets(bench: Bench) -> None:
    """Generate each size's shapes dataset once, on every core (seed 1; val split with COCO annotations)."""
    for size in bench.args.sizes:
        name = f"shapes-n{size}-v{bench.args.val_images}"
        start = time.time()
        spec = SyntheticSpec(seed=1, num_train=size, num_val=bench.args.val_images)
        bench.datasets[size] = ensure_synthetic_dataset(bench.work / "data" / name, spec, max_threads=usable_cpus())
        bench.report.say(f"data: {name} ready in {time.time() - start:.1f} s ({usable_cpus()} threads)")


def data_view(bench: Bench, size: int, owner: str) -> Path:
    """A hard-linked copy of a generated set for one trainer, so each writes its own label cache files."""
    source = bench.datasets[size]
    view = bench.work / "views" / owner / source.name
    if not view.exists():

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)

        shutil.copytree(source, view, copy_function=link, ignore=shutil.ignore_patterns("*.cache", "*.npy"))
    return view


def our_yaml(view: Path) -> Path:
    """Our dataset YAML for `view` (pycocotools scoring through val_annotations)."""
    raw = {
        "path": str(view),
        "train": "images/train",
        "val": "images/val",
        "val_annotations": "annotations/instances_val.json",
        "names": list(SHAPE_NAMES),
    }
    path = view.parent / f"{view.name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def ultralytics_yaml(view: Path) -> Path:
    """Ultralytics' dataset YAML for `view`: the same YOLO txt layout (labels/ beside images/), names by index."""
    raw = {"path": str(view), "train": "images/train", "val": "images/val", "names": dict(enumerate(SHAPE_NAMES))}
    path = view.parent / f"{view.name}-ultralytics.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A table cell: `value` formatted, or '-' when unknown."""
    return "-" if value is None else format(value, spec)


def coco_scores(folder: Path) -> tuple[float | None, float | None]:
    """(mAP50-95, mAP50) of the coco_eval.json in `folder`, or (None, None)."""
    path = folder / "coco_eval.json"
    if not path.is_file():
        return None, None
    stats = json.loads(path.read_text()).get("bbox", {})
    return stats.get("AP"), stats.get("AP50")


def common_flags(bench: Bench, *scripts: str) -> set[str]:
    """The --flags every checkout's `scripts` (and utils/) mention: the ones a side-by-side run may pass."""
    sets = [checkout.flags(*scripts) for checkout in bench.checkouts]
    return set.intersection(*sets) if sets else set()


def argv_from(wanted: list[tuple[str, str | None]], known: set[str]) -> tuple[list[str], list[str]]:
    """(argv of the `wanted` flags that are `known`, the names of those that are not)."""
    argv: list[str] = []
    dropped: list[str] = []
    for flag, value in wanted:
        if flag not in known:
            dropped.append(flag)
            continue
        argv += [flag] if value is None else [flag, value]
    return argv, dropped


def slug(bench: Bench, checkout: Checkout) -> str:
    """A short unique name for `checkout` in file names: its index and its folder's name."""
    index = bench.checkouts.index(checkout)
    return f"c{index}-" + (re.sub(r"[^A-Za-z0-9]+", "_", checkout.path.name).strip("_") or "root")
