"""What the optional experiment trackers (MLflow, W&B) share: their package imported or one line, a server probed
once before the run instead of a training run stalled by a tracker that does not answer."""

from __future__ import annotations

import importlib
import logging
import urllib.error
import urllib.request
from types import ModuleType

PROBE_SECONDS = 5.0  # how long a tracking server may take to answer the probe


def import_tracker(
    module: str, tracker: str, package: str, explicit: bool, logger: logging.Logger
) -> ModuleType | None:
    """`module` imported, or None after one line: a warning when the tracker's flag was given, else an info line."""
    try:
        return importlib.import_module(module)
    except ImportError:
        log = logger.warning if explicit else logger.info
        log(f"{tracker}: not installed (`pip install {package}` to log this run to {tracker})")
        return None


def server_answers(url: str, health_path: str, unreachable: str, logger: logging.Logger) -> bool:
    """Whether a server answers `url` + `health_path` within PROBE_SECONDS (any HTTP answer counts: a proxy without
    the path is left to the tracker's own calls); else one warning, `unreachable` formatted with {url} and {reason}."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + health_path, timeout=PROBE_SECONDS):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError) as error:
        logger.warning(unreachable.format(url=url, reason=getattr(error, "reason", error)))
        return False
