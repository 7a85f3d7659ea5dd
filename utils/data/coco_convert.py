"""`python -m utils.data.coco_convert`: a split's COCO instances JSON <-> YOLO txt labels, with training's readers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from utils.data.coco_labels import CocoSource, class_of_category, resolve_image_files, scan_coco_labels
from utils.data.coco_node import load_coco_parse
from utils.data.coco_reader import CocoParse
from utils.data.copy_paste import is_box_outline
from utils.data.data_config import DataConfig, load_data_config
from utils.data.image_files import image_to_label_path, list_image_files
from utils.data.labels import LabelIndex
from utils.data.scan import scan_labels
from utils.distributed import DistContext
from utils.errors import ConfigError, exit_on_user_error

LOGGER = logging.getLogger(__name__)
PIXEL_DECIMALS = 3  # pixel coordinates written to a JSON: a thousandth of a pixel, not float32 noise


def _write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling of `path` and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _float32_text(values: np.ndarray) -> list[str]:
    """Shortest decimal of each float32 that reads back as the same float32."""
    return [np.format_float_positional(v, unique=True, trim="-") for v in values.astype(np.float32)]


def yolo_rows(parse: CocoParse, row: int, classes: np.ndarray, with_masks: bool) -> list[str]:
    """YOLO txt lines of parse image `row`: what training reads from the JSON, written so it reads back the same.

    Segmentation writes an instance's polygon and detection its box (as scan_coco_labels chooses).
    A box is written as the float64 [cx, cy, w, h] the JSON path computes its corners from
    (shortest exact decimals), a polygon as its float32 points; so the YOLO scan of these files
    gives exactly the JSON path's labels. Instances of no class (category_ids) are left out.
    """
    lines = []
    for j in range(parse.instance_offsets[row], parse.instance_offsets[row + 1]):
        class_index = int(classes[parse.categories[j]])
        if class_index < 0:
            continue
        first, last = parse.polygon_offsets[j], parse.polygon_offsets[j + 1]
        if with_masks and last > first:
            values = _float32_text(parse.points[first:last].reshape(-1))
        else:
            values = [repr(float(v)) for v in parse.boxes_xywhn[j]]
        lines.append(" ".join([str(class_index), *values]))
    return lines


def coco_to_yolo(source: CocoSource, with_masks: bool, ctx: DistContext) -> int:
    """Write a YOLO label file beside every JSON image that has instances (labels/ for images/); return the count.

    Images without instances get no file (YOLO's background). Existing label files of those
    images are replaced, atomically each.
    """
    parse = load_coco_parse(source.annotations, ctx)
    classes = class_of_category(parse, source)
    files, rows, messages = resolve_image_files(parse, source)
    for message in parse.messages + messages:
        LOGGER.warning(message)
    written = 0
    for path, row in zip(files, rows.tolist(), strict=True):
        lines = yolo_rows(parse, row, classes, with_masks)
        if lines:
            label_path = Path(image_to_label_path(path))
            label_path.parent.mkdir(parents=True, exist_ok=True)
            _write_text_atomic(label_path, "".join(line + "\n" for line in lines))
            written += 1
    return written


def _image_ids(index: LabelIndex) -> list[int]:
    """Image ids: the file stems when all are distinct numbers (as COCO names its files), else 1..N in file order."""
    stems = [Path(path).stem for path in index.im_files]
    if all(stem.isdigit() for stem in stems) and len({int(stem) for stem in stems}) == len(stems):
        return [int(stem) for stem in stems]
    return list(range(1, len(stems) + 1))


def index_to_coco(index: LabelIndex, image_root: Path, names: tuple[str, ...], category_ids: tuple[int, ...]) -> dict:
    """A COCO instances dict of a packed index: pixel bbox, polygon segmentation (none for box rows), area.

    `category_ids[i]` is class i's category (the mapping --save-json writes predictions with);
    file names are relative to `image_root`. Box-only rows (4 axis-aligned corners) get no
    segmentation; polygons get one part. Pixels are rounded to PIXEL_DECIMALS.
    """
    images, annotations = [], []
    for i, image_id in enumerate(_image_ids(index)):
        width, height = (int(v) for v in index.shapes[i])
        name = PurePosixPath(Path(os.path.relpath(index.im_files[i], image_root)).as_posix())
        images.append({"id": image_id, "file_name": str(name), "width": width, "height": height})
        scale = np.array([width, height], np.float64)
        for label, polygon in zip(index.labels_of(i), index.segments_of(i), strict=True):
            cx, cy, w, h = label[1:].astype(np.float64) * np.concatenate([scale, scale])
            pixels = polygon.astype(np.float64) * scale
            is_box = len(polygon) == 4 and bool(is_box_outline(polygon[None])[0])
            x, y = pixels[:, 0], pixels[:, 1]
            area = w * h if is_box else abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2
            annotation: dict[str, Any] = {
                "id": len(annotations) + 1,  # pycocotools treats annotation id 0 as "unmatched"
                "image_id": image_id,
                "category_id": int(category_ids[int(label[0])]),
                "bbox": [round(float(v), PIXEL_DECIMALS) for v in (cx - w / 2, cy - h / 2, w, h)],
                "area": round(float(area), PIXEL_DECIMALS),
                "iscrowd": 0,
            }
            if not is_box:
                annotation["segmentation"] = [np.round(pixels.reshape(-1), PIXEL_DECIMALS).tolist()]
            annotations.append(annotation)
    categories = [{"id": int(cid), "name": name} for cid, name in zip(category_ids, names, strict=True)]
    return {"images": images, "annotations": annotations, "categories": categories}


def yolo_to_coco(data: DataConfig, split: str, output: Path, ctx: DistContext) -> dict:
    """Read `split` as training reads it and write it to `output` as a COCO instances JSON; return the dict.

    Category ids are the YAML's `category_ids`, else class index + 1 (COCO's ids start at 1).
    """
    sources = data.split(split)
    coco = data.coco_source(split)
    if coco is not None:
        index = scan_coco_labels(coco, with_masks=True, ctx=ctx)
    else:
        index = scan_labels(list_image_files(sources), data.num_classes, ctx, names_file=data.yaml_file)
    if len(sources) != 1 or not sources[0].is_dir():
        raise ConfigError(f"{data.yaml_file}: '{split}' must be one image folder to name files relative to it")
    category_ids = data.category_ids or tuple(range(1, data.num_classes + 1))
    content = index_to_coco(index, sources[0], data.names, category_ids)
    _write_text_atomic(output, json.dumps(content, separators=(",", ":")))
    return content


def main(argv: list[str] | None = None) -> None:
    """Command line: `to-yolo` writes a split's JSON labels as YOLO txt files, `to-coco` a split's labels as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("direction", choices=("to-yolo", "to-coco"))
    parser.add_argument("--data", type=Path, required=True, help="dataset YAML")
    parser.add_argument("--split", default="train", choices=("train", "val", "test"))
    parser.add_argument("--task", default="detect", choices=("detect", "segment"), help="to-yolo: boxes or polygons")
    parser.add_argument("--out", type=Path, help="to-coco: the JSON to write")
    args = parser.parse_args(argv)
    ctx = DistContext()
    data = load_data_config(args.data, ctx)
    if args.direction == "to-yolo":
        source = data.coco_source(args.split)
        if source is None:
            raise ConfigError(f"{args.data}: to-yolo needs '{args.split}_annotations' (the COCO JSON to convert)")
        written = coco_to_yolo(source, args.task == "segment", ctx)
        LOGGER.info(f"{source.annotations} -> {written} YOLO label files beside {source.image_root}")
        LOGGER.info(f"names: {list(data.names)}")
        return
    if args.out is None:
        raise ConfigError("to-coco needs --out (the COCO JSON to write)")
    content = yolo_to_coco(data, args.split, args.out, ctx)
    LOGGER.info(
        f"{args.data} '{args.split}' -> {args.out}: {len(content['images'])} images, "
        f"{len(content['annotations'])} annotations"
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(exit_on_user_error(main))
