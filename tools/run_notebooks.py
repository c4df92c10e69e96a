"""Execute the example notebooks top to bottom and write them, with their outputs, to a folder.

Usage: python tools/run_notebooks.py OUT_DIR [NOTEBOOK ...]   (default: examples/*.ipynb)
On the GPU machine this stores the GPU outputs that the docs render.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbclient
import nbformat


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in sys.argv[2:]] or sorted(Path("examples").glob("*.ipynb"))
    failed = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        try:
            nbclient.NotebookClient(nb, timeout=180, kernel_name="python3").execute()
            print("executed", path)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next notebook
            print("FAILED", path, str(exc)[-2000:])
            failed += 1
        nbformat.write(nb, out / path.name)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
