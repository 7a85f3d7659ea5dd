"""tune.py's search space: a YAML of bounds and scales per hyp key, read against the base recipe's hyp."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import ConfigError, read_yaml_mapping
from utils.hyp import FAMILY_HYP_KEYS, POSITIVE_KEYS, UNIT_KEYS, Hyp

LOGGER = logging.getLogger(__name__)
SCALES = ("linear", "log", "int")
FIXED = "fixed"


@dataclass(frozen=True)
class Dimension:
    """One searched hyp key: sampled in [low, high] on `scale` (linear, log or int); bounds are absolute."""

    key: str
    low: float
    high: float
    scale: str = "linear"

    def contains(self, value: float) -> bool:
        """Whether `value` lies inside the bounds (the base recipe's value may not)."""
        return self.low <= value <= self.high


@dataclass(frozen=True)
class SearchSpace:
    """What a study searches: the base hyp and the keys it varies; every other key keeps the base value.

    `path` is the YAML it came from (messages name it). `base_params` are the searched keys' values in
    the base hyp: the study's first trial, so every tuned trial is compared with the recipe it replaces.
    """

    path: Path
    base: Hyp
    dimensions: tuple[Dimension, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        """The searched keys, in the file's order."""
        return tuple(dimension.key for dimension in self.dimensions)

    @property
    def base_params(self) -> dict[str, float]:
        """The base hyp's values of the searched keys."""
        return {key: float(getattr(self.base, key)) for key in self.keys}

    def base_inside(self) -> list[str]:
        """Keys whose base value lies outside their bounds (empty when the base recipe can be the first trial)."""
        return [d.key for d in self.dimensions if not d.contains(float(getattr(self.base, d.key)))]

    def hyp_for(self, params: dict[str, float]) -> Hyp:
        """The base hyp with `params` (searched key -> value) put in; int dimensions stay whole numbers."""
        unknown = sorted(set(params) - set(self.keys))
        if unknown:
            raise ConfigError(f"{self.path}: '{unknown[0]}' is not searched by this space")
        return dataclasses.replace(self.base, **{key: float(value) for key, value in params.items()})


def load_space(path: Path, base: Hyp, family_keys: tuple[str, ...]) -> SearchSpace:
    """Read a search-space YAML for a run whose base recipe is `base` and whose family's loss reads `family_keys`.

    Each entry is `fixed`, `[low, high]`, `[low, high, scale]` with scale linear | log | int, and a
    bound may be `xF`: F times the base value. Every problem is one ConfigError naming the file and
    the key: an unknown key, a key of another model family, a bound that is not a number, low >= high,
    a log bound <= 0, int bounds that are not whole numbers, bounds outside the key's range (_check_range),
    an unknown scale, a key given twice (read_yaml_mapping). Keys left out are fixed.
    """
    raw = read_yaml_mapping(Path(path))
    known = {field.name for field in dataclasses.fields(Hyp)}
    dimensions = []
    for key, value in raw.items():
        key = str(key)
        if key not in known:
            raise ConfigError(f"{path}: '{key}' is not a hyperparameter (known: {', '.join(sorted(known))})")
        if key in FAMILY_HYP_KEYS and key not in family_keys:
            raise ConfigError(
                f"{path}: '{key}' is not read by this model family's loss (its own keys: {', '.join(family_keys)})"
            )
        if value == FIXED:
            continue
        dimensions.append(_dimension(path, key, value, getattr(base, key)))
    if not dimensions:
        raise ConfigError(f"{path}: every key is fixed; give at least one key bounds, e.g. 'lr0: [x0.2, x5, log]'")
    return SearchSpace(Path(path), base, tuple(dimensions))


def _check_range(where: str, key: str, low: float, high: float) -> None:
    """Raise the one-line ConfigError for bounds outside the range where `key` means something (utils/hyp.py):
    bounds outside would fail, or do nonsense, only inside a trial, after the study has started."""
    if key in UNIT_KEYS and (low < 0 or high > 1):
        raise ConfigError(f"{where}: bounds [{low:g}, {high:g}] leave its range [0, 1]")
    if key in POSITIVE_KEYS and low <= 0:
        raise ConfigError(f"{where}: bounds [{low:g}, {high:g}] must be above 0")
    if low < 0:
        raise ConfigError(f"{where}: bounds [{low:g}, {high:g}] must be 0 or more")


def _dimension(path: Path, key: str, value: Any, base_value: float | None) -> Dimension:
    """One entry's Dimension, checked (see load_space)."""
    where = f"{path}: '{key}'"
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise ConfigError(f"{where} must be 'fixed' or [low, high] or [low, high, scale], got {value!r}")
    scale = str(value[2]) if len(value) == 3 else "linear"
    if scale not in SCALES:
        raise ConfigError(f"{where}: scale '{scale}' is not one of {', '.join(SCALES)}")
    low, high = (_bound(where, bound, base_value) for bound in value[:2])
    if not low < high:
        raise ConfigError(f"{where}: low {low:g} must be below high {high:g}")
    if scale == "log" and low <= 0:
        raise ConfigError(f"{where}: a log scale needs bounds above 0, got low {low:g}")
    if scale == "int" and not (low.is_integer() and high.is_integer()):
        raise ConfigError(f"{where}: an int scale needs whole-number bounds, got [{low:g}, {high:g}]")
    _check_range(where, key, low, high)
    return Dimension(key, low, high, scale)


def _bound(where: str, bound: Any, base_value: float | None) -> float:
    """A bound as a number: itself, or for 'xF' F times the base value."""
    if isinstance(bound, str) and bound.startswith("x"):
        try:
            factor = float(bound[1:])
        except ValueError:
            factor = math.nan
        if not math.isfinite(factor):  # 'xinf' or 'xnan' parse as floats
            raise ConfigError(f"{where}: bound {bound!r} must be a finite number or xF (F times the base value)")
        if base_value is None or base_value == 0:
            raise ConfigError(f"{where}: bound {bound!r} is relative, but the base recipe's value is {base_value}")
        return factor * float(base_value)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
        raise ConfigError(f"{where}: bound {bound!r} must be a finite number or xF (F times the base value)")
    return float(bound)
