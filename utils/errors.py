"""The user-error type every layer raises (ConfigError), how a stopped run ends, and the safe YAML/JSON readers."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import yaml

# sysexits.h EX_TEMPFAIL ("temporary failure, try again"): a job script requeues on it, e.g.
#   python3 train.py ...; [ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"
REQUEUE_EXIT_CODE = 75
USER_ERROR_EXIT_CODE = 2  # argparse's status for a bad command line

# The signals a training process turns into "save a checkpoint at the next optimizer step, then exit with
# REQUEUE_EXIT_CODE" (utils/train/faults.py): SLURM and Kubernetes end a job with SIGTERM, SLURM's
# `--signal=USR1@N` warns with SIGUSR1, a user presses Ctrl-C (SIGINT; a second press interrupts at once).
# Loader workers ignore them while the training process saves (utils/data/workers.py): launchers and
# terminals signal the whole process group.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class ConfigError(ValueError):
    """A user mistake in a flag or an input file; the message is one line naming the flag or file.

    Entry points print it as `error: <message>` and exit with status 2 (`exit_on_user_error`).
    """


class Preempted(Exception):
    """Raised on every rank once the checkpoint after a stop signal is saved; the run can be resumed.

    `is_main`: raised on rank 0, the one rank that says so (every rank exits REQUEUE_EXIT_CODE).
    """

    def __init__(self, signal_name: str, checkpoint: Path, *, is_main: bool) -> None:
        super().__init__(f"stopped by {signal_name}; saved {checkpoint}; resume with --resume {checkpoint}")
        self.checkpoint = checkpoint
        self.is_main = is_main


class StudyStopped(Exception):
    """Raised by tune.py after SIGINT/SIGTERM stopped its running trials; the same command resumes the study."""


class StudyFailed(Exception):
    """Raised by tune.py when its workers stopped on errors before the study had its trials (exit status 1)."""


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run a command's main(): a user mistake (bad flag, missing file) prints one line and exits 2;
    a preempted run (or a stopped study) prints how to go on and exits REQUEUE_EXIT_CODE, for the job script
    to requeue."""
    try:
        main()
    except (ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    except Preempted as stopped:  # the checkpoint is written: tell the job script to requeue
        if stopped.is_main:  # one line for the job, not one per rank
            print(f"preempted: {stopped}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT_CODE)
    except StudyStopped as stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT_CODE)
    except StudyFailed as failed:
        print(f"error: {failed}", file=sys.stderr)
        sys.exit(1)


# Lines a runtime's error message leads with that say where it was raised, not why (OpenVINO's C++ frames).
_WHERE_LINE = re.compile(r"^(Exception from \S+:\d+:|Check '.*' failed at \S+:\d+:?)$")


def error_reason(error: BaseException, limit: int = 200) -> str:
    """The line of `error`'s message that says why: the first non-empty one that is not a source location.

    OpenVINO, for one, leads with the C++ frames it passed through ("Exception from src/...cpp:132:")
    and ends with the reason ("Incorrect weights in bin file!"). At most `limit` characters; the
    exception's type name when the message has no such line.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reasons = [line for line in lines if not _WHERE_LINE.match(line)]
    return (reasons or lines or [type(error).__name__])[0][:limit]


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping, with safe_load (nothing in it is executed).

    Raises ConfigError naming the file when it is missing, unparsable, not a mapping, or gives a
    key twice in one mapping (YAML would keep the last silently: a hyp or search-space key set
    twice is a mistake to point at, not to guess from).
    """
    return _read_mapping(
        Path(path), _Format("YAML", _load_unique_keys, yaml.YAMLError), "file", "a mapping of keys to values"
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a mapping that gives one key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: merged keys may be overridden; only the mapping's own keys are checked
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                continue  # an unhashable or odd key: left to safe_load's own checks
            if key in seen:
                raise yaml.YAMLError(f"key {key!r} given twice, the second time at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _load_unique_keys(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: nothing is executed


def read_json_mapping(path: Path, what: str = "file", expected: str = "a JSON object") -> dict[str, Any]:
    """Read a JSON file that must hold an object; `what` and `expected` name it in the errors.

    Raises ConfigError naming the file when it is missing ("<path>: <what> not found"), not
    valid JSON, or not an object.
    """
    return _read_mapping(Path(path), _Format("JSON", json.loads, json.JSONDecodeError), what, expected)


class _Format(NamedTuple):
    name: str
    parse: Callable[[str], Any]
    error: type[Exception]


def _read_mapping(path: Path, file_format: _Format, what: str, expected: str) -> dict[str, Any]:
    """Read and parse `path` (UTF-8) into a dict, or raise the one-line ConfigError that says why not."""
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a {file_format.name} {what}")
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        content = file_format.parse(path.read_text(encoding="utf-8"))
    except (file_format.error, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid {file_format.name} ({str(error).splitlines()[0]})") from error
    if content is None:  # an empty or comments-only YAML file (or a bare null)
        raise ConfigError(f"{path}: holds no value; expected {expected}")
    if not isinstance(content, dict):
        raise ConfigError(f"{path}: expected {expected}, got {type(content).__name__}")
    return content
