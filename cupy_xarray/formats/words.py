"""Fixed-width integers read out of byte arrays, on any array module."""

from __future__ import annotations

import numpy as np


def le32(raw: np.ndarray) -> np.ndarray:
    """Little-endian 32-bit words from the last axis of a ``(..., 4)`` uint8 array."""
    w = raw.astype(np.uint32)
    return w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24


def be32(raw: np.ndarray) -> np.ndarray:
    """Big-endian 32-bit words from the last axis of a ``(..., 4)`` uint8 array."""
    w = raw.astype(np.uint32)
    return w[..., 0] << 24 | w[..., 1] << 16 | w[..., 2] << 8 | w[..., 3]
