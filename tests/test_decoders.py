"""Each stream kind's decoder on its own: host decode, framing checks, bare streams."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_xarray.engine.decoders import registry, stream, stream_kind
from cupy_xarray.engine.decoders.chain import stream_problem
from cupy_xarray.engine.spec import COMPRESSORS
from cupy_xarray.runtime.nvcomp import ALGORITHMS

DATA = (np.arange(50_000, dtype=np.float32) % 977).tobytes()


def test_every_compressor_the_engine_reads_has_a_decoder():
    for name in COMPRESSORS:
        decoder = stream(stream_kind((name,)))
        assert decoder.nvcomp in ALGORITHMS, name
        assert decoder.rates.gpu > 0 and decoder.rates.host_thread > 0, name
    assert set(registry.STREAMS) == {"zstd", "gzip", "zlib", "lz4", "lz4-block"}


@pytest.mark.parametrize("kind", sorted(registry.STREAMS))
def test_host_decode_round_trips_and_fills_the_target(kind):
    decoder = stream(kind)
    src = np.frombuffer(decoder.sample(DATA), dtype=np.uint8)
    into = np.zeros(len(DATA), dtype=np.uint8)
    out = decoder.decode_host(src, len(DATA), into)
    assert out.tobytes() == DATA and np.shares_memory(out, into)
    assert stream_problem(kind, src, len(DATA)) is None
    bare = decoder.deframe(src)
    assert len(bare) == len(src) - decoder.lead - decoder.trail


@pytest.mark.parametrize("kind", ["zstd", "gzip", "zlib", "lz4"])
def test_framing_damage_is_named_before_decoding(kind):
    src = np.frombuffer(stream(kind).sample(DATA), dtype=np.uint8).copy()
    wrong_size = stream_problem(kind, src, len(DATA) + 4)
    src[0] ^= 0xFF
    damaged = stream_problem(kind, src, len(DATA))
    assert damaged and "corrupt chunk" in damaged
    if kind != "zlib":  # a zlib header does not hold the size
        assert wrong_size and "corrupt" in wrong_size


def test_a_truncated_zstd_frame_is_caught_by_its_walk():
    src = np.frombuffer(stream("zstd").sample(DATA), dtype=np.uint8)
    problem = stream_problem("zstd", src[: len(src) // 2], len(DATA))
    assert problem and "zstd frame" in problem and "truncated" in problem


@pytest.mark.parametrize("kind", sorted(registry.STREAMS))
def test_host_decode_refuses_a_stream_that_decodes_to_the_wrong_size(kind):
    decoder = stream(kind)
    src = np.frombuffer(decoder.sample(DATA), dtype=np.uint8)
    with pytest.raises(Exception):  # noqa: B017 - each library raises its own error
        decoder.decode_host(src, len(DATA) - 100)


def test_decode_choices_follow_each_decoders_safety_rule():
    from types import SimpleNamespace

    from cupy_xarray.engine.route import chain_route, safe_on_gpu
    from cupy_xarray.options import get_options

    for kind, decoder in registry.STREAMS.items():
        assert safe_on_gpu(kind) == (not decoder.host_only)
    assert safe_on_gpu("zstd", proven=True)
    gpu = SimpleNamespace(name="gpu")
    for codecs in [("zstd",), ("lz4",), ("gzip",), ("zlib",), ("blosc-lz4",), ("crc32c", "zstd")]:
        reads = {d: SimpleNamespace(device=gpu, decode=d, options=get_options()) for d in ("gpu", "cpu")}
        assert chain_route(codecs, reads["gpu"]).nvcomp and not chain_route(codecs, reads["cpu"]).nvcomp
