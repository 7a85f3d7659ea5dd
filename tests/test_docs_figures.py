"""The figures README.md quotes (times, mAP) are the docs' own, word for word: one source for each number."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_docs_links import ROOT, prose_lines

# Each figure the README quotes, as the sentence around it reads in the README and in the docs page
# that owns it (line breaks and repeated spaces count as one space). A new figure in the README must
# be listed here with its owner; a figure changed in one place and not the other fails.
FIGURE = re.compile(r"\b\d+\.\d+\b|\babout \d+ minutes\b")
OWNED_FIGURES = {
    "docs/models.md": {
        "5.5": "takes 5.5 minutes on 2 idle CPU cores",
        "0.730": "scores mAP50-95 0.730 on today's code",
        "0.373": "(0.373, 0.380)",
    },
    "docs/code.md": {
        "about 10 minutes": "about 10 minutes on 2 idle cores",
        "18.1": "18.1 minutes on a shared 2-core machine busy with other work",
    },
}
README_CONTEXT = {  # what each README figure says, so a figure cannot move to another meaning unnoticed
    "5.5": "5.5 minutes on 2 idle CPU cores",
    "0.730": "mAP50-95 0.730 under YOLOv5's multi-label validation",
    "0.373": "yolov5n scores 0.373",
    "about 10 minutes": "about 10 minutes on 2 idle cores",
    "18.1": "18.1 minutes on a busy shared 2-core machine",
}


def flat_prose(path: Path) -> str:
    """`path`'s prose outside code blocks, whitespace runs (line breaks included) as one space."""
    return re.sub(r"\s+", " ", " ".join(line for _, line in prose_lines(path)))


def test_every_readme_figure_is_listed_with_its_owner() -> None:
    quoted = set(FIGURE.findall(flat_prose(ROOT / "README.md")))
    owned = {figure for figures in OWNED_FIGURES.values() for figure in figures}
    assert quoted == owned == set(README_CONTEXT), "list each README figure in OWNED_FIGURES and README_CONTEXT"


def test_readme_figures_read_the_same_in_the_docs_page_that_owns_them() -> None:
    readme = flat_prose(ROOT / "README.md")
    missing = [f"README.md: {text!r}" for text in README_CONTEXT.values() if text not in readme]
    for page, figures in OWNED_FIGURES.items():
        owner = flat_prose(ROOT / page)
        missing += [
            f"{page}: {text!r} (README quotes {figure})" for figure, text in figures.items() if text not in owner
        ]
    assert not missing, "figures that differ between README.md and their docs page:\n" + "\n".join(missing)
