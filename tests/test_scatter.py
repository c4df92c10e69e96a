"""Placing a chunk's piece with 2-D copies (the GPU's strided host-to-device copies) puts the
same bytes where the general scatter does, for every selection that is a box."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import host

from cupy_xarray.engine import scatter
from cupy_xarray.engine.plan import normalize_selection, output_shape, plan_chunks
from cupy_xarray.engine.scatter import box_copies, place_chunk
from cupy_xarray.engine.spec import ChunkRecipe
from cupy_xarray.options import get_options

#: the settings' limits on the 2-D copies of a box (``box_max_copies``, ``box_min_row``)
LIMITS = (get_options().box_max_copies, get_options().box_min_row)


def _apply(copies, src: bytes, out: np.ndarray) -> None:
    """What ``cudaMemcpy2DAsync`` does for each copy, on host bytes."""
    flat = out.reshape(-1).view(np.uint8)
    for s, d, width, height, spitch, dpitch in copies:
        for r in range(height):
            flat[d + r * dpitch : d + r * dpitch + width] = src[s + r * spitch : s + r * spitch + width]


def _selections(rng, shape):
    for _ in range(60):
        sel = []
        for n in shape:
            kind = rng.integers(4)
            if kind == 0:
                sel.append(int(rng.integers(n)))
            elif kind == 1:
                sel.append(slice(None))
            elif kind == 2:
                a = int(rng.integers(n))
                sel.append(slice(a, int(rng.integers(a, n)) + 1))
            else:
                sel.append(slice(int(rng.integers(n)), None, int(rng.integers(1, 3))))
        yield tuple(sel)


#: (array shape, chunk shape, dtype) of the geometry tests
LAYOUTS = [
    ((8, 96, 80), (4, 32, 40), "f4"),
    ((50, 70), (16, 64), "i2"),
    ((300,), (128,), "f8"),
    ((6, 5, 4, 70), (3, 5, 4, 64), "u1"),
]


@pytest.mark.parametrize("shape, chunks, dtype", LAYOUTS)
def test_box_copies_place_what_the_scatter_places(shape, chunks, dtype):
    # the geometry, whatever the limits on copies and row widths
    rng = np.random.default_rng(len(shape))
    recipe = ChunkRecipe(shape=chunks, dtype=np.dtype(dtype))
    src = np.frombuffer(rng.integers(0, 100, size=chunks).astype(dtype).tobytes(), np.uint8)
    boxes = 0
    for sel in _selections(rng, shape):
        nsel = normalize_selection(sel, shape)
        oshape = output_shape(nsel, shape)
        for piece in plan_chunks(nsel, shape, chunks):
            want = np.zeros(oshape, dtype)
            place_chunk(np, want, src, recipe, piece)
            copies = box_copies(recipe, piece, oshape, 10**9, 0)
            strided = any(isinstance(s, slice) and s.step not in (None, 1) for s in piece.chunk_sel)
            if copies is None:
                assert strided, piece
                continue
            boxes += 1
            got = np.zeros(oshape, dtype)
            _apply(copies, src, got)
            np.testing.assert_array_equal(got, want, err_msg=str(piece))
    assert boxes > 20


@pytest.mark.parametrize("shape, chunks, dtype", LAYOUTS + [((4, 3, 8, 6, 70), (2, 1, 4, 6, 64), "f4")])
def test_whole_chunk_boxes_place_what_the_scatter_places(shape, chunks, dtype):
    """The box a whole chunk is unshuffled into (:func:`.scatter.chunk_box`) holds the bytes
    the scatter puts there; pieces of part of a chunk have none."""
    from cupy_xarray.engine.decoders import Box

    rng = np.random.default_rng(7 + len(shape))
    recipe = ChunkRecipe(shape=chunks, dtype=np.dtype(dtype))
    src = np.frombuffer(rng.integers(0, 100, size=chunks).astype(dtype).tobytes(), np.uint8)
    boxed = 0
    for sel in list(_selections(rng, shape)) + [(slice(None),) * len(shape)]:
        nsel = normalize_selection(sel, shape)
        oshape = output_shape(nsel, shape)
        for piece in plan_chunks(nsel, shape, chunks):
            geometry = scatter.chunk_box(recipe, piece, oshape)
            whole = all(
                (isinstance(s, int) and n == 1) or (isinstance(s, slice) and s == slice(0, n, 1))
                for s, n in zip(piece.chunk_sel, chunks)
            )
            if geometry is None:
                assert not whole or len(chunks) > 4, piece
                continue
            assert whole, piece
            boxed += 1
            want = np.zeros(oshape, dtype)
            place_chunk(np, want, src, recipe, piece)
            got = np.zeros(oshape, dtype)
            box = Box(got.reshape(-1).view(np.uint8), *geometry)
            box.view()[...] = src.reshape(box.planes, box.rows, box.width)
            np.testing.assert_array_equal(got, want, err_msg=str(piece))
    assert boxed > 0


def test_narrow_rows_and_many_copies_are_left_to_the_scatter():
    shape = chunks = (20, 4, 4, 256)
    recipe = ChunkRecipe(shape=chunks, dtype=np.dtype("f4"))
    sel = normalize_selection((slice(None), slice(0, 3), slice(0, 3), slice(None)), shape)
    (piece,) = plan_chunks(sel, shape, chunks)
    assert box_copies(recipe, piece, (20, 3, 3, 256), *LIMITS) is None  # 20 copies of 3 rows
    sel = normalize_selection((slice(0, 4), slice(0, 3), slice(0, 3), slice(None)), shape)
    (piece,) = plan_chunks(sel, shape, chunks)
    assert len(box_copies(recipe, piece, (4, 3, 3, 256), *LIMITS)) == 4 <= get_options().box_max_copies
    # whole planes and rows fold into one copy: 40 rows of 3 KiB
    chunks = (40, 4, 256)
    recipe = ChunkRecipe(shape=chunks, dtype=np.dtype("f4"))
    (piece,) = plan_chunks(
        normalize_selection((slice(None), slice(0, 3), slice(None)), chunks), chunks, chunks
    )
    assert box_copies(recipe, piece, (40, 3, 256), *LIMITS) == [(0, 0, 3072, 40, 4096, 3072)]
    narrow = ChunkRecipe(shape=(64, 32), dtype=np.dtype("f4"))
    (piece,) = plan_chunks(normalize_selection((slice(0, 8), slice(0, 16)), (64, 32)), (64, 32), (64, 32))
    assert box_copies(narrow, piece, (8, 16), *LIMITS) is None  # 64-byte rows


def test_pieces_that_are_not_boxes_are_left_to_the_scatter():
    recipe = ChunkRecipe(shape=(4, 32), dtype=np.dtype("f4"))
    (piece,) = plan_chunks(normalize_selection((slice(None), slice(0, 32, 2)), (4, 32)), (4, 32), (4, 32))
    assert box_copies(recipe, piece, (4, 16), *LIMITS) is None
    swapped = ChunkRecipe(shape=(4, 32), dtype=np.dtype("f4"), byteorder=">" if np.little_endian else "<")
    (whole,) = plan_chunks(normalize_selection((slice(None),) * 2, (4, 32)), (4, 32), (4, 32))
    assert box_copies(swapped, whole, (4, 32), *LIMITS) is None
    assert box_copies(recipe, whole, (4, 32), *LIMITS) == [(0, 0, 512, 1, 512, 512)]


def _boxes_against_scatter(xp, shape, chunks, dtype, seed):
    """Place every piece of random selections with :class:`Boxes` (one run per selection)
    and with the scatter; the same output, and the pieces that are not boxes refused."""
    rng = np.random.default_rng(seed)
    recipe = ChunkRecipe(shape=chunks, dtype=np.dtype(dtype))
    grid = [-(-n // c) for n, c in zip(shape, chunks)]
    sources = {}
    placed = 0
    for sel in _selections(rng, shape):
        nsel = normalize_selection(sel, shape)
        oshape = output_shape(nsel, shape)
        want = xp.zeros(oshape, dtype)
        got = xp.zeros(oshape, dtype)
        boxes = scatter.Boxes(got)
        for piece in plan_chunks(nsel, shape, chunks):
            assert all(c < g for c, g in zip(piece.coords, grid))
            if piece.coords not in sources:  # each chunk its own bytes, with a tail past the chunk
                raw = rng.integers(0, 255, size=recipe.nbytes + 24, dtype=np.uint8)
                sources[piece.coords] = xp.asarray(raw)
            data = sources[piece.coords]
            place_chunk(xp, want, data, recipe, piece)
            if not boxes.add(data, recipe, piece):
                assert any(isinstance(s, slice) and s.step not in (None, 1) for s in piece.chunk_sel), piece
                place_chunk(xp, got, data, recipe, piece)
        placed += boxes.run(xp)
        np.testing.assert_array_equal(host(got), host(want), err_msg=str(sel))
    assert placed > 50


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
# the last: rows wider than one segment of the GPU kernel
@pytest.mark.parametrize("shape, chunks, dtype", [*LAYOUTS, ((3, 40000), (2, 33000), "f4")])
def test_boxes_place_what_the_scatter_places(device, shape, chunks, dtype):
    if device == "gpu":
        import cupy as xp
    else:
        xp = np
    _boxes_against_scatter(xp, shape, chunks, dtype, seed=len(shape) + chunks[-1])


def test_boxes_refuse_a_copy_past_its_chunk():
    recipe = ChunkRecipe(shape=(4, 32), dtype=np.dtype("f4"))
    (whole,) = plan_chunks(normalize_selection((slice(None),) * 2, (4, 32)), (4, 32), (4, 32))
    boxes = scatter.Boxes(np.zeros((4, 32), "f4"))
    assert boxes.add(np.zeros(recipe.nbytes - 4, np.uint8), recipe, whole)  # 4 bytes short
    with pytest.raises(ValueError, match="reaches past"):
        boxes.run(np)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("compressors", [None, "zstd"])
def test_batched_tiles_are_placed_by_boxes_alone(tmp_path, monkeypatch, device, compressors):
    """A read of tiles in batches places every piece with the batch's :class:`Boxes`, no
    scatter per piece, and gets zarr-python's values."""
    import zarr

    from cupy_xarray.engine import array_spec, place, read_arrays
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.engine.route import Scheduler

    data = (np.arange(12 * 40 * 50, dtype="f4") % 251).reshape(12, 40, 50)
    codecs = None if compressors is None else zarr.codecs.ZstdCodec(level=1)
    a = zarr.create_array(tmp_path / "t.zarr", data=data, chunks=(5, 16, 16), compressors=codecs)
    runs = []
    real_run = scatter.Boxes.run

    def counted(self, xp):
        runs.append(real_run(self, xp))
        return runs[-1]

    def refused(*args):
        raise AssertionError("a piece was scattered on its own")

    monkeypatch.setattr(scatter.Boxes, "run", counted)
    monkeypatch.setattr(place, "place_chunk", refused)
    spec = array_spec(a, name="t")
    for k, sel in enumerate(
        [(slice(None),) * 3, (slice(2, 11), 5, slice(3, 47)), (1, slice(None), slice(20, 21))]
    ):
        runs.clear()
        (got,) = read_arrays(
            [(spec, sel)], resolve_device(device), batch_bytes=40000, scheduler=Scheduler(force="batch")
        )
        np.testing.assert_array_equal(host(got), a[sel], err_msg=str(sel))
        assert sum(runs) > 0 and (k or len(runs) > 1), runs  # the whole array: several batches
