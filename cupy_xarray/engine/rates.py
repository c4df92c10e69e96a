"""Each stream kind's cost figures on this machine: built in (measured on an H200 host),
or measured once per machine (:func:`rates`, which :func:`~cupy_xarray.warm_up` runs with
``measure=True``) and kept in a cache file. The route decision starts from them
(:mod:`.route`); what reads then observe corrects them (:mod:`.observed`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from ..options import Options
from ..runtime import nvcomp
from .decoders import Rates, stream
from .decoders.registry import STREAMS

log = logging.getLogger("cupy_xarray")

#: each stream kind's figures measured on an H200 host (:attr:`~.decoders.StreamDecoder.rates`)
DEFAULT_RATES: dict[str, Rates] = {kind: decoder.rates for kind, decoder in STREAMS.items()}

_lock = threading.Lock()
_cache: dict[str, Rates] = {}


def cache_path(options: Options) -> str:
    """Where measured rates are kept (the ``cache_dir`` option, ``CUPY_XARRAY_CACHE``; else
    ``~/.cache/cupy-xarray``)."""
    root = options.cache_dir or os.path.join(os.path.expanduser("~/.cache"), "cupy-xarray")
    return os.path.join(root, "decode-rates.json")


_machine_keys: dict[str, str] = {}


def machine_key(device: Any) -> str:
    """Names the machine the rates belong to: GPU model, core count, nvCOMP build (asked of
    the driver once per device: every scheduled read needs it)."""
    key = _machine_keys.get(device.key)
    if key is None:
        nv = nvcomp.version() if device.codecs.name == "nvcomp" else 0
        # (the last field: the model's version; figures measured under another are measured again)
        key = _machine_keys[device.key] = f"{device.model()}|{os.cpu_count()} cores|nvcomp {nv}|model 4"
    return key


def known_rates(kind: str, read: Any) -> Rates:
    """The rates for ``kind`` of the machine a read (:class:`~.read.Read`) runs on, where
    measured before (:func:`rates`, which :func:`~cupy_xarray.warm_up` runs), else
    :data:`DEFAULT_RATES`; never measures (a read must not wait for that)."""
    default = DEFAULT_RATES.get(kind, DEFAULT_RATES["zstd"])
    if not read.options.calibrate:
        return default
    key = f"{machine_key(read.device)}|{kind}"
    found = _cache.get(key)
    if found is None:
        stored = load(cache_path(read.options)).get(key)
        try:
            found = _cache[key] = Rates(**stored) if stored else default
        except TypeError:  # written by another version
            found = _cache[key] = default
    return found


def rates(kind: str, device: Any, options: Options) -> Rates:
    """This machine's rates for ``kind``: from the cache file, else measured now and cached.

    The ``calibrate`` option off (``CUPY_XARRAY_CALIBRATE=0``) uses :data:`DEFAULT_RATES`
    without measuring.
    """
    if not options.calibrate:
        return DEFAULT_RATES[kind]
    with _lock:
        key = f"{machine_key(device)}|{kind}"
        if key in _cache and _cache[key].measured:
            return _cache[key]
        path = cache_path(options)
        stored = load(path)
        if key in stored:
            try:
                _cache[key] = Rates(**stored[key])
                return _cache[key]
            except TypeError:  # written by another version: measure again
                pass
        try:
            measured = calibrate(kind, device)
        except Exception as exc:  # noqa: BLE001 - a failed measurement falls back to the defaults
            log.warning("could not measure %s decode rates (%s); using defaults", kind, exc)
            measured = DEFAULT_RATES[kind]
        _cache[key] = measured
        stored[key] = asdict(measured)
        _store(path, stored)
        log.debug("decode rates for %s: %s", kind, measured)
        return measured


def load(path: str) -> dict:
    """The rates stored at ``path`` (empty where none or unreadable)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measure again next time
        log.debug("cannot cache decode rates at %s: %s", path, exc)


def sample_streams(kind: str, count: int, nbytes: int = 2**20) -> tuple[list[np.ndarray], int]:
    """``count`` streams of ``kind`` holding ``nbytes`` of smooth float32 data each (as
    geophysical fields compress), framed as zarr stores them."""
    n = nbytes // 4
    x = np.linspace(0, 40 * np.pi, n, dtype=np.float32)
    field = np.sin(x) * 20 + 280
    field[::97] += np.random.default_rng(0).standard_normal(len(field[::97])).astype(np.float32)
    data = (np.round(field * 64) / 64).astype(np.float32).tobytes()
    one = np.frombuffer(stream(kind).sample(data), dtype=np.uint8)
    return [one.copy() for _ in range(count)], nbytes


def calibrate(kind: str, device: Any) -> Rates:
    """Measure ``kind``'s rates here: one CPU thread on a few 1 MiB streams (64 KiB for
    Blosc's), and nvCOMP on 1 stream and on 64 MiB of them (about 0.1-0.5 s, once per
    machine and kind; reads refine the figures, :func:`learn`)."""
    decoder = stream(kind)
    base = decoder.rates
    size = decoder.sample_bytes
    many = 64 * 2**20 // size
    streams, n = sample_streams(kind, many, size)
    out = np.empty(n, dtype=np.uint8)
    decoder.decode_host(streams[0], n, out)
    t0 = time.perf_counter()
    for s in streams[:8]:
        decoder.decode_host(s, n, out)
    host = 8 * n / (time.perf_counter() - t0)
    if not getattr(device.codecs, "available", False) or not decoder.calibrates_gpu:
        return Rates(host, base.gpu, base.gpu_stream, base.gpu_call, measured=True, host_pool=base.host_pool)
    xp = device.xp
    dev = [xp.asarray(s) for s in streams]

    def run(count: int) -> float:
        device.synchronize()
        t = time.perf_counter()
        device.codecs.decode(kind, dev[:count], [n] * count, on_gpu=True)
        device.synchronize()
        return time.perf_counter() - t

    run(1)  # loads nvCOMP's kernels
    t1 = min(run(1) for _ in range(3))
    t_many = min(run(many) for _ in range(2))
    call = min(base.gpu_call, t1 / 2)
    # 64 sample streams are a fraction of what fills the GPU (an nvCOMP call takes about as
    # long for a thousand frames as for a few): the many-stream rate they show is a floor, and
    # the figure measured on full loads stands where it is higher (reads by nvCOMP alone
    # refine it, :func:`learn`)
    gpu = max((many - 1) * n / max(t_many - t1, 1e-6), base.gpu)
    one = n / max(t1 - call, 1e-6)
    # the pool's rate cannot be measured on samples: reads measure it (:func:`learn`)
    return Rates(host, gpu, one, call, measured=True, host_pool=base.host_pool)
