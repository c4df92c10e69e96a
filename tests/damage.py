"""A seeded campaign of damaged chunks: every codec the engine decodes itself, v2 and v3.

Each case damages one store in one way (a truncation, bit flips, an overwritten span, junk
appended, an emptied file, two chunks swapped, a garbled shard index), reads the array with
zarr-python on the CPU (the reference) and with the engine, then restores the bytes.

Outcomes of a case (:func:`run_case`):

``error``
    the engine raised one of its own errors (a ``ChunkError`` naming array and chunk, ...).
``same``
    the engine returned exactly what zarr-python returned (damage no format can see).
``intact``
    zarr-python raised but the engine returned the undamaged values (the damage did not
    touch anything the values depend on).
``silent`` / ``differs`` / ``bare``
    failures: values zarr-python refuses, values unlike zarr-python's, or an exception that
    is not the package's own.

Run as a script, it runs cases in child processes for the GPU: a child reads case after
case and checks after each one that its GPU still computes; a child that dies or stops
answering is recorded as ``crash`` or ``hang`` for the case it was on, and a new child
takes the next case (``python tests/damage.py --device gpu --cases 1000``; ``--route batch``
reads every case as a large read is read: nvCOMP and the decoder process where the settings
send a codec there, which the campaign's small stores otherwise never reach).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

KINDS = ("truncate", "flip", "overwrite", "append", "empty", "swap", "index")
OK = ("error", "same", "intact")


def _layouts() -> dict[str, tuple[int, dict]]:
    """name -> (zarr_format, keywords of zarr.create_array)."""
    import numcodecs
    import zarr
    from zarr.codecs import numcodecs as zn

    Blosc = zarr.codecs.BloscCodec
    v3 = {
        "none": {"compressors": None},
        "zstd": {"compressors": [zarr.codecs.ZstdCodec(level=3)]},
        "zstd-checksum": {"compressors": [zarr.codecs.ZstdCodec(level=3, checksum=True)]},
        "gzip": {"compressors": [zarr.codecs.GzipCodec(level=5)]},
        "zlib": {"compressors": [zn.Zlib(level=5)]},
        "lz4": {"compressors": [zn.LZ4()]},
        "blosc-lz4-shuffle": {"compressors": [Blosc(cname="lz4", clevel=5, shuffle="shuffle")]},
        "blosc-lz4-bitshuffle": {"compressors": [Blosc(cname="lz4", clevel=5, shuffle="bitshuffle")]},
        "blosc-zstd-shuffle": {"compressors": [Blosc(cname="zstd", clevel=3, shuffle="shuffle")]},
        "blosc-zstd-noshuffle": {"compressors": [Blosc(cname="zstd", clevel=3, shuffle="noshuffle")]},
        "crc32c": {"compressors": [zarr.codecs.Crc32cCodec()]},
        "zstd-crc32c": {"compressors": [zarr.codecs.ZstdCodec(level=1), zarr.codecs.Crc32cCodec()]},
        "sharded-zstd": {"compressors": [zarr.codecs.ZstdCodec(level=1)], "shards": (64, 64)},
    }
    v2 = {
        "none": None,
        "zstd": numcodecs.Zstd(level=3),
        "zstd-checksum": numcodecs.Zstd(level=3, checksum=True),
        "gzip": numcodecs.GZip(level=5),
        "zlib": numcodecs.Zlib(level=5),
        "lz4": numcodecs.LZ4(),
        "blosc-lz4-shuffle": numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
        "blosc-lz4-bitshuffle": numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE),
        "blosc-zstd-shuffle": numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE),
        "blosc-zstd-noshuffle": numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.NOSHUFFLE),
    }
    out = {f"v3-{k}": (3, kw) for k, kw in v3.items()}
    out.update({f"v2-{k}": (2, {"compressors": c}) for k, c in v2.items()})
    return out


LAYOUTS = tuple(sorted(_layouts()))


def values() -> np.ndarray:
    """Smooth float32 data with noise: compresses, and every byte matters."""
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:128, 0:128]
    return (np.sin(x / 9.0) * np.cos(y / 13.0) * 40 + 280 + rng.normal(0, 0.5, (128, 128))).astype("float32")


def build(root: str, layout: str) -> str:
    """Write the layout's store (one array ``a``, 128 x 128 float32, 32 x 32 chunks)."""
    import zarr

    fmt, kw = _layouts()[layout]
    path = os.path.join(root, f"{layout}.zarr")
    a = zarr.create_array(path, shape=(128, 128), chunks=(32, 32), dtype="float32", zarr_format=fmt, **kw)
    a[:] = values()
    return path


def chunk_files(store: str) -> list[str]:
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    out = []
    for top, _dirs, files in os.walk(store):
        out.extend(os.path.join(top, f) for f in files if f not in meta)
    return sorted(out)


@dataclass
class Case:
    index: int
    layout: str
    kind: str
    seed: int

    def label(self) -> str:
        return f"#{self.index} {self.layout} {self.kind} (seed {self.seed})"


