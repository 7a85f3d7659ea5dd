"""Prediction: one image's detections in original-image pixels, the record the loop hands to drawing and saving."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Prediction:
    """One image's detections in original-image pixels, highest score first."""

    boxes_xyxy: np.ndarray  # (n, 4) float32, clipped to the image
    scores: np.ndarray  # (n,) float32 in [0, 1]
    class_ids: np.ndarray  # (n,) int64
    masks: np.ndarray | None = None  # segmentation: (n, H0, W0) bool at the original size

    def __len__(self) -> int:
        return len(self.scores)


def counted(count: int, name: str) -> str:
    """'1 circle', '2 circles', '2 crosses', '3 batteries': a class name with its count, in English plural.

    YOLOv5 appends an 's' ('2 crosss'). Names ending in a single 's' are left as they are ('2 skis',
    '2 scissors'), since most such class names are plural already ('bus' is the exception: buses).
    """
    if count == 1:
        return f"1 {name}"
    lower = name.lower()
    if lower.endswith(("ss", "us", "x", "z", "ch", "sh")):
        return f"{count} {name}es"
    if lower.endswith("s"):
        return f"{count} {name}"
    if len(lower) > 1 and lower.endswith("y") and lower[-2] not in "aeiou":
        return f"{count} {name[:-1]}ies"
    return f"{count} {name}s"


def class_name(names: Sequence[str], class_id: int) -> str:
    """The class's name, or its id as text when the checkpoint names fewer classes."""
    return names[class_id] if 0 <= class_id < len(names) else str(class_id)
