#!/usr/bin/env bash
# The GPU check in one command on a box without network: install the carried wheels, run the CUDA tests,
# then benchmarks/gpu.py on this checkout and the baseline beside it. Run from the repository root:
#
#     OUT=/path/to/results bash benchmarks/gpu_device.sh [more gpu.py flags, e.g. --epochs 3 1]
#
# Carried next to the checkout: .whl/ (pycocotools, ultralytics, ultralytics-thop, nvidia-ml-py wheels;
# docs/benchmarks.md says how to download them) and, optionally, .baseline/ (an older checkout to compare).
# Everything it prints is also written under $OUT: install.log, cuda-tests.log, gpu.log, gpu.md, gpu.csv,
# logs/ (one file per run). CUDA_TESTS=0 skips the CUDA tests. BUDGET_S (default 390) bounds the whole
# script: the benchmark gets what the install and the tests leave, starts no run after it and cuts the one
# running, so its tables are printed.
# PACK=1 leaves one file, $OUT/results.tgz, for machines that hand back only a few files.
set -u
OUT=${OUT:-/tmp/gpu-bench-out}
BUDGET_S=${BUDGET_S:-390}
mkdir -p "$OUT"
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; python3 --version; } \
    2>&1 | tee "$OUT/machine.log"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tail -3 | tee "$OUT/install.log"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${CUDA_TESTS:-1}" != 0 ]; then  # CUDA_TESTS=0: figures only, when the tests passed on this code already
    timeout 180 python3 -m pytest -q -m cuda -p no:cacheprovider -rA tests/ 2>&1 | tee "$OUT/cuda-tests.log" | tail -30
fi
code=(.)
[ -d .baseline ] && code+=(.baseline)
left=$((BUDGET_S - ($(date +%s) - start)))
python3 benchmarks/gpu.py --code "${code[@]}" --out "$OUT" --deadline-s "$left" \
    --parts train train-more val step --sizes 300 3000 --epochs 4 2 --steps 6 --step-static --step-graph \
    --train-variant=--cuda-graph "$@" 2>&1 | tee "$OUT/gpu-stdout.log"
echo "gpu_device.sh: $(($(date +%s) - start)) s in all; tables in $OUT/gpu.md"
if [ -n "${PACK:-}" ]; then
    tar czf /tmp/gpu-device-results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-device-results.tgz "$OUT/results.tgz"
fi
