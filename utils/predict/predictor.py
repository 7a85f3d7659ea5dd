"""The prediction loop of detect.py and segment/predict.py: every rank predicts its share of the inputs and saves it.

Entry: `predict(cfg, task, ctx)`. Rank 0 resolves --source into one ordered list, every rank takes
items rank, rank + world_size, ... (`shard_inputs`), predicts them one image (or video frame) at a
time with `FramePredictor` (letterbox, forward, single-label NMS, boxes and masks back to the
original pixels) and writes its outputs into the run folder rank 0 created. The counts are gathered
once at the end for rank 0's summary. Detection and segmentation share every line; segmentation
only adds `task.predict_masks`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from utils.backends import (
    BackendRequest,
    InferenceBackend,
    as_backend,
    leave_cores_to_runtime,
    load_backend,
    resolve_imgsz,
)
from utils.boxes import load_nms, scale_boxes
from utils.data.augment import bgr_to_rgb_chw, letterbox
from utils.data.batch import ShapeInfo
from utils.distributed import DistContext, all_gather_objects, broadcast_object, run_on_main
from utils.errors import ConfigError
from utils.predict.config import PredictConfig
from utils.predict.draw import annotate
from utils.predict.outputs import RunWriter, VideoSink, annotated_suffix, write_image
from utils.predict.prediction import Prediction, class_name, counted
from utils.predict.sources import (
    InputItem,
    UnreadableInputError,
    VideoReader,
    discover_inputs,
    read_image,
    shard_inputs,
)
from utils.runs import create_run_dir
from utils.tasks import Task

LOGGER = logging.getLogger(__name__)
MAX_REPORTED = 10  # skipped inputs named in rank 0's summary (each was already warned about once)


@dataclass
class Tally:
    """What predicting a set of inputs did; summed over ranks for the summary."""

    images: int = 0  # image files predicted
    videos: int = 0  # video files and webcams predicted
    frames: int = 0  # pictures predicted: images plus video frames
    detections: int = 0
    labels: int = 0  # labels/*.txt files written
    num_skipped: int = 0  # unreadable inputs
    skipped: list[str] = field(default_factory=list)  # their one-line reasons (gathered: the first few per rank)
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(3))  # pre-process, inference, NMS, summed
    processed: list[str] = field(default_factory=list)  # inputs predicted, in order (this rank's; not gathered)

    @staticmethod
    def merged(tallies: Sequence[Tally]) -> Tally:
        """The sum of per-rank tallies (skipped reasons concatenated in rank order, `processed` left empty)."""
        total = Tally()
        for tally in tallies:
            total.images += tally.images
            total.videos += tally.videos
            total.frames += tally.frames
            total.detections += tally.detections
            total.labels += tally.labels
            total.num_skipped += tally.num_skipped
            total.skipped += tally.skipped
            total.seconds = total.seconds + tally.seconds
        return total


@dataclass
class PredictResult:
    """What `predict` returns on every rank."""

    save_dir: Path
    total: Tally  # all ranks (identical on every rank)
    mine: Tally  # this rank's, with the inputs it predicted in `processed`
    loop_seconds: float  # this rank's wall time over its inputs: reading, inference, drawing, writing


class FramePredictor:
    """Predict one (H, W, 3) uint8 BGR image at a time with a loaded model: boxes (and masks) in its pixels.

    Rectangular letterbox (YOLOv5's `auto=True`: the long side fits `cfg.imgsz`, the short side is
    padded to a multiple of the model's largest stride; a fixed-shape export gets exactly its size),
    a batch of one, single-label NMS (one class per box, what a deployed detector reports), and the
    letterbox undone (`scale_boxes`; masks via `task.predict_masks`). `model` is an inference backend
    (utils/backends) or a plain eval module.
    """

    def __init__(self, model: InferenceBackend | nn.Module, task: Task, cfg: PredictConfig) -> None:
        self.model = as_backend(model)
        self.device, self.dtype = self.model.device, self.model.dtype
        self.stride = self.model.info.stride
        self.num_masks = self.model.info.num_masks
        # A fixed-shape file takes only its own size: letterbox to it, not to the smallest stride multiple.
        self.is_rectangular = not self.model.info.fixed_shape
        self.select = self.model.selector()  # NMS, or an end-to-end head's top scores
        load_nms()  # before the first timed NMS
        self.predict_masks = task.predict_masks
        self.cfg = cfg

    @torch.no_grad()
    def __call__(self, image: np.ndarray) -> tuple[Prediction, tuple[int, int], np.ndarray]:
        """Return (prediction, letterboxed input (H, W), seconds spent in pre-process, inference, NMS)."""
        start = time.perf_counter()
        letterboxed, ratio_wh, pad_wh = letterbox(image, self.cfg.imgsz, auto=self.is_rectangular, stride=self.stride)
        chw = bgr_to_rgb_chw(letterboxed)
        inputs = torch.from_numpy(chw).to(self.device)[None].to(self.dtype) / 255
        _sync(self.device)
        after_pre = time.perf_counter()
        decoded, head_extra = self.model(inputs)
        _sync(self.device)
        after_inference = time.perf_counter()
        cfg = self.cfg
        detections = self.select(
            decoded.float(),
            cfg.conf_thres,
            cfg.iou_thres,
            classes=list(cfg.classes) if cfg.classes is not None else None,
            agnostic=cfg.agnostic_nms,
            max_det=cfg.max_det,
            num_masks=self.num_masks,
            multi_label=False,
        )[0]
        after_nms = time.perf_counter()
        input_hw = (int(inputs.shape[2]), int(inputs.shape[3]))
        shape: ShapeInfo = (image.shape[:2], ((ratio_wh[1], ratio_wh[0]), pad_wh))
        prediction = self._to_original(detections, head_extra, input_hw, shape)
        seconds = np.array((after_pre - start, after_inference - after_pre, after_nms - after_inference))
        return prediction, input_hw, seconds

    def _to_original(
        self, detections: torch.Tensor, head_extra: Any, input_hw: tuple[int, int], shape: ShapeInfo
    ) -> Prediction:
        """Map NMS rows (n, 6 + nm) in input pixels to a Prediction in the original image's pixels."""
        orig_hw, ratio_pad = shape
        boxes = scale_boxes(detections[:, :4], input_hw, orig_hw, ratio_pad)
        masks = None
        if self.predict_masks is not None:
            empty = np.zeros((0, *orig_hw), bool)
            masks = self.predict_masks(head_extra, detections, input_hw, shape) if len(detections) else empty
        return Prediction(
            boxes.cpu().numpy().astype(np.float32),
            detections[:, 4].cpu().numpy().astype(np.float32),
            detections[:, 5].long().cpu().numpy(),
            masks,
        )


def describe(prediction: Prediction, names: Sequence[str]) -> str:
    """YOLOv5's per-image summary: '2 circles, 2 crosses, 1 square', or '(no detections)'."""
    if not len(prediction):
        return "(no detections)"
    ids, counts = np.unique(prediction.class_ids, return_counts=True)
    parts = [(class_name(names, int(c)), int(n)) for c, n in zip(ids, counts, strict=True)]
    return ", ".join(counted(n, name) for name, n in parts)


class PredictionLoop:
    """Predict a rank's inputs in order, save what the options ask for, and count it in `tally`.

    An input that cannot be read is skipped with one warning naming it and counted; it never
    stops the run. Per-picture lines ('image 3/10 path: 480x640 2 circles, 12.3ms') are logged at
    INFO, which only rank 0 shows.
    """

    def __init__(
        self, predictor: FramePredictor, writer: RunWriter, cfg: PredictConfig, total_inputs: int,
        webcam: VideoReader | None = None,
    ) -> None:  # fmt: skip
        self.predictor = predictor
        self.writer = writer
        self.cfg = cfg
        self.total_inputs = total_inputs
        self.webcam = webcam  # the webcam input, opened before the run folder was made (open_webcam)
        self.tally = Tally()

    def run(self, items: Sequence[InputItem]) -> Tally:
        """Predict every item; returns the tally (also kept in `self.tally`)."""
        for item in items:
            try:
                if item.kind == "image":
                    self._image(item)
                else:
                    self._video(item)
            except UnreadableInputError as error:
                LOGGER.warning(f"Skipped {error}")
                self.tally.num_skipped += 1
                self.tally.skipped.append(str(error))
        self.tally.labels = self.writer.labels_written
        return self.tally

    def _image(self, item: InputItem) -> None:
        image = read_image(item.path)
        prefix = f"image {item.index + 1}/{self.total_inputs} {item.path}"
        annotated = self._picture(image, item.stem, prefix)
        if annotated is not None:
            write_image(self.writer.save_dir / f"{item.stem}{annotated_suffix(Path(item.path).suffix)}", annotated)
        self.tally.images += 1
        self.tally.processed.append(item.path)

    def _video(self, item: InputItem) -> None:
        """Predict a video's (or webcam's) frames into <stem>.mp4 at the input's fps / --vid-stride."""
        webcam = item.kind == "webcam" and self.webcam is not None
        with self.webcam if webcam else VideoReader(item, self.cfg.vid_stride) as reader:
            sink_fps = reader.fps / self.cfg.vid_stride  # plays at the input's speed whatever the stride
            with VideoSink(self.writer.save_dir / f"{item.stem}.mp4", sink_fps) as sink:
                frames = self._video_frames(item, reader, sink)
        if frames == 0:
            raise UnreadableInputError(f"{item.path}: no readable frames")
        self.tally.videos += 1
        self.tally.processed.append(item.path)

    def _video_frames(self, item: InputItem, reader: VideoReader, sink: VideoSink) -> int:
        """Predict the frames `reader` yields, appending the annotated ones to `sink`; returns how many."""
        frames = 0
        try:
            for frame_number, frame in reader:
                if item.kind == "webcam":
                    prefix = f"webcam {item.path} (frame {frame_number})"
                else:
                    of_count = f"/{reader.frame_count}" if reader.frame_count else ""
                    prefix = f"video {item.index + 1}/{self.total_inputs} (frame {frame_number}{of_count}) {item.path}"
                annotated = self._picture(frame, f"{item.stem}_{frame_number}", prefix)
                if annotated is not None:
                    sink.write(annotated)
                frames += 1
        except KeyboardInterrupt:
            if item.kind != "webcam":
                raise
            LOGGER.info(f"Webcam {item.path} stopped (Ctrl-C) after {frames} frames")  # a webcam never ends itself
        return frames

    def _picture(self, image: np.ndarray, stem: str, prefix: str) -> np.ndarray | None:
        """Predict one picture, write its labels and crops, log its line; return it annotated (None with --nosave)."""
        prediction, input_hw, seconds = self.predictor(image)
        self.tally.frames += 1
        self.tally.detections += len(prediction)
        self.tally.seconds = self.tally.seconds + seconds
        self.writer.save_labels(stem, prediction, image.shape[:2])
        self.writer.save_crops(stem, image, prediction)
        names = self.writer.names
        LOGGER.info(f"{prefix}: {input_hw[0]}x{input_hw[1]} {describe(prediction, names)}, {1000 * seconds[1]:.1f}ms")
        return annotate(image, prediction, names, self.cfg.style) if self.writer.options.save_images else None


def load_predictor_model(
    cfg: PredictConfig, task: Task, ctx: DistContext
) -> tuple[InferenceBackend, tuple[str, ...], tuple[int, int]]:
    """Load `cfg.weights` (checkpoint or exported file: utils/backends), its class names and the (h, w) to predict at.

    The size is --imgsz, else the one the checkpoint was trained at (trained_imgsz) or the file was
    exported at; a fixed-size export refuses another. --classes is checked against the model's classes.
    """
    request = BackendRequest.from_flags(cfg, task.name, "predict", ctx.device)
    backend = load_backend(cfg.weights, request)
    if cfg.agnostic_nms and backend.info.end_to_end:
        LOGGER.warning(
            f"--agnostic-nms changes nothing here: {cfg.weights} selects with its NMS-free head, which suppresses "
            "nothing (--nms for its other head and NMS)"
        )
    names = backend.info.names
    if cfg.classes is not None and max(cfg.classes) >= len(names):
        raise ConfigError(
            f"--classes {' '.join(map(str, cfg.classes))}: {cfg.weights} has {len(names)} classes (0-{len(names) - 1})"
        )
    imgsz = resolve_imgsz(backend.info, cfg.imgsz)
    leave_cores_to_runtime(backend)  # after the checks: a refusal stays the only line
    return backend, names, imgsz


def predict(cfg: PredictConfig, task: Task, ctx: DistContext) -> PredictResult:
    """Predict every input of `cfg.source` once across all ranks and save the results; every rank calls it.

    Rank 0 lists the inputs and picks the run folder (`--project/--name`, numbered exp, exp2, ...)
    and both are broadcast, so ranks agree; a bad --source is a one-line ConfigError on every
    rank. Each rank writes its own inputs' outputs there. The summary (speeds, counts, skipped
    inputs, where results went) is logged by rank 0 after one gather that every rank joins.
    """
    model, names, imgsz = load_predictor_model(cfg, task, ctx)
    cfg = dataclasses.replace(cfg, imgsz=imgsz)
    found = run_on_main(lambda: discover_inputs(cfg.source), ctx, "finding the --source inputs")
    items: list[InputItem] = broadcast_object(found, ctx)
    mine = shard_inputs(items, ctx)
    webcam = open_webcam(mine, cfg.vid_stride)  # a camera that does not open leaves no empty run folder behind
    save_dir = create_run_dir(cfg.project, cfg.name, cfg.exist_ok, ctx, ("labels",) if cfg.save.save_txt else ())
    LOGGER.info(f"Predicting {len(items)} inputs from {cfg.source} on {ctx.world_size} process(es) into {save_dir}")
    if ctx.device.type == "cuda":  # the first CUDA forward pays for kernel selection; keep it out of the timings
        warm_up(model, cfg.imgsz)
    writer = RunWriter(save_dir, names, cfg.save)
    loop = PredictionLoop(FramePredictor(model, task, cfg), writer, cfg, len(items), webcam)
    start = time.perf_counter()
    mine_tally = loop.run(mine)
    loop_seconds = time.perf_counter() - start
    gathered = all_gather_objects(
        dataclasses.replace(mine_tally, skipped=mine_tally.skipped[:MAX_REPORTED], processed=[]), ctx
    )
    total = Tally.merged(gathered)
    if ctx.is_main:
        log_summary(total, save_dir, cfg, ctx.world_size)
    return PredictResult(save_dir, total, mine_tally, loop_seconds)


def open_webcam(items: Sequence[InputItem], vid_stride: int) -> VideoReader | None:
    """The webcam among `items` opened (a one-line ConfigError when it cannot be), or None without one."""
    webcams = [item for item in items if item.kind == "webcam"]
    return VideoReader(webcams[0], vid_stride) if webcams else None


def warm_up(model: InferenceBackend, imgsz: tuple[int, int]) -> None:
    """Run one forward on a blank image of `imgsz` (outside the timings)."""
    with torch.no_grad():
        model(torch.zeros((1, 3, *imgsz), device=model.device, dtype=model.dtype))


def log_summary(total: Tally, save_dir: Path, cfg: PredictConfig, world_size: int) -> None:
    """Rank 0's closing lines: per-image speeds, counts, skipped inputs, where the results are."""
    if total.frames:
        pre, inference, nms = (1000 * total.seconds / total.frames).tolist()
        speeds = f"{pre:.1f}ms pre-process, {inference:.1f}ms inference, {nms:.1f}ms NMS"
        LOGGER.info(f"Speed: {speeds} per image at shape {(1, 3, *cfg.imgsz)}")
    LOGGER.info(
        f"Predicted {total.frames} images ({total.images} image files, {total.videos} videos) "
        f"on {world_size} process(es): {total.detections} detections"
    )
    if total.num_skipped:
        shown = "; ".join(total.skipped[:MAX_REPORTED])
        more = f" (and {total.num_skipped - MAX_REPORTED} more)" if total.num_skipped > MAX_REPORTED else ""
        LOGGER.warning(f"Skipped {total.num_skipped} unreadable input(s): {shown}{more}")
    labels = f", {total.labels} labels saved to {save_dir / 'labels'}" if cfg.save.save_txt else ""
    LOGGER.info(f"Results saved to {save_dir}{labels}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
