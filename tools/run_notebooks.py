"""Execute the example notebooks top to bottom and write them, with their outputs, to a folder.

Usage: python tools/run_notebooks.py OUT_DIR [NOTEBOOK ...]   (default: examples/*.ipynb)
On the GPU machine this stores the GPU outputs that the docs render.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbclient
import nbformat


def _as_a_terminal_shows(nb) -> None:
    """Stream outputs as a terminal shows them: consecutive writes to one stream joined, and
    text a carriage return went back over (a progress bar's updates) dropped."""
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            last = outputs[-1] if outputs else None
            if (
                out.get("output_type") == "stream"
                and last is not None
                and last.get("output_type") == "stream"
                and last.get("name") == out.get("name")
            ):
                last["text"] += out["text"]
                continue
            outputs.append(out)
        for out in outputs:
            if out.get("output_type") == "stream" and "\r" in out["text"]:
                out["text"] = "\n".join(line.rsplit("\r", 1)[-1] for line in out["text"].split("\n"))
        if "outputs" in cell:
            cell["outputs"] = outputs


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
        _as_a_terminal_shows(nb)
        nbformat.write(nb, out / path.name)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
