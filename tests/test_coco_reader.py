"""Tests for the streamed COCO JSON reader (utils/data/coco_reader.py, json_stream.py, coco_polygons.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import utils.data.json_stream as json_stream
from tests.coco_fakes import (
    CLIPPED_ID,
    CROWD_ID,
    OUTSIDE_ID,
    SIZES_WH,
    UNKNOWN_CATEGORY_ID,
    UNKNOWN_IMAGE_ID,
    ZERO_AREA_ID,
    write_coco_dataset,
)
from utils.data.coco_polygons import join_parts, object_outline, polygon_parts, rle_to_polygon
from utils.data.coco_reader import (
    BAD_IMAGE,
    BAD_SEGMENTATION,
    CLIPPED,
    CROWD,
    OUTSIDE,
    POLYGON_CLIPPED,
    UNKNOWN_CATEGORY,
    UNKNOWN_IMAGE,
    ZERO_AREA,
    missing_segmentation_notes,
    read_coco_json,
)
from utils.data.json_stream import JsonStream
from utils.data.masks import polygons_to_mask
from utils.errors import ConfigError


def test_stream_decodes_elements_cut_by_every_chunk_boundary() -> None:
    document = {"a": [1, 2.5, -3e-2, "x]y", {"k": [True, None]}], "b": {"c": 12345}, "d": []}
    text = json.dumps(document, indent=2)
    for chunk in range(1, 12):  # tiny chunks: numbers, strings and objects are split everywhere
        stream = JsonStream(io.StringIO(text), Path("f.json"), chunk_chars=chunk)
        seen = {}
        for key in stream.items():
            seen[key] = list(stream.elements()) if stream.next_is("[") else stream.value()
        assert seen == document, chunk


def test_stream_reports_malformed_json_with_file_and_offset() -> None:
    stream = JsonStream(io.StringIO('{"a": [1, 2,, 3]}'), Path("bad.json"), chunk_chars=4)
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON .* at character 12"):
        for _ in stream.items():
            list(stream.elements())


def test_reader_keeps_good_instances_and_names_every_bad_entry_once(tmp_path: Path, monkeypatch) -> None:
    write_coco_dataset(tmp_path)
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 97)  # many chunk boundaries in a 20 kB file
    parse = read_coco_json(tmp_path / "annotations" / "instances_train.json")
    assert parse.category_ids.tolist() == [3, 7, 9] and parse.category_names == ["cat", "dog", "cow"]
    assert parse.image_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # the duplicate id 2 is left out
    assert parse.problems == {
        CROWD: 1,
        BAD_IMAGE: 1,
        UNKNOWN_IMAGE: 1,
        UNKNOWN_CATEGORY: 1,
        ZERO_AREA: 1,
        OUTSIDE: 1,
        CLIPPED: 1,
    }
    for bad_id in (CLIPPED_ID, OUTSIDE_ID, ZERO_AREA_ID, UNKNOWN_CATEGORY_ID, UNKNOWN_IMAGE_ID):
        lines = [m for m in parse.messages if f"annotation {bad_id}:" in m]
        assert len(lines) == 1 and lines[0].startswith(str(tmp_path / "annotations" / "instances_train.json"))
    assert not any(f"annotation {CROWD_ID}" in m for m in parse.messages)  # crowd is counted, not a bad entry
    kept = set(parse.annotation_ids.tolist())
    assert CLIPPED_ID in kept and not kept & {OUTSIDE_ID, ZERO_AREA_ID, UNKNOWN_CATEGORY_ID, CROWD_ID}
    # Grouped by image, JSON order within an image; image 7 (background) owns none.
    owners = np.repeat(parse.image_ids, np.diff(parse.instance_offsets))
    assert (np.diff(owners) >= 0).all() and np.diff(parse.instance_offsets)[6] == 0
    clipped = int(np.flatnonzero(parse.annotation_ids == CLIPPED_ID)[0])
    np.testing.assert_allclose(parse.boxes_xywhn[clipped], [0.875, 0.8125, 0.25, 0.375])  # 60..80 x 40..64 of 80x64
    assert (parse.points >= 0).all() and (parse.points <= 1).all()


def test_polygons_are_normalised_and_parts_joined(tmp_path: Path) -> None:
    write_coco_dataset(tmp_path)
    parse = read_coco_json(tmp_path / "annotations" / "instances_train.json")
    joined = int(np.flatnonzero(parse.annotation_ids == 13)[0])  # image 2's two-part polygon
    points = parse.points[parse.polygon_offsets[joined] : parse.polygon_offsets[joined + 1]]
    width, height = SIZES_WH[2]
    assert len(points) == 4 + 1 + 4 + 1  # both parts, each walked round and closed at its link vertex
    np.testing.assert_allclose(points.min(0), [4 / width, 4 / height], rtol=1e-6)
    np.testing.assert_allclose(points.max(0), [60 / width, 80 / height], rtol=1e-6)
    box_only = int(np.flatnonzero(parse.annotation_ids == 2)[0])
    assert parse.polygon_offsets[box_only + 1] == parse.polygon_offsets[box_only]  # no segmentation: no polygon


def test_join_parts_links_closest_vertices_and_keeps_every_vertex() -> None:
    square = np.array([[0, 0], [2, 0], [2, 2], [0, 2]], float)
    parts = [square, square + [10, 0], square + [20, 0]]
    joined = join_parts(parts)
    assert len(joined) == (4 + 1) + (4 + 2) + (4 + 1)  # end parts closed; the middle one split at entry and exit
    for part in parts:
        assert {tuple(p) for p in part} <= {tuple(p) for p in joined}
    jumps = np.linalg.norm(np.diff(np.vstack([joined, joined[:1]]), axis=0), axis=1)
    assert sorted(jumps)[-4:] == pytest.approx([8.0, 8.0, 8.0, 8.0])  # each link (closest vertices) twice


def test_overlapping_parts_become_the_union_pycocotools_draws() -> None:
    from pycocotools import mask as mask_utils

    # Two 20 x 20 squares sharing a 10 x 10 corner: joined into one outline, the even-odd fill would leave the
    # shared corner empty (600 pixels); COCO's mask is their union (700), and so must ours be.
    parts = [[5, 5, 25, 5, 25, 25, 5, 25], [15, 15, 35, 15, 35, 35, 15, 35]]
    coco = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(parts, 40, 40)))
    ours = polygons_to_mask([object_outline(polygon_parts(parts))], 40, 40)
    assert coco.sum() == 700
    np.testing.assert_array_equal(ours, coco)
    apart = polygon_parts([[0, 0, 2, 0, 2, 2, 0, 2], [10, 0, 12, 0, 12, 2, 10, 2]])
    np.testing.assert_array_equal(object_outline(apart), join_parts(apart))  # disjoint parts: joined as they are


def test_rle_mask_is_traced_into_one_polygon() -> None:
    from pycocotools import mask as mask_utils

    mask = np.zeros((30, 40), np.uint8)
    mask[5:15, 5:15] = 1
    mask[20:28, 25:35] = 1
    rle = mask_utils.encode(np.asfortranarray(mask))
    polygon = rle_to_polygon({"size": [30, 40], "counts": rle["counts"].decode()})
    assert polygon.min(0).tolist() == [5, 5] and polygon.max(0).tolist() == [35, 28]  # the pixels' outer edges
    one = np.zeros((30, 40), np.uint8)
    one[5:15, 20:30] = 1  # one region: drawn again, its polygon gives back the RLE's 100 pixels
    traced = rle_to_polygon({"size": [30, 40], "counts": mask_utils.encode(np.asfortranarray(one))["counts"].decode()})
    np.testing.assert_array_equal(polygons_to_mask([traced], 30, 40), one)
    uncompressed = {
        "size": [30, 40],
        "counts": [30 * 5 + 5] + [10, 20] * 9 + [10, 1200 - 30 * 5 - 5 - 19 * 10 - 9 * 20],
    }
    assert len(rle_to_polygon(uncompressed)) >= 4  # list counts (as crowd regions use) decode too
    with pytest.raises(ValueError, match="RLE"):
        rle_to_polygon({"size": [30], "counts": "x"})


def test_not_a_coco_file_is_one_config_error(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"images": []}')
    with pytest.raises(ConfigError, match=r"x\.json: not a COCO instances file \(no 'annotations' list\)"):
        read_coco_json(path)
    path.write_text('{"images": [], "annotations": [], "categories": []}')
    with pytest.raises(ConfigError, match="no usable category"):
        read_coco_json(path)
    with pytest.raises(ConfigError, match="not found"):
        read_coco_json(tmp_path / "absent.json")


def test_whole_float_sizes_are_read_and_a_file_with_no_usable_image_is_no_crash(tmp_path: Path) -> None:
    # Some exporters write "width": 640.0; a file whose every image is left out names its annotations.
    path = tmp_path / "x.json"
    annotation = {"id": 5, "image_id": 1, "category_id": 1, "bbox": [10, 10, 50, 50], "iscrowd": 0}
    document = {"images": [{"id": 1, "file_name": "a.jpg", "width": 640.0, "height": 480.0}],
                "annotations": [annotation], "categories": [{"id": 1, "name": "thing"}]}  # fmt: skip
    path.write_text(json.dumps(document))
    parse = read_coco_json(path)
    assert parse.image_wh.tolist() == [[640, 480]] and parse.image_wh.dtype == np.int64 and len(parse.boxes_xywhn) == 1
    for images in ([], [{"id": 1, "file_name": "a.jpg", "width": 640.5, "height": 480}]):
        path.write_text(json.dumps({**document, "images": images}))
        parse = read_coco_json(path)
        assert parse.file_names == [] and len(parse.boxes_xywhn) == 0
        assert any("annotation 5: image_id 1 is not in 'images'" in message for message in parse.messages)


def _small_json(path: Path, annotations: list[dict]) -> Path:
    """A COCO JSON of one 100x50 image (id 1), one category (id 1) and `annotations` (ids and image filled in)."""
    entries = [{"id": i, "image_id": 1, "category_id": 1, **ann} for i, ann in enumerate(annotations, 1)]
    document = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 50}],
        "annotations": entries,
        "categories": [{"id": 1, "name": "thing"}],
    }
    path.write_text(json.dumps(document))
    return path


def test_a_polygon_clipped_to_its_image_is_warned_and_counted_beyond_the_tolerance(tmp_path: Path) -> None:
    bbox = [10, 10, 20, 20]
    parse = read_coco_json(
        _small_json(
            tmp_path / "a.json",
            [
                {"bbox": bbox, "segmentation": [[10, 10, 30, 10, 30, 30, 10, 30]]},  # inside
                {"bbox": bbox, "segmentation": [[90, 10, 110, 10, 110, 30, 90, 30]]},  # 10 px (0.1) past the right
                {"bbox": bbox, "segmentation": [[10, 10, 30, 10, 30, 50.4, 10, 50.4]]},  # 0.4 px (0.008): rounding
            ],
        )
    )
    assert parse.problems == {POLYGON_CLIPPED: 1}
    assert parse.messages == [
        f"{tmp_path / 'a.json'}: annotation 2: polygon overhangs its image by 0.1 of its size; clipped"
    ]
    second = parse.points[parse.polygon_offsets[1] : parse.polygon_offsets[2]]
    assert second[:, 0].max() == 1.0 and (parse.points >= 0).all() and (parse.points <= 1).all()


def test_annotations_without_a_segmentation_are_named_for_the_segmentation_task_only(tmp_path: Path) -> None:
    bbox = [10, 10, 20, 20]
    polygon = [[10, 10, 30, 10, 30, 30, 10, 30]]
    path = _small_json(
        tmp_path / "a.json",
        [
            {"bbox": bbox, "segmentation": polygon},
            {"bbox": bbox, "segmentation": []},
            {"bbox": bbox},
            {"bbox": bbox, "segmentation": [[1, 2]]},  # unusable: the reader notes it already
        ],
    )
    parse = read_coco_json(path)
    assert parse.has_segmentation.tolist() == [True, False, False, True]
    assert parse.problems == {BAD_SEGMENTATION: 1}  # nothing said about 2 and 3 here: detection needs no mask
    assert not any("annotation 2" in m or "annotation 3" in m for m in parse.messages)
    notes = missing_segmentation_notes(parse, np.arange(4))
    assert notes == [f"{path}: annotation {i}: no 'segmentation' (missing or empty); its box is used" for i in (2, 3)]
    assert missing_segmentation_notes(parse, np.array([0, 3])) == []


def test_an_rle_of_another_size_than_its_image_keeps_the_box_and_is_named(tmp_path: Path) -> None:
    from pycocotools import mask as mask_utils

    def rle(height: int, width: int) -> dict:
        mask = np.zeros((height, width), np.uint8)
        mask[2:8, 2:8] = 1
        return {"size": [height, width], "counts": mask_utils.encode(np.asfortranarray(mask))["counts"].decode()}

    bbox = [2, 2, 6, 6]
    # The image is 100 wide and 50 high: [50, 100] fits it; [100, 50] is its size transposed; [10, 10] another one.
    path = _small_json(
        tmp_path / "a.json",
        [{"bbox": bbox, "segmentation": rle(50, 100)}, {"bbox": bbox, "segmentation": rle(10, 10)},
         {"bbox": bbox, "segmentation": rle(100, 50)}],
    )  # fmt: skip
    parse = read_coco_json(path)
    assert parse.problems == {BAD_SEGMENTATION: 2}
    assert parse.messages == [
        f"{path}: annotation {i}: RLE size {size} (h x w) is not its image's 50x100; its box is used"
        for i, size in ((2, "10x10"), (3, "100x50"))
    ]
    assert np.diff(parse.polygon_offsets).tolist()[1:] == [0, 0] and parse.polygon_offsets[1] >= 3
    assert parse.has_segmentation.tolist() == [True, True, True]  # unusable, not missing: not named again
    first = parse.points[: parse.polygon_offsets[1]]
    assert np.allclose(first.min(0), [0.02, 0.04]) and np.allclose(first.max(0), [0.08, 0.16])  # = its bbox
