"""zarr's ``crc32c`` codec: a little-endian CRC-32C (Castagnoli) after the bytes it covers.

It is checked on the host (google-crc32c) wherever it sits in a chain; a crc32c before a
compressor proves the stored stream, which lets ``decode="auto"`` hand zstd frames to nvCOMP.
Shard indexes carry one too (:mod:`.sharding`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "crc32c"


def value(data: Any) -> int:
    """CRC-32C of a host buffer, as zarr's ``crc32c`` codec computes it."""
    import google_crc32c

    return int(google_crc32c.value(bytes(memoryview(data))))


def strip(xp: Any, data: Any) -> Any:
    """Check and remove a trailing crc32c; raise ValueError on a mismatch."""
    if len(data) < 4:
        raise ValueError("too short to hold a crc32c checksum")
    host = np.ascontiguousarray(data.get() if xp.__name__ == "cupy" else data)
    stored = int.from_bytes(host[-4:].tobytes(), "little")
    if value(host[:-4]) != stored:
        raise ValueError("crc32c checksum mismatch (corrupt chunk)")
    return data[:-4]
