"""The layers: inference entry points never load training code, and the package import graph has no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import PROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
TRAINING_MODULES = ("utils.train", "segment.training", "segment.loss", "segment.dense_loss", "utils.cli.train")

# Runs in a fresh interpreter: save a tiny untrained checkpoint (detection, anchor-free) with the checkpoint
# module alone, then predict, export, load it with torch.hub's entry and import the val entry points, and
# print every training module that got loaded on the way.
INFERENCE_SCRIPT = """
import sys
from pathlib import Path
import cv2, numpy as np, torch
torch.set_num_threads(1)
from utils.checkpoint import RunInfo, build_checkpoint, save_checkpoint
from utils.distributed import DistContext
from utils.families import build_model, spec_from_cfg
tmp = Path(sys.argv[1])
spec = spec_from_cfg("yolov8n", 2)
run = RunInfo(task="detect", model_spec=spec.to_dict(), names=["a", "b"], train_config={}, hyp={},
              model_family=spec.family)
checkpoint = build_checkpoint(run=run, model=build_model(spec), ema=None, optimizer=None, scaler=None, epoch=0,
                              best_fitness=0.0)
save_checkpoint(checkpoint, tmp / "w.pt", DistContext())
cv2.imwrite(str(tmp / "image.jpg"), np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
import detect, export, hubconf, val
import segment.predict, segment.val
detect.run(weights=tmp / "w.pt", source=tmp / "image.jpg", imgsz=64, device="cpu", project=tmp / "detect")
export.run(weights=tmp / "w.pt", include=["torchscript"], imgsz=64, device="cpu")
hubconf.custom(path=str(tmp / "w.pt"), device="cpu")(str(tmp / "image.jpg"), size=64)
hubconf.yolov5n(classes=2, device="cpu")
print(sorted(name for name in sys.modules if name.startswith({training})))
""".replace("{training}", repr(TRAINING_MODULES))


@pytest.mark.slow
def test_inference_entry_points_never_import_training_code(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", INFERENCE_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "w.torchscript").is_file() and any((tmp_path / "detect").rglob("image.jpg"))


def test_the_training_entry_imports_its_engine_but_not_torchvision() -> None:
    # The other side of the test above: the probe sees training modules when they are loaded. torchvision is
    # imported at the first NMS (validation), not by the training entry before its first step.
    probed = (*TRAINING_MODULES, "torchvision")
    code = f"import sys, train; print(sorted(n for n in sys.modules if n.startswith({probed!r})))"
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "utils.train.engine" in done.stdout and "utils.cli.train" in done.stdout
    assert "torchvision" not in done.stdout


def package_of(module: str) -> str:
    """The graph node a module belongs to: a folder of utils/ (utils.train), a flat utils module, or models/segment."""
    parts = module.split(".")
    if parts[0] == "utils":
        return ".".join(parts[:2])
    return parts[0]


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports when it runs (imports under `if TYPE_CHECKING:` are for types only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known


def package_graph() -> dict[str, set[str]]:
    """Edges between the project's packages (utils' folders and flat modules, models, segment) from every import."""
    modules: dict[str, Path] = {}
    for path in ROOT.glob("*/**/*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("utils", "models", "segment"):
            name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for imported in _runtime_imports(path, set(modules)):
            if package_of(imported) != package_of(name):
                graph.setdefault(package_of(name), set()).add(package_of(imported))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path that returns to its start, or [] (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_sees_a_cycle_through_three_packages() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_the_package_graph_has_no_cycle() -> None:
    graph = package_graph()
    assert {"utils.train", "utils.eval", "utils.families", "segment"} <= set(graph)  # the walk saw the project
    assert find_cycle(graph) == []


def test_inference_packages_never_import_training() -> None:
    graph = package_graph()
    for package in ("utils.eval", "utils.predict", "utils.export", "utils.families", "utils.tasks", "models"):
        assert "utils.train" not in graph.get(package, set()), package
    assert "segment" not in graph.get("utils.train", set())  # utils never imports segment/
