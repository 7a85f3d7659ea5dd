"""Benchmark COCO-JSON labels at COCO's size: parse time and memory against pycocotools, node memory, cached start-up.

Usage (from the repository root):

    python benchmarks/coco_json.py                  # COCO train2017's size: 118,287 images, 860,001 annotations
    python benchmarks/coco_json.py --scale 0.1      # a tenth of that, for a quick run

Generates (once, reused while its marker matches) a COCO instances JSON under `--root` with
COCO's numbers of images and annotations, each annotation a polygon of 8-40 points (one in ten
in two parts, as occluded COCO objects are), and one 640x480 JPEG hard-linked under every file
name (a copy per 50,000 names), so the label scan finds and verifies real files. Then, each in a
fresh process:

1. parse: our reader (utils/data/coco_reader.py: read_coco_json) and pycocotools' COCO(path),
   alternately `--repeats` times: wall and CPU seconds, and peak RSS above the process's RSS
   before the parse (VmHWM - VmRSS) and in all (VmHWM). Targets: ours no slower, no larger.
2. node: `--ranks` (default 2 and 8) gloo processes on this machine, each loading the dataset
   YAML and scanning the train split from the JSON with no cache present (names from the
   categories, parse once per node, image verification split across ranks, the label cache
   written once). Every 0.1 s the PSS of all ranks is summed; the node's figure is the peak of
   that sum above the sum measured once every rank has imported and joined the group. PSS splits
   shared pages (the memory-mapped parse and label cache) among the processes that map them.
   Target: about one parse, not ranks x one parse.
3. cached start-up: one fresh process loads the YAML and scans the split again with every cache
   present: the seconds from calling load_data_config to holding the index. Target <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/coco_json.py`
    sys.path.insert(0, str(ROOT))

COCO_IMAGES, COCO_ANNOTATIONS, COCO_CATEGORIES = 118_287, 860_001, 80
MB = 1 << 20
GENERATOR_VERSION = 1
LINKS_PER_FILE = 50_000


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "coco-json-bench"


def _polygon_texts(rng: np.random.Generator, count: int) -> tuple[list[str], np.ndarray]:
    """`count` annotations' segmentation JSON texts and their bboxes (count, 4), in a 640x480 image."""
    texts, boxes = [], np.zeros((count, 4))
    for j in range(count):
        k = int(rng.integers(8, 41))
        cx, cy, radius = rng.uniform(60, 580), rng.uniform(60, 420), rng.uniform(5, 55)
        angles = np.sort(rng.uniform(0, 2 * np.pi, k))
        points = np.stack([cx + radius * np.cos(angles), cy + radius * np.sin(angles)], 1)
        parts = [points]
        if rng.random() < 0.1:  # occluded objects come in parts
            parts.append(points[: max(3, k // 3)] + rng.uniform(-30, 30, 2))
        parts = [np.clip(p, 0, [639.99, 479.99]) for p in parts]
        texts.append("[" + ",".join("[" + ",".join(f"{v:.2f}" for v in p.ravel()) + "]" for p in parts) + "]")
        stacked = np.concatenate(parts)
        boxes[j] = [*stacked.min(0), *(stacked.max(0) - stacked.min(0))]
    return texts, boxes


def generate(root: Path, scale: float) -> Path:
    """Write root/annotations/instances_train.json, one JPEG linked under every file name, and root/coco.yaml."""
    num_images, num_annotations = int(COCO_IMAGES * scale), int(COCO_ANNOTATIONS * scale)
    marker = root / "generated.json"
    spec = {"version": GENERATOR_VERSION, "images": num_images, "annotations": num_annotations}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return root / "coco.yaml"
    import cv2

    images_dir, json_path = root / "images" / "train", root / "annotations" / "instances_train.json"
    if root.exists():
        subprocess.run(["rm", "-rf", str(root)], check=True)
    images_dir.mkdir(parents=True)
    json_path.parent.mkdir()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (480, 640, 3), np.uint8)
    with open(json_path, "w") as file:
        file.write('{"info":{"description":"COCO-size benchmark"},"licenses":[],"images":[')
        for i in range(num_images):
            name = f"{i + 1:012d}.jpg"
            template = root / f"template{i // LINKS_PER_FILE}.jpg"  # ext4 allows 65,000 links to a file
            if i % LINKS_PER_FILE == 0:
                cv2.imwrite(str(template), pixels)
            os.link(template, images_dir / name)
            file.write(("," if i else "") + json.dumps({"license": 1, "file_name": name, "coco_url": f"http://images/{name}",
                       "height": 480, "width": 640, "date_captured": "2013-11-14 11:18:45", "id": i + 1}))  # fmt: skip
        file.write('],"annotations":[')
        image_ids = rng.integers(1, num_images + 1, num_annotations)
        categories = rng.choice(np.arange(1, 91), COCO_CATEGORIES, replace=False)
        for start in range(0, num_annotations, 10_000):
            texts, boxes = _polygon_texts(rng, min(10_000, num_annotations - start))
            for j, (text, box) in enumerate(zip(texts, boxes, strict=True)):
                x, y, w, h = (round(float(v), 2) for v in box)
                file.write(("," if start + j else "") + f'{{"segmentation":{text},"area":{w * h * 0.7:.3f},"iscrowd":0,'
                           f'"image_id":{image_ids[start + j]},"bbox":[{x},{y},{w},{h}],'
                           f'"category_id":{rng.choice(categories)},"id":{start + j + 1}}}')  # fmt: skip
        names = ",".join(json.dumps({"supercategory": "thing", "id": int(c), "name": f"class{c}"}) for c in categories)
        file.write(f'],"categories":[{names}]}}')
    (root / "coco.yaml").write_text(
        f"path: {root}\ntrain: images/train\nval: images/train\ntrain_annotations: {json_path}\n"
    )
    marker.write_text(json.dumps(spec))
    return root / "coco.yaml"


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def parse_once(kind: str, json_path: str) -> None:
    """(child) Parse with `kind` (ours / pycocotools) and print one JSON line of seconds and memory."""
    import contextlib
    import io

    if kind == "ours":
        from utils.data.coco_reader import read_coco_json
    else:
        from pycocotools.coco import COCO
    before_rss, cpu_before, start = _status_mb("VmRSS"), time.process_time(), time.perf_counter()
    if kind == "ours":
        parsed = read_coco_json(Path(json_path))
        count = len(parsed.annotation_ids)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            parsed = COCO(json_path)
        count = len(parsed.anns)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_before
    peak = _status_mb("VmHWM")
    print(json.dumps({"kind": kind, "seconds": seconds, "cpu": cpu, "peak_mb": peak, "above_mb": peak - before_rss,
                      "annotations": count}))  # fmt: skip


def node_rank(rank: int, world_size: int, yaml_path: str, init_file: str, out_dir: str) -> None:
    """(child) One rank of the node run: join the group, note its PSS, load the YAML and scan the train split."""
    import torch.distributed as dist

    from utils.data.coco_labels import scan_coco_labels
    from utils.data.data_config import load_data_config
    from utils.distributed import DistContext, all_gather_objects, barrier

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    ctx = DistContext(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    all_gather_objects(list(range(1000)), ctx)  # warm-up: the collectives' code pages count in the baseline
    barrier(ctx)
    Path(out_dir, f"baseline{rank}").write_text(str(_pss_mb(os.getpid())))
    barrier(ctx)
    time.sleep(0.5)  # the parent reads every rank's baseline before the work starts
    start = time.perf_counter()
    data = load_data_config(Path(yaml_path), ctx)
    index = scan_coco_labels(data.coco_source("train"), False, ctx)
    seconds = time.perf_counter() - start
    barrier(ctx)
    Path(out_dir, f"done{rank}").write_text(json.dumps({"seconds": seconds, "images": len(index)}))
    barrier(ctx)
    dist.destroy_process_group()


def cached_startup(yaml_path: str) -> None:
    """(child) Seconds from load_data_config to the index with every cache present, in a fresh process."""
    from utils.data.coco_labels import scan_coco_labels
    from utils.data.data_config import load_data_config
    from utils.distributed import DistContext

    start = time.perf_counter()
    data = load_data_config(Path(yaml_path), DistContext())
    index = scan_coco_labels(data.coco_source("train"), False, DistContext())
    print(json.dumps({"seconds": time.perf_counter() - start, "images": len(index), "instances": len(index.labels)}))


def _child(*args: str) -> dict:
    command = [sys.executable, __file__, "--child", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _remove_caches(json_path: Path) -> None:
    for cache in json_path.parent.glob(f"{json_path.stem}.*.cache"):
        cache.unlink()


def run_node(yaml_path: Path, json_path: Path, ranks: int) -> dict:
    """Start `ranks` gloo processes scanning with no cache; return seconds, images and the node's peak PSS rise."""
    _remove_caches(json_path)
    with tempfile.TemporaryDirectory() as out_dir:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, "--child", "node", str(yaml_path), out_dir, str(ranks)]
        processes = [
            subprocess.Popen([*command, str(rank)], env=env, stdout=subprocess.DEVNULL) for rank in range(ranks)
        ]
        baseline = peak = None
        while any(p.poll() is None for p in processes):
            total = sum(_pss_mb(p.pid) for p in processes)
            files = [Path(out_dir, f"baseline{rank}") for rank in range(ranks)]
            if baseline is None and all(f.exists() and f.read_text() for f in files):
                baseline = sum(float(f.read_text()) for f in files)
            if baseline is not None:
                peak = max(peak or 0.0, total)
            time.sleep(0.1)
        if any(p.returncode for p in processes):
            raise RuntimeError(f"a rank of the {ranks}-rank node run failed")
        done = [json.loads(Path(out_dir, f"done{rank}").read_text()) for rank in range(ranks)]
    return {"ranks": ranks, "seconds": max(d["seconds"] for d in done), "images": done[0]["images"],
            "peak_above_mb": (peak or 0.0) - (baseline or 0.0)}  # fmt: skip


def main() -> None:
    """Parse the flags, generate the data set if needed, and print every figure."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "parse":
            parse_once(*rest)
        elif kind == "node":
            yaml_path, out_dir, ranks, rank = rest
            node_rank(int(rank), int(ranks), yaml_path, str(Path(out_dir) / "init"), out_dir)
        else:
            cached_startup(*rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of COCO train2017's size")
    parser.add_argument("--root", type=Path, default=default_root())
    parser.add_argument("--repeats", type=int, default=2, help="parses of each kind, alternating")
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 8])
    args = parser.parse_args()
    start = time.perf_counter()
    yaml_path = generate(args.root, args.scale)
    json_path = args.root / "annotations" / "instances_train.json"
    size_mb = json_path.stat().st_size / MB
    print(f"data: {json_path} {size_mb:.0f} MB (scale {args.scale}; ready in {time.perf_counter() - start:.0f} s)")
    for _ in range(args.repeats):
        for kind in ("ours", "pycocotools"):
            r = _child("parse", kind, str(json_path))
            print(f"parse {kind:12s} {r['seconds']:6.1f} s wall {r['cpu']:6.1f} s CPU  peak RSS {r['peak_mb']:6.0f} MB "
                  f"({r['above_mb']:6.0f} MB above start, {r['above_mb'] / size_mb:.1f}x the file)  "
                  f"{r['annotations']} annotations")  # fmt: skip
    for ranks in args.ranks:
        r = run_node(yaml_path, json_path, ranks)
        print(f"node  {ranks} ranks, no cache: {r['seconds']:6.1f} s to the index ({r['images']} images), "
              f"peak PSS of the node {r['peak_above_mb']:6.0f} MB above its ranks' start")  # fmt: skip
    for _ in range(args.repeats):
        r = _child("startup", str(yaml_path))
        print(
            f"start-up with the caches present: {r['seconds']:.2f} s ({r['images']} images, {r['instances']} instances)"
        )
    print(f"peak RSS of this driver: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
