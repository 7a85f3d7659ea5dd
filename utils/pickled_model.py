"""Read a foreign pickled model tree (safe_pickle placeholders): children, tensors in state-dict order, names.

Shared by the YOLOv5 converter (utils/convert.py) and the Ultralytics one (utils/convert_ultralytics.py):
both find the pickled model, walk its modules the way `nn.Module.state_dict()` would, and wrap the
mapped weights in our weights-only Checkpoint.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint import FORMAT_VERSION, Checkpoint
from utils.errors import ConfigError
from utils.safe_pickle import Placeholder


@dataclass(frozen=True)
class ConvertedModel:
    """What a converter made of a pickled model: our task name, our spec, and our state dict filled from the file."""

    task: str
    spec: Any
    weights: dict[str, torch.Tensor]


def children(node: Placeholder) -> Mapping[str, Any]:
    """The `_modules` of a pickled nn.Module (empty for anything else)."""
    modules = node.attribute("_modules")
    return modules if isinstance(modules, Mapping) else {}


def flatten_tensors(
    node: Placeholder,
    prefix: str,
    out: dict[str, torch.Tensor],
    renames: Mapping[str, Mapping[str, str]] | None = None,
    skipped_buffers: frozenset[str] = frozenset(),
) -> None:
    """Add `node`'s parameters and persistent buffers to `out` in state_dict() order, recursing into children.

    `renames` maps a pickled class name to {their child name: ours} (YOLOv5's C3 `cv1` -> `deep_in`, ...);
    children not listed keep their name. Buffers named in `skipped_buffers` are left out.
    """
    skipped = (node.attribute("_non_persistent_buffers_set") or set()) | skipped_buffers
    for group in ("_parameters", "_buffers"):
        for name, tensor in (node.attribute(group) or {}).items():
            if tensor is not None and name not in skipped:
                out[prefix + name] = tensor
    names = (renames or {}).get(node.class_name, {})
    for name, child in children(node).items():
        if isinstance(child, Placeholder):
            flatten_tensors(child, f"{prefix}{names.get(name, name)}.", out, renames, skipped_buffers)


# What a module computes beyond its tensors, as (kind, value) marks in module order. Defaults leave no mark
# (no shortcut, 3 pools), so a file pickled before an attribute existed reads as that attribute's default.
Mark = tuple[str, Any]


def _pool_kernel(kernel: Any) -> Any:
    """A max-pool's kernel_size as one int when square (5 and (5, 5) are the same pool)."""
    if isinstance(kernel, (tuple, list)) and len(set(kernel)) == 1:
        return int(kernel[0])
    return kernel


def pickled_marks(node: Placeholder, path: str = "") -> list[tuple[str, Mark]]:
    """(module path, mark) for a pickled module tree: each `act` child's class, each true `add` (YOLOv5 and
    Ultralytics' residual flag), each max-pool's kernel, and an SPPF's pool count when not 3."""
    marks: list[tuple[str, Mark]] = []
    act = children(node).get("act")
    if isinstance(act, Placeholder):
        marks.append((path, ("activation", act.class_name)))
    if node.attribute("add") is True:
        marks.append((path, ("shortcut", True)))
    if node.class_name == "MaxPool2d":
        marks.append((path, ("pool kernel", _pool_kernel(node.attribute("kernel_size")))))
    if node.class_name == "SPPF" and node.attribute("n", 3) != 3:
        marks.append((path, ("pools", node.attribute("n"))))
    for name, child in children(node).items():
        if isinstance(child, Placeholder) and name != "act":
            marks.extend(pickled_marks(child, f"{path}.{name}" if path else name))
    return marks


def module_marks(module: torch.nn.Module, path: str = "") -> list[tuple[str, Mark]]:
    """The same marks for one of our modules (`use_residual` is our `add`, `num_pools` our SPPF's `n`)."""
    marks: list[tuple[str, Mark]] = []
    act = module._modules.get("act")
    if act is not None:
        marks.append((path, ("activation", type(act).__name__)))
    if getattr(module, "use_residual", False) is True:
        marks.append((path, ("shortcut", True)))
    if isinstance(module, torch.nn.MaxPool2d):
        marks.append((path, ("pool kernel", _pool_kernel(module.kernel_size))))
    if getattr(module, "num_pools", 3) != 3:
        marks.append((path, ("pools", module.num_pools)))
    for name, child in module.named_children():
        if name != "act":
            marks.extend(module_marks(child, f"{path}.{name}" if path else name))
    return marks


def _difference(theirs: tuple[str, Mark] | None, ours: tuple[str, Mark] | None) -> str:
    """Say in words how one pickled mark differs from ours at the same place in module order."""
    if theirs is not None and theirs[1][0] == "shortcut":
        return f"{theirs[0]} adds its input (a residual shortcut), ours does not"
    if ours is not None and ours[1][0] == "shortcut":
        return f"ours ({ours[0]}) adds its input (a residual shortcut), the file's does not"
    if theirs is None or ours is None:
        path, (kind, value) = theirs or ours  # type: ignore[misc]
        return f"{path or 'the layer'}: {kind} {value} has no counterpart {'here' if theirs else 'in the file'}"
    where = f"{theirs[0]} has " if theirs[0] else ""
    return f"{where}{theirs[1][0]} {theirs[1][1]}, ours{f' ({ours[0]})' if ours[0] else ''} {ours[1][1]}"


def check_marks(theirs: Placeholder, ours: torch.nn.Module, where: str) -> None:
    """Refuse a layer whose activations, residual flags or pooling differ from ours, in one line naming the module.

    Tensors of the right shapes are not enough: a LeakyReLU network or a flipped shortcut loads into
    ours without a complaint and computes something else.
    """
    their_marks, our_marks = pickled_marks(theirs), module_marks(ours)
    for index in range(max(len(their_marks), len(our_marks))):
        their_mark = their_marks[index] if index < len(their_marks) else None
        our_mark = our_marks[index] if index < len(our_marks) else None
        if their_mark is None or our_mark is None or their_mark[1] != our_mark[1]:
            difference = _difference(their_mark, our_mark)
            raise ConfigError(f"{where}: {difference}; converting it would change what the network computes")


def find_model(raw: Any, path: Path) -> Placeholder:
    """Return the pickled model of a YOLOv5/Ultralytics checkpoint: `ema` when present, else `model`."""
    model = (raw.get("ema") or raw.get("model")) if isinstance(raw, Mapping) else raw  # or a whole pickled model
    if not isinstance(model, Placeholder) or "model" not in children(model):
        raise ConfigError(f"{path}: not a YOLOv5 or Ultralytics checkpoint (no pickled model with a layer list)")
    return model


def layer_list(model: Placeholder) -> list[Placeholder]:
    """The pickled model's numbered layers (`model.model`, a Sequential), in index order."""
    return list(children(children(model)["model"]).values())


def conv_out_channels(conv_block: Placeholder) -> int:
    """Output channels of a pickled Conv-BN-act block (its `conv` child's weight rows)."""
    return int(children(conv_block)["conv"].attribute("_parameters")["weight"].shape[0])


def class_names(model: Placeholder, num_classes: int) -> list[str]:
    """Class names from the model (a list, or a {index: name} dict); numbers when absent or inconsistent."""
    names = model.attribute("names")
    if isinstance(names, Mapping):
        names = [names[key] for key in sorted(names)]
    if isinstance(names, (list, tuple)) and len(names) == num_classes:
        return [str(name) for name in names]
    return [str(index) for index in range(num_classes)]


def weights_only_checkpoint(converted: ConvertedModel, raw: Any, model: Placeholder, path: Path) -> Checkpoint:
    """Wrap a converted model as our Checkpoint (weights only, like a stripped best.pt); `raw` is the file's dict."""
    meta = raw if isinstance(raw, Mapping) else {}
    epoch = meta.get("epoch")
    fitness = meta.get("best_fitness")
    return Checkpoint(
        format_version=FORMAT_VERSION,
        task=converted.task,
        model_family=converted.spec.family,
        model_spec=converted.spec.to_dict(),
        names=class_names(model, converted.spec.num_classes),
        model=converted.weights,
        ema=converted.weights,
        ema_updates=0,
        optimizer=None,
        scaler=None,
        epoch=epoch if isinstance(epoch, int) else -1,
        best_fitness=float(fitness) if isinstance(fitness, (int, float)) else 0.0,
        train_config={"converted_from": str(path), "source_model": model.source},
        hyp={},
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        torch_version=str(torch.__version__),
    )
