"""Large uncompressed reads are located and planned one batch at a time, as their batches are
submitted (Scheduler.streams): the values, missing chunks and errors are those of a read planned
all at once."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from conftest import host
from test_reliability import gpu_memory_returns

from cupy_xarray.engine import array_spec, batches, read_arrays
from cupy_xarray.engine.devices import cpu_device, gpu_device
from cupy_xarray.engine.route import Scheduler
from cupy_xarray.errors import ChunkError


def _dev(device):
    return gpu_device(2) if device == "gpu" else cpu_device(2)


def _scheduler(device):
    # a GPU read sends large uncompressed reads to the batches itself; a CPU read is told to
    return None if device == "gpu" else Scheduler(force="batch")


def _arrays(tmp_path):
    """Tiles with edge chunks and a fill value, two of them missing; and slabs (each chunk
    one run of the output: read straight into it)."""
    rng = np.random.default_rng(7)
    data = rng.random((12, 40, 40), dtype="float32")
    tiles = zarr.create_array(
        tmp_path / "t.zarr",
        shape=data.shape,
        chunks=(2, 16, 16),
        dtype="f4",
        compressors=None,
        fill_value=-1.5,
    )
    tiles[:] = data
    for key in ("c/0/1/2", "c/5/0/0"):
        (tmp_path / "t.zarr" / key).unlink()
    slabs = zarr.create_array(tmp_path / "s.zarr", data=data[:, :, :32], chunks=(1, 40, 32), compressors=None)
    return tiles, slabs


@pytest.fixture
def segments(monkeypatch, options):
    """Stream every read, and count the segments located."""
    options(stream_bytes=1)
    located = []
    real = batches.Segment.locate

    def counted(self, read):
        tasks = real(self, read)
        located.append(len(self.pieces))
        return tasks

    monkeypatch.setattr(batches.Segment, "locate", counted)
    return located


SELECTIONS = {
    "all": (slice(None), slice(None), slice(None)),
    "parts of chunks": (slice(1, 11), slice(3, 37), slice(5, 29)),
    "an index array": (np.array([0, 3, 4, 11]), slice(2, 30), slice(None)),
}


@pytest.mark.parametrize("which", list(SELECTIONS))
def test_a_streamed_read_equals_zarr(tmp_path, device, segments, which):
    tiles, slabs = _arrays(tmp_path)
    sel = SELECTIONS[which]
    requests = [(array_spec(tiles, name="t"), sel), (array_spec(slabs, name="s"), sel)]
    got = read_arrays(requests, _dev(device), batch_bytes=24 * 1024, scheduler=_scheduler(device))
    for (spec, _), arr, out in zip(requests, (tiles, slabs), got):
        want = arr.get_orthogonal_selection(
            tuple(s.tolist() if isinstance(s, np.ndarray) else s for s in sel)
        )
        np.testing.assert_array_equal(host(out), want, err_msg=spec.name)
    assert len(segments) >= 4, segments  # planned in several segments, not at once
    assert (host(got[0]) == -1.5).any() or which == "an index array"  # missing chunks filled


def test_a_small_read_is_planned_at_once(tmp_path, device, monkeypatch):
    tiles, _ = _arrays(tmp_path)
    seen = []
    monkeypatch.setattr(batches, "segments", lambda *a: seen.append(a) or [])
    (got,) = read_arrays([(array_spec(tiles, name="t"), (slice(None),) * 3)], _dev(device))
    np.testing.assert_array_equal(host(got), tiles[:])
    assert not seen  # 77 KiB: below the stream_bytes option


def test_a_damaged_chunk_of_a_later_segment_is_named(tmp_path, device, segments):
    tiles, _ = _arrays(tmp_path)
    chunk = tmp_path / "t.zarr" / "c" / "5" / "2" / "1"
    chunk.write_bytes(chunk.read_bytes()[:100])
    with gpu_memory_returns(device), pytest.raises(ChunkError, match=r"c/5/2/1") as info:
        read_arrays(
            [(array_spec(tiles, name="t"), (slice(None),) * 3)],
            _dev(device),
            batch_bytes=24 * 1024,
            scheduler=_scheduler(device),
        )
    assert "expected" in str(info.value) and len(segments) >= 2, (str(info.value), segments)
