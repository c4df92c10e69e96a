#!/usr/bin/env bash
# The default read's benchmark on the GPU machine, before and after a change, in one run:
# the GPU tests of the route, then benchmarks/route_table.py for each engine named (a copy of
# the package under BASE= for "base", this checkout for "new", and "now": this checkout with
# CUPY_XARRAY_SHARE_START=now), at 1 GiB (QUICK_GIB) and, where RECORD_GIB is set, at that size.
# Usage on the GPU machine:  OUT=/some/dir BASE=/path/to/old/package/parent bash tools/gpu_routes.sh
# (TESTS= the test files to run with -m gpu; VARIANTS= the engines compared, each maybe with
# engine settings after "@", e.g. "base new new@read_ahead=on"; BASE_SITE= a folder where the
# base's own wheel is installed, where its entry point differs)
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
ulimit -n 20000 2>/dev/null
nvidia-smi -L
# byte-compile what runs, as an installed package is: a fresh process's first reads import
# modules, and compiling them from source would be timed as part of those reads. The
# machine's own packages may carry no bytecode and be read-only: theirs goes to a cache
# prefix that every process of this run reads.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/cupy-xarray-pycache}
own=$(python3 -c "import importlib.util as u; print(' '.join(s.submodule_search_locations[0] for n in ('xarray', 'pandas', 'numpy', 'cupy', 'cupyx', 'cupy_backends', 'dask', 'zarr', 'numcodecs', 'kvikio', 'nvidia') if (s := u.find_spec(n)) and s.submodule_search_locations))" 2>/dev/null)
python3 -m compileall -q -j 0 $own "${SITE:-/tmp/site}" "$R/cupy_xarray" "${BASE:-$R/.base}" > /dev/null 2>&1
[ "${TESTS_S:-150}" = 0 ] || PYTHONPATH=$R:${SITE:-/tmp/site} timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore \
  ${TESTS:-tests/test_share.py tests/test_route.py tests/test_engine.py tests/test_gather.py} > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
cd benchmarks
bench() {  # name[@setting=value,...], size, extra args
  local v=$1 size=$2; shift 2
  local p=$R start=decode engine sets=() f=${v//[@=,]/_}
  engine=${v%%@*}
  [ "$v" != "$engine" ] && for kv in $(tr , ' ' <<< "${v#*@}"); do sets+=(--set "$kv"); done
  # (BASE_SITE: the base's own install first, its entry point among them)
  [ "$engine" = base ] && p=${BASE:-$R/.base}${BASE_SITE:+:$BASE_SITE}
  [ "$engine" = now ] && start=now
  PYTHONPATH=$p:${SITE:-/tmp/site} CUPY_XARRAY_SHARE_START=$start timeout "${BENCH_S:-200}" \
    python3 route_table.py --dir /tmp/routes --size-gib "$size" --json "$OUT/$f-$size.json" "${sets[@]}" "$@" \
    > "$OUT/$f-$size.log" 2>&1
  echo "$v $size GiB: rc $?"
}
[ "${QUICK_GIB:-1}" = 0 ] || for v in ${VARIANTS:-base new now}; do bench "$v" "${QUICK_GIB:-1}" --fresh-runs 1 --repeat 2; done
[ "${QUICK_GIB:-1}" = 0 ] || python3 route_table.py --compare $(for v in ${VARIANTS:-base new now}; do echo "$OUT/${v//[@=,]/_}-${QUICK_GIB:-1}.json"; done)
if [ -n "${RECORD_GIB:-}" ]; then
  for v in ${RECORD_VARIANTS:-base new}; do
    bench "$v" "$RECORD_GIB" --fresh-runs 2 --repeat 3 --skip era5 --stores "${RECORD_STORES:-zstd tiles,zstd3 tiles}"
  done
  python3 route_table.py --compare $(for v in ${RECORD_VARIANTS:-base new}; do echo "$OUT/${v//[@=,]/_}-$RECORD_GIB.json"; done)
fi
