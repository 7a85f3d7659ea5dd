"""Draw predictions on an image: tinted instance masks, boxes and 'name score' labels in the class colour."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from utils.plots import class_colour
from utils.predict.config import DrawStyle
from utils.predict.prediction import Prediction, class_name

MASK_ALPHA = 0.5  # weight of the class colour where a mask is set (YOLOv5's)
TEXT_COLOUR = (255, 255, 255)


def label_text(name: str, score: float, style: DrawStyle) -> str | None:
    """The text drawn above a box ('circle 0.87', 'circle', or None when labels are hidden)."""
    if style.hide_labels:
        return None
    return name if style.hide_conf else f"{name} {score:.2f}"


def annotate(image: np.ndarray, prediction: Prediction, names: Sequence[str], style: DrawStyle) -> np.ndarray:
    """Return a copy of `image` (H, W, 3) uint8 BGR with the prediction drawn on it.

    Masks are blended in first, then boxes from the lowest score up, so the most confident box
    and its label end on top.
    """
    canvas = image.copy()
    if prediction.masks is not None:
        tint_masks(canvas, prediction.masks, prediction.boxes_xyxy, prediction.class_ids)
    for index in reversed(range(len(prediction))):
        class_id = int(prediction.class_ids[index])
        text = label_text(class_name(names, class_id), float(prediction.scores[index]), style)
        draw_box(canvas, prediction.boxes_xyxy[index], text, class_colour(class_id), style.line_thickness)
    return canvas


def tint_masks(canvas: np.ndarray, masks: np.ndarray, boxes_xyxy: np.ndarray, class_ids: np.ndarray) -> None:
    """Blend each (H, W) bool mask into `canvas` in its class colour, in place.

    Masks are zero outside their boxes (segment/ops.crop_mask), so each blend touches only its
    box, widened by a pixel for the resize to the original size.
    """
    height, width = canvas.shape[:2]
    for mask, box, class_id in zip(masks, boxes_xyxy, class_ids, strict=True):
        x1, y1 = max(int(box[0]) - 1, 0), max(int(box[1]) - 1, 0)
        x2, y2 = min(int(np.ceil(box[2])) + 1, width), min(int(np.ceil(box[3])) + 1, height)
        region, inside = canvas[y1:y2, x1:x2], mask[y1:y2, x1:x2]
        colour = np.array(class_colour(int(class_id)), np.float32)
        region[inside] = (region[inside] * (1 - MASK_ALPHA) + colour * MASK_ALPHA).astype(np.uint8)


def draw_box(
    canvas: np.ndarray, box_xyxy: np.ndarray, text: str | None, colour: tuple[int, int, int], thickness: int
) -> None:
    """Draw one box and, unless `text` is None, its label on a filled band above it (inside when at the top)."""
    x1, y1, x2, y2 = (int(round(float(v))) for v in box_xyxy)
    cv2.rectangle(canvas, (x1, y1), (x2, y2), colour, thickness, cv2.LINE_AA)
    if text is None:
        return
    font_scale, font_thickness = thickness / 3, max(thickness - 1, 1)
    text_w, text_h = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, font_scale, font_thickness)[0]
    above = y1 - text_h - 3 >= 0
    band_bottom = y1 - text_h - 3 if above else y1 + text_h + 3
    cv2.rectangle(canvas, (x1, y1), (x1 + text_w, band_bottom), colour, -1, cv2.LINE_AA)
    baseline = y1 - 2 if above else y1 + text_h + 2
    cv2.putText(
        canvas, text, (x1, baseline), cv2.FONT_HERSHEY_SIMPLEX, font_scale, TEXT_COLOUR, font_thickness, cv2.LINE_AA
    )
