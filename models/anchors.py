"""AutoAnchor: check how well the anchors fit the dataset's boxes and refit them (k-means + evolution) if not."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

LOGGER = logging.getLogger(__name__)

BPR_TARGET = 0.98  # refit only when fewer than this share of labels can be matched by some anchor
MIN_SIZE_PX = 2.0  # labels below this say nothing useful about anchor shapes; anchors never shrink below it
MAX_FIT_LABELS = 10_000  # labels sampled for fitting: enough for the statistics, bounded time


def anchor_match_ratios(label_wh: np.ndarray, anchors_wh: np.ndarray) -> np.ndarray:
    """Return the (n, k) shape-match ratio of each label to each anchor, in (0, 1], 1 = same size.

    ratio = min over w and h of min(r, 1/r) with r = label / anchor: the worse of the two sides,
    symmetric in over- and under-size. The loss accepts a match when ratio > 1 / anchor_t.
    Computed as exp(-max |log r|), which is the same number and much cheaper in the evolution loop.
    """
    return np.exp(-_log_gaps(np.log(label_wh), np.log(anchors_wh)))


def _log_gaps(log_label_wh: np.ndarray, log_anchors_wh: np.ndarray) -> np.ndarray:
    """(n, k) worse-side |log(label / anchor)| of every label-anchor pair."""
    gap_w = np.abs(log_label_wh[:, None, 0] - log_anchors_wh[None, :, 0])
    gap_h = np.abs(log_label_wh[:, None, 1] - log_anchors_wh[None, :, 1])
    return np.maximum(gap_w, gap_h)


def best_possible_recall(label_wh: np.ndarray, anchors_wh: np.ndarray, threshold: float) -> float:
    """Share of labels that at least one anchor can be matched to under the loss's `anchor_t` rule."""
    best_gap = _log_gaps(np.log(label_wh), np.log(anchors_wh)).min(axis=1)
    return float((best_gap < np.log(threshold)).mean())


def anchor_fitness(log_label_wh: np.ndarray, anchors_wh: np.ndarray, threshold: float) -> float:
    """Mean best match ratio over labels, counting only matchable ones: what evolution maximises.

    Takes the labels' log sizes, computed once by the caller, because it runs every generation.
    """
    best_gap = _log_gaps(log_label_wh, np.log(anchors_wh).astype(log_label_wh.dtype)).min(axis=1)
    return float((np.exp(-best_gap) * (best_gap < np.log(threshold))).mean())


def kmeans(points: np.ndarray, num_clusters: int, rng: np.random.Generator, iterations: int = 30) -> np.ndarray:
    """Cluster (n, d) points with k-means++ seeding and Lloyd iterations; returns (num_clusters, d) centres.

    An emptied cluster is re-seeded at the point farthest from its centre, so exactly
    `num_clusters` centres come back. Needs n >= num_clusters.
    """
    centres = [points[rng.integers(len(points))]]
    for _ in range(1, num_clusters):
        dist2 = ((points[:, None, :] - np.asarray(centres)[None]) ** 2).sum(-1).min(axis=1)
        probs = dist2 / dist2.sum() if dist2.sum() > 0 else np.full(len(points), 1 / len(points))
        centres.append(points[rng.choice(len(points), p=probs)])
    centres_arr = np.asarray(centres, dtype=np.float64)
    for _ in range(iterations):
        dist2 = ((points[:, None, :] - centres_arr[None]) ** 2).sum(-1)
        assignment = dist2.argmin(axis=1)
        updated = centres_arr.copy()
        for cluster in range(num_clusters):
            members = points[assignment == cluster]
            if len(members):
                updated[cluster] = members.mean(axis=0)
            else:
                updated[cluster] = points[dist2[np.arange(len(points)), assignment].argmax()]
        if np.allclose(updated, centres_arr):
            break
        centres_arr = updated
    return centres_arr


def evolve_anchors(
    label_wh: np.ndarray, anchors_wh: np.ndarray, threshold: float, rng: np.random.Generator, generations: int = 1000
) -> np.ndarray:
    """Improve anchors by random multiplicative mutation, keeping a mutant only when fitness rises.

    Each generation scales ~90% of the anchor sides by a factor around 1 (sigma ~0.1, clipped to
    [0.3, 3]); anchors never shrink below 2 px. Deterministic for a given `rng`.
    """
    log_label_wh = np.log(label_wh).astype(np.float32)  # float32 halves the cost of the hot loop
    best, best_fitness = anchors_wh.copy(), anchor_fitness(log_label_wh, anchors_wh, threshold)
    for _ in range(generations):
        mutate = rng.random(best.shape) < 0.9
        factor = (1 + mutate * rng.random() * rng.standard_normal(best.shape) * 0.1).clip(0.3, 3.0)
        candidate = (best * factor).clip(min=MIN_SIZE_PX)
        fitness = anchor_fitness(log_label_wh, candidate, threshold)
        if fitness > best_fitness:
            best, best_fitness = candidate, fitness
    return best


