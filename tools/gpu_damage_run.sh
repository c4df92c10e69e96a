#!/usr/bin/env bash
# The GPU tests, the damage campaign on the GPU (child processes) and the checksum cost, in one go.
# Usage on the GPU machine:  OUT=/some/dir bash tools/gpu_damage_run.sh [size-GiB for the benchmark]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
ulimit -n 20000 2>/dev/null
python3 -m cupy_xarray info > "$OUT/info.txt" 2>&1
export CUPY_XARRAY_DECODE_TIMEOUT=${CUPY_XARRAY_DECODE_TIMEOUT:-8}
timeout 220 python3 -m pytest -v -m gpu tests --ignore tests/test_random_parity.py --timeout 150 \
  --deselect tests/test_damage.py::test_damage_campaign_gpu -p no:cacheprovider -W ignore --tb=short -rfE \
  > "$OUT/gpu_tests.log" 2>&1
CUPY_XARRAY_DAMAGE_JSON="$OUT/campaign.json" timeout 170 python3 -m pytest -q -s -m gpu \
  tests/test_damage.py::test_damage_campaign_gpu -p no:cacheprovider -W ignore > "$OUT/gpu_campaign.log" 2>&1
if [ -n "${1:-}" ]; then
  timeout 170 python3 benchmarks/read_throughput.py --dir /tmp/bench --size-gib "$1" \
    --stores "${STORES:-zstd,zstd-checksum,gzip,zlib,lz4,blosc-lz4,blosc-zstd}" --paths "kvikio engine,engine decode=gpu,zarr GPU mode" --repeat 3 \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
fi
for f in "$OUT"/*.log; do echo "== $f"; tail -4 "$f"; done
