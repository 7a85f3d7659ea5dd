"""export.py: parse the flags and export the checkpoint on rank 0; export.run(**flags)."""

from __future__ import annotations

from typing import Any

from utils.cli import entry
from utils.export import ExportedFile, build_export_parser, export_checkpoint, export_config_from_args
from utils.tasks import Task


def export_run(options: dict[str, Any], tasks: dict[str, Task]) -> list[ExportedFile]:
    """export.run(**options): export.py's checks and export, in this process."""
    return export_main(entry.keyword_argv(build_export_parser(), options, "export.run"), tasks)


def export_main(argv: list[str] | None, tasks: dict[str, Task]) -> list[ExportedFile]:
    """The whole of export.py: parse flags and export the checkpoint on rank 0 (other ranks do nothing).

    `tasks` maps a checkpoint's `task` field to its Task; export.py passes DETECT and SEGMENT.
    """
    cfg = export_config_from_args(build_export_parser().parse_args(argv))
    return entry.run_entry(cfg.device, lambda ctx: export_checkpoint(cfg, tasks, ctx))