def kmean_anchors(
    label_wh: np.ndarray, num_anchors: int = 9, threshold: float = 4.0, generations: int = 1000, seed: int = 0
) -> np.ndarray:
    """Fit `num_anchors` anchors (pixels) to label sizes: whitened k-means, then evolution; sorted by area.

    Sizes are divided by their per-axis std before k-means so w and h weigh the same. With fewer
    labels than anchors the start is a jittered resample of the labels instead of k-means.
    """
    rng = np.random.default_rng(seed)
    wh = label_wh[(label_wh >= MIN_SIZE_PX).all(axis=1)].astype(np.float64)
    if len(wh) == 0:
        raise ValueError("kmean_anchors: no labels of at least 2 pixels to fit anchors to")
    if len(wh) > MAX_FIT_LABELS:
        wh = wh[rng.choice(len(wh), MAX_FIT_LABELS, replace=False)]
    if len(wh) >= num_anchors:
        std = wh.std(axis=0).clip(min=1e-6)
        anchors = kmeans(wh / std, num_anchors, rng) * std
    else:
        anchors = wh[rng.integers(len(wh), size=num_anchors)] * rng.uniform(0.8, 1.2, size=(num_anchors, 2))
    anchors = evolve_anchors(wh, anchors, threshold, rng, generations)
    return anchors[np.argsort(anchors.prod(axis=1))]


def check_anchors(
    label_wh: np.ndarray, model: nn.Module, threshold: float = 4.0, imgsz: int = 640, seed: int = 0
) -> bool:
    """Refit the model's anchors in place when best-possible recall (BPR) on the labels is below 0.98.

    label_wh: (n, 2) label widths and heights in pixels at the training image size `imgsz`
    (used only in the log line). New anchors are sorted by area and split over the levels
    finest-first, stored in grid units in `head.anchors`, and kept only if their BPR beats the old.
    Deterministic for the same inputs and `seed`, so every rank reaches the same anchors; call it
    before wrapping the model in DDP or building the EMA. Returns whether the anchors changed.
    """
    head = model.head  # a plain model: AutoAnchor runs before the DDP wrapper exists
    strides = head.stride.detach().cpu().numpy().astype(np.float64)
    current = (head.anchors.detach().cpu().numpy() * strides[:, None, None]).reshape(-1, 2)
    wh = np.asarray(label_wh, dtype=np.float64).reshape(-1, 2)
    wh = wh[(wh > 0).all(axis=1)]
    if len(wh) == 0:
        LOGGER.info("AutoAnchor: no labels to check anchors against, keeping the current anchors")
        return False
    bpr = best_possible_recall(wh, current, threshold)
    per_label = (anchor_match_ratios(wh, current) > 1 / threshold).sum(axis=1).mean()
    if bpr >= BPR_TARGET:
        LOGGER.info("AutoAnchor: %.2f anchors/target, BPR %.4f at %s px: current anchors fit", per_label, bpr, imgsz)
        return False
    fitted = kmean_anchors(wh, len(current), threshold, seed=seed)
    new_bpr = best_possible_recall(wh, fitted, threshold)
    if new_bpr <= bpr:
        message = "AutoAnchor: BPR %.4f < %.2f but a refit only reaches %.4f; keeping the anchors"
        LOGGER.info(message, bpr, BPR_TARGET, new_bpr)
        return False
    levels_px = np.empty(tuple(head.anchors.shape))
    levels_px[np.argsort(strides)] = fitted.reshape(levels_px.shape)  # smallest anchors on the finest level
    with torch.no_grad():
        head.anchors.copy_(torch.from_numpy(levels_px / strides[:, None, None]).to(head.anchors))
    rounded = np.round(levels_px).astype(int).reshape(len(strides), -1).tolist()
    LOGGER.info("AutoAnchor: BPR %.4f -> %.4f at %s px, anchors replaced (pixels): %s", bpr, new_bpr, imgsz, rounded)
    return True