def cases(count: int, seed: int = 0, layouts: tuple[str, ...] = LAYOUTS) -> list[Case]:
    """``count`` cases spread evenly over layouts and damage kinds, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        layout = layouts[i % len(layouts)]
        kinds = KINDS if "sharded" in layout else KINDS[:-1]
        kind = kinds[(i // len(layouts)) % len(kinds)]
        out.append(Case(i, layout, kind, int(rng.integers(2**31))))
    return out


def damage(case: Case, store: str) -> dict[str, bytes]:
    """Damage the store as ``case`` says; return the original bytes of every file touched."""
    rng = np.random.default_rng(case.seed)
    files = chunk_files(store)
    path = files[int(rng.integers(len(files)))]
    saved = {path: open(path, "rb").read()}
    data = bytearray(saved[path])
    n = len(data)
    if case.kind == "truncate":
        data = data[: int(rng.integers(0, max(n, 1)))]
    elif case.kind == "flip":
        for _ in range(int(rng.integers(1, 4))):
            if n:
                pos = int(rng.integers(n))
                data[pos] ^= 1 << int(rng.integers(8))
    elif case.kind == "overwrite":
        if n:
            start = int(rng.integers(n))
            span = int(rng.integers(1, min(64, n - start) + 1))
            data[start : start + span] = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
    elif case.kind == "append":
        data += rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes()
    elif case.kind == "empty":
        data = bytearray()
    elif case.kind == "swap":
        others = [f for f in files if f != path]
        other = others[int(rng.integers(len(others)))] if others else path
        saved[other] = open(other, "rb").read()
        with open(other, "wb") as f:
            f.write(saved[path])
        data = bytearray(saved[other])
    elif case.kind == "index":  # the shard index: the last 16 bytes per inner chunk + 4 (crc32c)
        nidx = min(n, 16 * 4 + 4)
        span = int(rng.integers(1, 9))
        start = n - nidx + int(rng.integers(0, max(nidx - span, 1)))
        data[start : start + span] = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
        if rng.random() < 0.5:  # and rewrite the index's crc32c, so that the entries themselves are tried
            import google_crc32c

            body = bytes(data[n - nidx : n - 4])
            data[n - 4 :] = int(google_crc32c.value(body)).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(bytes(data))
    return saved


def restore(saved: dict[str, bytes]) -> None:
    for path, raw in saved.items():
        with open(path, "wb") as f:
            f.write(raw)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == b.tobytes()


class Runner:
    """Stores built once per layout, read by zarr-python and by the engine on ``device``."""

    def __init__(self, root: str, device: str, scheduler=None) -> None:
        from cupy_xarray.engine.devices import resolve_device

        self.root = root
        self.device = resolve_device(device)
        self.scheduler = scheduler
        self.stores: dict[str, tuple[str, object]] = {}
        self.pristine = values()

    def store(self, layout: str):
        if layout not in self.stores:
            import zarr

            from cupy_xarray.engine import array_spec

            path = build(self.root, layout)
            self.stores[layout] = (path, array_spec(zarr.open_array(path, mode="r"), name="a"))
        return self.stores[layout]

    def run(self, case: Case) -> tuple[str, str]:
        """Outcome and detail of one case (see the module's docstring)."""
        import zarr

        from cupy_xarray.engine import read_arrays
        from cupy_xarray.errors import CupyXarrayError

        path, spec = self.store(case.layout)
        saved = damage(case, path)
        try:
            try:
                ref = np.asarray(zarr.open_array(path, mode="r")[...])
            except Exception as exc:  # noqa: BLE001 - the reference may refuse the damage
                ref = exc
            try:
                got = read_arrays(
                    [(spec, (slice(None), slice(None)))], self.device, scheduler=self.scheduler
                )[0]
                got = got.get() if hasattr(got, "__cuda_array_interface__") else np.asarray(got)
            except CupyXarrayError as exc:
                return "error", f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a failure of the campaign
                return "bare", f"{type(exc).__name__}: {exc}"
        finally:
            restore(saved)
        if isinstance(ref, Exception):
            if _same(got, self.pristine):
                return "intact", f"zarr-python: {type(ref).__name__}: {ref}"
            return "silent", f"engine returned values; zarr-python raised {type(ref).__name__}: {ref}"
        return (
            ("same", "")
            if _same(got, ref)
            else ("differs", "engine and zarr-python returned different values")
        )


def gpu_alive() -> str | None:
    """None when the GPU still computes correctly, else what failed."""
    try:
        import cupy

        x = cupy.arange(1 << 16, dtype=cupy.int64)
        total = int(x.sum())
        cupy.cuda.Device().synchronize()
        return None if total == (1 << 16) * ((1 << 16) - 1) // 2 else f"wrong sum {total}"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _scheduler(route: str):
    """The scheduler of a campaign's reads: the engine's own choice (``"auto"``: the campaign's
    small stores take the host route), or every chunk on the batch route (``"batch"``: what a
    large read does, nvCOMP and the decoder process where the settings send a codec there)."""
    from cupy_xarray.engine import Scheduler

    return None if route == "auto" else Scheduler(force=route)


def _child(args) -> None:
    runner = Runner(tempfile.mkdtemp(prefix="damage-"), args.device, _scheduler(args.route))
    todo = cases(args.cases, args.seed)[args.start :]
    canary = kept = None
    if args.device == "gpu":  # GPU data of the reading process's own: must survive every case
        import cupy

        kept = np.random.default_rng(args.seed).integers(0, 2**31, 1 << 20)
        canary = cupy.asarray(kept)
    for case in todo:
        print(json.dumps({"index": case.index, "started": True}), flush=True)
        t0 = time.perf_counter()
        outcome, detail = runner.run(case)
        seconds = time.perf_counter() - t0
        problem = gpu_alive() if args.device == "gpu" else None
        if not problem and canary is not None and not np.array_equal(canary.get(), kept):
            problem = "the reading process's GPU data changed"
        if problem:
            outcome, detail = "crash", f"GPU unusable after the case: {problem} ({detail})"
        msg = {"index": case.index, "outcome": outcome, "detail": detail[:300], "seconds": round(seconds, 3)}
        print(json.dumps(msg), flush=True)
        if problem:
            return


def campaign(
    count: int,
    seed: int,
    device: str,
    timeout: float = 60.0,
    log=None,
    deadline: float | None = None,
    route: str = "auto",
) -> list[dict]:
    """Run ``count`` cases in child processes; one result per case, in order. ``log``: a file
    that gets every case that is not OK as it happens, and the children's stderr; ``route``:
    see :func:`_scheduler`."""
    import select

    results: dict[int, dict] = {}
    start = 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    labels = cases(count, seed)

    def note(msg):
        results[msg["index"]] = msg
        if log is not None and msg["outcome"] not in OK:
            log.write(f"{labels[msg['index']].label()}: {msg['outcome']}: {msg['detail']}\n")
            log.flush()

    ends = None if deadline is None else time.monotonic() + deadline
    while start < count and (ends is None or time.monotonic() < ends):
        cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", "--device", device]
        cmd += ["--cases", str(count), "--seed", str(seed), "--start", str(start), "--route", route]
        err = log if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        fd = proc.stdout.fileno()
        current, running, buf, last = start, None, b"", time.monotonic()
        while True:
            if ends is not None and time.monotonic() > ends:
                proc.kill()  # out of time: the cases finished so far are the campaign
                proc.wait()
                current = count
                break
            ready, _, _ = select.select([fd], [], [], 0.1)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if chunk:
                last = time.monotonic()
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "outcome" in msg:
                        note(msg)
                        running, current = None, msg["index"] + 1
                    else:
                        running = msg["index"]
            elif ready:  # end of output: the child is gone
                proc.wait()
                if running is not None:  # it died during this case
                    detail = f"the process died (exit code {proc.returncode})"
                    note({"index": running, "outcome": "crash", "detail": detail})
                    current = running + 1
                elif current == start:  # it died before its first case
                    note({"index": start, "outcome": "crash", "detail": f"exit code {proc.returncode}"})
                    current = start + 1
                break
            elif time.monotonic() - last > timeout:
                proc.kill()
                proc.wait()
                stuck = running if running is not None else current
                note({"index": stuck, "outcome": "hang", "detail": f"no answer in {timeout:.0f} s"})
                current = stuck + 1
                break
        proc.stdout.close()
        start = current
    return [results[i] for i in sorted(results)]


def summary(results: list[dict], all_cases: list[Case]) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    failures = [
        f"{all_cases[r['index']].label()}: {r['outcome']}: {r['detail']}"
        for r in results
        if r["outcome"] not in OK
    ]
    timed = [r for r in results if "seconds" in r]
    longest = max(timed, key=lambda r: r["seconds"], default=None)
    return {
        "cases": len(results),
        "counts": counts,
        "longest_read_s": longest["seconds"] if longest else None,
        "longest_case": all_cases[longest["index"]].label() if longest else None,
        "failures": failures,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="gpu")
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--child", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", help="append failures (as they happen) and the children's stderr here")
    p.add_argument("--deadline", type=float, help="start no case after this many seconds; report those done")
    p.add_argument(
        "--route",
        choices=["auto", "batch", "host"],
        default="auto",
        help="batch: every read as a large one (nvCOMP and the decoder process where the settings say)",
    )
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    t0 = time.perf_counter()
    log = open(args.log, "a") if args.log else None
    results = campaign(args.cases, args.seed, args.device, args.timeout, log, args.deadline, args.route)
    report = summary(results, cases(args.cases, args.seed))
    report.update(
        device=args.device, route=args.route, seed=args.seed, seconds=round(time.perf_counter() - t0, 1)
    )
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    for line in report["failures"]:
        print("FAIL", line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report, "results": results}, f, indent=1)
    sys.exit(1 if report["failures"] or (report["cases"] != args.cases and args.deadline is None) else 0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
