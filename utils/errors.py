"""The user-error type every layer raises (ConfigError) and the one safe YAML reader that raises it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in a flag or an input file; the message is one line naming the flag or file.

    Entry points print it as `error: <message>` and exit with status 2 (utils/cli.py).
    """


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping, with safe_load (nothing in it is executed).

    Raises ConfigError naming the file when it is missing, unparsable or not a mapping.
    """
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from error
    if not isinstance(content, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(content).__name__}")
    return content
