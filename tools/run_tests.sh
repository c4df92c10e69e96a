#!/usr/bin/env bash
# Install the project with its test and notebooks extras into a fresh virtual environment per Python
# (3.11 with zarr 3.1.x, 3.12 with the newest zarr), then run ruff and the test suite (the example
# notebooks included), and build the docs with warnings as errors; on the newest Python, the
# conformance run of xarray's own Zarr tests (tools/conformance.py).
# GPU tests skip cleanly where no CUDA device is available.
# --quick: the newest Python alone, ruff and pytest, no conformance run and no docs build.
# --smoke: the newest Python alone with the package and pytest only: the docs examples, and a
#          read and a write round trip per device (about two minutes on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1
smoke=0
[ "${1:-}" = "--smoke" ] && { smoke=1; quick=1; }
versions="3.11 3.12"
[ $quick -eq 1 ] && versions="3.12 3.11"  # the newest found first; only it runs
pythons=()
for v in $versions; do
  if command -v "python$v" >/dev/null 2>&1 && "python$v" -c '' 2>/dev/null; then
    pythons+=("$(command -v "python$v")")
  elif command -v pyenv >/dev/null 2>&1 && p=$(ls -d "$(pyenv root)"/versions/$v.*/bin/python 2>/dev/null | sort -V | tail -1) && [ -n "$p" ]; then
    pythons+=("$p")
  fi
done
[ ${#pythons[@]} -gt 0 ] || { echo "no Python 3.11 or 3.12 found" >&2; exit 1; }
[ $quick -eq 1 ] && pythons=("${pythons[0]}")
status=0
summary=()
# pip's output less setuptools' banner about editable installs (the tests import the checkout)
quiet() { awk '/BuildBackendWarning: Editable installation/{skip=1} skip&&/with strategy, WheelFile/{skip=0; next} !skip && !/^WARNING: Location/'; }
if [ $smoke -eq 1 ]; then
  py=${pythons[0]}
  venv=$(mktemp -d /tmp/cupy-xarray-venv.XXXXXX)
  echo "== smoke run: $("$py" --version), in a fresh virtual environment (removed afterwards)"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -e . pytest "dask[array]" 2>&1 | quiet || true
  set +e
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning \
    tests/test_docs_examples.py tests/test_smoke.py
  rc=$?
  set -e
  rm -rf "$venv"
  [ $rc -eq 0 ] && echo "smoke run green" || echo "smoke run FAILED (pytest exited $rc)"
  exit $rc
fi
for py in "${pythons[@]}"; do
  venv=$(mktemp -d /tmp/cupy-xarray-venv.XXXXXX)
  echo "== $("$py" --version), in a fresh virtual environment (removed afterwards)"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet || true
  "$venv/bin/python" -m pip install -q -e ".[test,notebooks]" 2>&1 | quiet || true
  "$venv/bin/python" -c "import zarr, xarray; print('zarr', zarr.__version__, 'xarray', xarray.__version__)"
  echo "-- ruff"
  "$venv/bin/python" -m ruff check cupy_xarray tests benchmarks || status=1
  set +e
  log=$(mktemp)
  echo "-- pytest: every test file (a dot per test, the share done at the end of each line)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  gpu=$("$venv/bin/python" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests 2>/dev/null | tail -1)
  g=${gpu%% *}
  summary+=("$("$py" --version): $(grep -E '(passed|failed)' "$log" | tail -1 | tr -d '=') (tests marked gpu: ${g%/*} of ${g#*/})")
  rm -f "$log"
  set -e
  # exit code 5 (no tests collected) is a failure too
  [ $rc -eq 0 ] || { echo "pytest exited $rc on $py"; status=1; }
  if [ "$py" = "${pythons[-1]}" ] && [ $quick -eq 0 ]; then
    # xarray's own Zarr tests, unrouted and routed through the package (docs/contributing.md)
    echo "-- conformance: xarray's own Zarr tests, four routes (a line after each, about 10 minutes in all)"
    if "$venv/bin/python" tools/conformance.py; then
      summary+=("conformance ($("$py" --version)): 0 unexplained failures")
    else
      echo "conformance run failed"; status=1
      summary+=("conformance ($("$py" --version)): FAILED")
    fi
    # the docs, warnings as errors (offline: no intersphinx inventories without internet)
    echo "-- docs build"
    "$venv/bin/python" -m pip install -q -e ".[docs]" 2>&1 | quiet || true
    CUPY_XARRAY_DOCS_OFFLINE=1 "$venv/bin/python" -m sphinx -W --keep-going -q -b html docs docs/_build/html \
      && echo "docs built: docs/_build/html" || { echo "docs build failed"; status=1; }
  fi
  rm -rf "$venv"
done
echo "== summary"
printf '%s\n' "${summary[@]}"
echo "(tests marked gpu skip where no CUDA device is available: python -m pytest -m gpu tests on a GPU machine runs them)"
[ $status -eq 0 ] && echo "all green" || echo "FAILED: see above"
exit $status
