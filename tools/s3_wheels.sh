#!/usr/bin/env bash
# Adds to .whl/ what the S3 loopback tests need on a machine without network (the GPU machine):
# s3fs, and moto's S3 server without its optional extras, with botocore's service models cut
# down to S3 and STS so that the wheelhouse still fits a 64 MiB transfer.
# Usage, from the project's root after the main wheelhouse is built:
#   bash tools/s3_wheels.sh [PYTHON_VERSION]      (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
mkdir -p .whl
reqs=(
  moto==5.2.5 boto3==1.43.117 botocore==1.43.117 s3transfer==0.19.3 jmespath==1.1.0
  python-dateutil==2.9.0.post0 six==1.17.0 urllib3==2.8.0 requests==2.34.2 idna==3.20
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 responses==0.26.3 xmltodict==1.0.4
  werkzeug==3.1.9 flask==3.1.3 flask-cors==6.0.5 blinker==1.9.0 itsdangerous==2.2.0 click==8.5.1
  markupsafe==3.0.4 py-partiql-parser==0.6.3 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  s3fs==2026.9.0 aiobotocore==3.10.0 aioitertools==0.13.0 wrapt==2.5.2
)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${plat[@]}" -d .whl "${reqs[@]}" 2>&1 | grep -v '^WARNING: Location' || true
python3 - <<'PY'
import glob, os, zipfile

keep = ("s3", "sts", "sso", "sso-oidc")
for w in glob.glob(".whl/botocore-*.whl"):
    with zipfile.ZipFile(w) as z:
        items = z.infolist()
        kept = [
            i for i in items
            if not i.filename.startswith("botocore/data/")
            or i.filename.count("/") == 2  # endpoints.json, partitions.json, _retry.json, ...
            or i.filename.split("/")[2] in keep
        ]
        if len(kept) == len(items):
            continue
        with zipfile.ZipFile(w + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
            for i in kept:
                out.writestr(i, z.read(i))
    os.replace(w + ".tmp", w)
PY
du -sh .whl | sed 's/^/wheelhouse: /'
