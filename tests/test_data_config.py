"""Tests for utils/data/data_config.py: dataset YAML parsing and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.data.data_config import load_data_config
from utils.distributed import DistContext
from utils.errors import ConfigError

_NAMES_GAP = "{0: a, 1: b, 2: c, 3: d, 4: e, 6: f}"  # 5 is missing, 6 is one too many


def _layout(tmp_path: Path) -> Path:
    for split in ("train", "val"):
        (tmp_path / "ds" / "images" / split).mkdir(parents=True)
    (tmp_path / "ds" / "extra.txt").write_text("images/train/a.jpg\n")
    return tmp_path


def test_relative_paths_resolve_against_yaml_folder(tmp_path: Path) -> None:
    _layout(tmp_path)
    yaml_file = tmp_path / "d.yaml"
    yaml_file.write_text("path: ds\ntrain: [images/train, extra.txt]\nval: images/val\nnames: {0: cat, 1: dog}\n")
    data = load_data_config(yaml_file, DistContext())
    assert data.names == ("cat", "dog")
    assert data.split("train") == ((tmp_path / "ds/images/train").resolve(), (tmp_path / "ds/extra.txt").resolve())
    assert data.split("val") == ((tmp_path / "ds/images/val").resolve(),)
    with pytest.raises(ConfigError, match="no 'test' split"):
        data.split("test")


def test_an_empty_path_is_the_yaml_folder_and_a_list_is_one_line(tmp_path: Path) -> None:
    _layout(tmp_path)
    yaml_file = tmp_path / "d.yaml"
    yaml_file.write_text("path:\ntrain: ds/images/train\nval: ds/images/val\nnames: [cat]\n")
    assert load_data_config(yaml_file, DistContext()).split("val") == ((tmp_path / "ds/images/val").resolve(),)
    yaml_file.write_text(f"path: [{tmp_path}]\ntrain: ds/images/train\nval: ds/images/val\nnames: [cat]\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: 'path' must be one folder, got \["):
        load_data_config(yaml_file, DistContext())


def test_names_keys_written_as_strings_are_the_indices(tmp_path: Path) -> None:
    _layout(tmp_path)
    yaml_file = tmp_path / "d.yaml"
    yaml_file.write_text("path: ds\ntrain: images/train\nval: images/val\nnames: {'1': b, '0': a}\n")  # as from JSON
    assert load_data_config(yaml_file, DistContext()).names == ("a", "b")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("path: ds\nval: images/val\nnames: [a]\n", "missing key 'train'"),
        ("path: ds\ntrain: images/train\nval:\nnames: [a]\n", "'val' is empty; give its image folder"),
        ("path: ds\ntrain: images/train\nval: images/nope\nnames: [a]\n", "'val' path .* does not exist"),
        ("path: ds\ntrain: images/train\nval: images/val\n", "missing 'names'"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: [a]\nnc: 2\n", "nc=2 but 'names' has 1"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: [a]\nweights: x\n", "unknown key 'weights'"),
        # The offending keys are named, however many keys come before them.
        (
            f"path: ds\ntrain: images/train\nval: images/val\nnames: {_NAMES_GAP}\n",
            r"0\.\.5 \(missing 5; unexpected 6\)",
        ),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: {0: a, '01': b}\n", r"missing 1; unexpected '01'"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: c0\n", "must be a list or an index->name mapping"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: {0: a, '0': b}\n", "keys '0' repeat the index keys"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: []\n", "'names' is empty"),
        ("path: ds\ntrain: images/train\nval: images/val\nnames: [a, null, '']\n", "no name for class 1, 2"),
        ("- just\n- a list\n", "expected a mapping"),
        ("", "holds no value; expected a mapping"),
        ("# names to come\n", "holds no value; expected a mapping"),
        ("path: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_yaml_is_one_line_error_naming_file(tmp_path: Path, content: str, needle: str) -> None:
    _layout(tmp_path)
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text(content)
    with pytest.raises(ConfigError, match=needle) as error:
        load_data_config(yaml_file, DistContext())
    assert "bad.yaml" in str(error.value) and "\n" not in str(error.value)


def test_a_folder_given_as_the_yaml_is_named_as_a_folder(tmp_path: Path) -> None:
    (tmp_path / "coco.yaml").mkdir()  # e.g. a dataset folder named like its YAML
    with pytest.raises(ConfigError, match=r"coco\.yaml: a folder, not a YAML file$"):
        load_data_config(tmp_path / "coco.yaml", DistContext())


def test_yaml_python_tags_are_not_executed(tmp_path: Path) -> None:
    _layout(tmp_path)
    yaml_file = tmp_path / "evil.yaml"
    yaml_file.write_text("path: !!python/object/apply:os.system ['touch pwned']\ntrain: a\nval: b\nnames: [a]\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_data_config(yaml_file, DistContext())
    assert not Path("pwned").exists()


def test_a_roboflow_export_loads_as_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Roboflow writes '../' paths, a test entry it may not ship, and a metadata block beside the data.yaml."""
    dataset = tmp_path / "export"
    for split in ("train", "valid"):
        (dataset / split / "images").mkdir(parents=True)
    yaml_file = dataset / "data.yaml"
    yaml_file.write_text(
        "train: ../train/images\nval: ../valid/images\ntest: ../test/images\nnc: 2\nnames: ['a', 'b']\n"
        "roboflow:\n  workspace: w\n  project: p\n  version: 1\n  license: CC BY 4.0\n"
    )
    with caplog.at_level("INFO", logger="utils.data.data_config"):
        data = load_data_config(yaml_file, DistContext())
    assert data.split("train") == ((dataset / "train" / "images").resolve(),)
    assert data.split("val") == ((dataset / "valid" / "images").resolve(),)
    with pytest.raises(ConfigError, match=r"'test' path .*test/images does not exist"):
        data.split("test")  # only a run that uses the test split needs it
    assert "'roboflow' (Roboflow's export metadata) is not read" in caplog.text
    assert f"'train' ../train/images is not there; reading {dataset / 'train' / 'images'}" in caplog.text
    # A '../' path that is there is read as written; a missing train or val split still stops at once.
    (tmp_path / "train" / "images").mkdir(parents=True)
    assert load_data_config(yaml_file, DistContext()).split("train") == ((tmp_path / "train" / "images").resolve(),)
    yaml_file.write_text("train: ../train/images\nval: ../nothing/images\nnames: ['a']\n")
    with pytest.raises(ConfigError, match=r"'val' path .*nothing/images does not exist"):
        load_data_config(yaml_file, DistContext())


def test_a_key_given_twice_is_refused_but_anchors_and_merges_still_read(tmp_path: Path) -> None:
    from utils.errors import read_yaml_mapping

    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &base {lr0: 0.01, lrf: 0.1}\ntuned:\n  <<: *base\n  lr0: 0.02\n")
    assert read_yaml_mapping(merged) == {"base": {"lr0": 0.01, "lrf": 0.1}, "tuned": {"lr0": 0.02, "lrf": 0.1}}
    twice = tmp_path / "twice.yaml"
    twice.write_text("train: a\nval: b\nnames: [x]\ntrain: c\n")
    with pytest.raises(
        ConfigError, match=r"twice.yaml: not valid YAML \(key 'train' given twice, the second time at line 4\)"
    ):
        read_yaml_mapping(twice)
