"""The outcomes of a campaign script (``hostile.py``, ``remote_faults.py``): counts, failures,
the longest read, and the summary line they end on."""

from __future__ import annotations

import json
import sys
import time


class Tally:
    """Count outcomes; any outside ``ok`` is a failure, listed after the summary."""

    def __init__(self, ok: tuple[str, ...]) -> None:
        self.ok = ok
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.longest = 0.0
        self.start = time.perf_counter()

    def add(self, label: str, outcome: str, detail: str = "", seconds: float = 0.0) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.longest = max(self.longest, seconds)
        if outcome not in self.ok:
            self.failures.append(f"{label}: {outcome}: {detail}")

    def finish(self, cases: int) -> None:
        """Print the summary (JSON) and the failures, and exit 1 where there are any."""
        summary = {"cases": cases, "counts": self.counts, "longest_read_s": round(self.longest, 3)}
        summary["seconds"] = round(time.perf_counter() - self.start, 1)
        print(json.dumps(summary))
        for line in self.failures:
            print("FAIL", line)
        sys.exit(1 if self.failures else 0)
