"""Every family, task and output layout exports to every CPU format, passes the parity check at export,
reads back its metadata, and its backend selects the checkpoint's detections.

The matrix is built from the model families (utils/families.py), so a new layout without an export path
fails here. TensorRT needs CUDA and is covered by its refusals (tests/test_openvino.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import anchor_free
from tests.exports import DYNAMIC, IMGSZ, Exports, cpu_formats, task_of
from utils.backends import BackendRequest, load_backend
from utils.backends.metadata import CHANNELS_FIRST, END_TO_END, ROWS, read_metadata
from utils.families import FAMILIES, spec_from_cfg

BOX_ATOL_PX = 2e-3  # as tests/test_backends.py: runtimes reorder sums (boxes move ~1e-4 px at 64 px)
CPU = torch.device("cpu")
# One size per layout of each family; yolo26 also exports its one-to-many head for NMS (--nms).
LAYOUTS = {"yolov5": ("yolov5n", ROWS), "yolov8": ("yolov8n", CHANNELS_FIRST), "yolo11": ("yolo11n", CHANNELS_FIRST),
           "yolo26": ("yolo26n", END_TO_END)}  # fmt: skip
# (model name, --nms) -> the layout its files hold.
MATRIX = {
    (f"{name}{suffix}", nms): CHANNELS_FIRST if nms else layout
    for name, layout in LAYOUTS.values()
    for suffix in ("", "-seg")
    for nms in ((False, True) if layout == END_TO_END else (False,))
}
# Rows of DYNAMIC are exported with --dynamic: the files tests/test_backends.py, tests/test_openvino.py and
# tests/test_export_anchor_free.py run at other batches and sizes, shared with them (tests/exports.py) instead of
# exported again. The other rows keep the default static export, so it still runs in every layout (ROWS: yolov5n-seg;
# CHANNELS_FIRST: yolo11n and the --nms rows; END_TO_END: yolo26n and yolo26n-seg).


pytestmark = [
    pytest.mark.slow,  # about a minute of exports: out of the fast loop
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning"),  # TorchScript is under test
]


def test_the_matrix_holds_every_family_layout_and_task() -> None:
    # YOLOv5 and every anchor-free layout, detect and -seg, and both heads of the end-to-end layout.
    assert set(FAMILIES) == {"yolov5", "anchor_free"}, "a new model family needs rows in LAYOUTS"
    assert set(LAYOUTS) == {"yolov5", *anchor_free.LAYOUTS}, "an anchor-free layout has no row in LAYOUTS"
    for architecture, (name, _) in LAYOUTS.items():
        spec = spec_from_cfg(name, 6)
        assert getattr(spec, "layout", spec.family) == architecture
    assert len(MATRIX) == 10 and set(MATRIX.values()) == {ROWS, CHANNELS_FIRST, END_TO_END}


@pytest.mark.parametrize(("name", "nms"), list(MATRIX), ids=lambda value: {True: "nms", False: ""}.get(value, value))
def test_every_format_exports_within_tolerance_and_selects_the_checkpoints_detections(
    name: str, nms: bool, exports: Exports
) -> None:
    task = task_of(name)
    spec = spec_from_cfg(name, 6)
    family, num_masks = spec.family, spec.num_masks
    formats = cpu_formats()
    # The one export_checkpoint call of all formats, with what it logged and traced (the first test to ask made it).
    done = exports.get(name, formats, dynamic=name in DYNAMIC, nms=nms)
    weights, exported = done.weights, done.exported
    assert [item.file_format for item in exported] == list(formats)
    assert done.traces == 1, "TorchScript and OpenVINO export one trace of the same CPU graph"
    for item in exported:  # the parity check ran, passed, and its line was printed
        assert item.max_abs_diff is not None and item.tolerance_share <= 1, item
        assert any(f"{item.file_format}: {item.path}" in line and "matches PyTorch" in line for line in done.messages)
    # A traced graph that names a device (torch.arange(device=...) in a trace) builds its grids there whatever
    # device it runs on: a file traced on the CPU would then fail on CUDA. The grids follow the input instead.
    graph = str(torch.jit.load(str(exported[0].path)).inlined_graph)
    assert "Device = prim::Constant" not in graph

    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(1))
    selected = {}
    for kind, path in {"pt": weights, **{item.file_format: item.path for item in exported}}.items():
        backend = load_backend(path, BackendRequest(task.name, "val", CPU, nms=nms and kind == "pt"))
        if kind != "pt":  # what export wrote, and what the backend reports from it
            metadata = read_metadata(path)
            layout = MATRIX[name, nms]
            keys = ("family", "layout", "task", "end2end", "num_masks", "imgsz")
            assert [metadata[key] for key in keys] == [family, layout, task.name, layout == END_TO_END, num_masks,
                                                       [IMGSZ, IMGSZ]], kind  # fmt: skip
            info = backend.info
            assert (info.family, info.layout, info.end_to_end, info.num_masks) == (family, layout, layout == END_TO_END,
                                                                                  num_masks), kind  # fmt: skip
        with torch.no_grad():
            rows, extra = backend(images)
        if task.with_masks:
            assert extra[1].shape == (2, backend.info.num_masks, IMGSZ // 4, IMGSZ // 4), kind
        selected[kind] = backend.selector()(rows, 0.001, 0.6, max_det=300, num_masks=backend.info.num_masks,
                                            multi_label=True)  # fmt: skip
    for kind in formats:
        for want, got in zip(selected["pt"], selected[kind], strict=True):
            assert len(want) == len(got) > 0, kind
            # As sets: a random head scores some boxes within 1e-7 of each other, which runtimes may rank either way.
            close = np.isclose(got.numpy()[None], want.numpy()[:, None], atol=BOX_ATOL_PX, rtol=1e-3).all(axis=2)
            assert close.any(axis=1).all() and close.any(axis=0).all(), kind
