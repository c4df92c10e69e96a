#!/usr/bin/env bash
# Everything that needs the GPU machine, in one go (see ../shared/gpu/README.md for the wheels):
# the GPU tests (broken-input ones in their own process; the damage campaign runs its cases in
# child processes), the random parity run, the example notebooks executed with their outputs
# stored, `info`, the decode/checksum benchmark (DECODE_GIB=1), the read-pattern benchmark with
# the ERA5-like batches and a fresh process's first reads (PATTERNS_GIB=4; STORES= to choose)
# and the multi-GPU benchmark.
# Usage on the GPU machine:  OUT=/some/dir bash tools/gpu_run.sh [size-GiB for multi_gpu.py]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/notebooks"
ulimit -n 20000 2>/dev/null
python3 -m cupy_xarray info > "$OUT/info.txt" 2>&1
python3 -m cupy_xarray demo > "$OUT/demo.txt" 2>&1
K="corrupt or broken or crc32c_mismatch or shard_index_past_end or permission or wrong_size"
timeout 240 python3 -m pytest -q -m gpu tests --ignore tests/test_random_parity.py -k "not ($K)" \
  -p no:cacheprovider -W ignore > "$OUT/gpu_tests.log" 2>&1
timeout 60 python3 -m pytest -q -m gpu tests -k "$K" -p no:cacheprovider -W ignore > "$OUT/gpu_broken.log" 2>&1
CUPY_XARRAY_EXAMPLES=${EXAMPLES:-2000} timeout 150 python3 -m pytest -q -m gpu tests/test_random_parity.py \
  --hypothesis-show-statistics -p no:cacheprovider -W ignore > "$OUT/gpu_random.log" 2>&1
if [ -n "${DECODE_GIB:-}" ]; then
  timeout 300 python3 benchmarks/read_throughput.py --dir /tmp/bench --size-gib "$DECODE_GIB" --repeat 3 \
    --stores zstd,zstd-checksum,gzip,zlib,lz4,blosc-lz4,blosc-zstd \
    --paths "kvikio engine,engine decode=gpu,zarr GPU mode" --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
fi
if [ -n "${PATTERNS_GIB:-}" ]; then
  (cd benchmarks \
    && timeout 500 python3 read_patterns.py --dir /tmp/bench --size-gib "$PATTERNS_GIB" --quick \
      --stores "${STORES:-zstd tiles,uncompressed tiles,blosc-zstd tiles,lz4 tiles}" \
      --era5-steps "${ERA5_STEPS:-128}" --json "$OUT/benchmarks-patterns.json" > "$OUT/patterns.log" 2>&1
    timeout 150 python3 first_minute.py --store /tmp/bench/zstd-tiles.zarr --runs 3 \
      --json "$OUT/first-reads.json" > "$OUT/first_reads.log" 2>&1)
fi
timeout 400 python3 tools/run_notebooks.py "$OUT/notebooks" > "$OUT/notebooks.log" 2>&1
if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  timeout 580 python3 benchmarks/multi_gpu.py --dir /tmp/bench --size-gib "${1:-24}" --repeat 5 \
    --configs "${CONFIGS:-0x1,64x1,256x1}" --json "$OUT/multi_gpu.json" > "$OUT/multi_gpu.log" 2>&1
fi
for f in "$OUT"/*.log; do echo "== $f"; tail -3 "$f"; done
grep -h "|" "$OUT/multi_gpu.log" 2>/dev/null
