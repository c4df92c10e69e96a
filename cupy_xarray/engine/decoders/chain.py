"""A chunk's chain of byte codecs run over its stored bytes, for both of the engine's routes.

- :func:`decode_group` runs a chain over a group of staged chunks of the reader's batches:
  ``crc32c`` stripped and checked, each stream's framing checked on the host
  (:meth:`~.base.StreamDecoder.check`, and for kinds that say where they end,
  :meth:`~.base.StreamDecoder.walk`) and decoded in one call of ``Device.codecs``
  (:mod:`.batch`), Blosc chunks laid out and decoded by :mod:`.blosc`;
- :func:`decode_on_host` runs it over one chunk on a CPU thread (the host route).

Neither names a stream kind: what each kind needs lives in its decoder (:mod:`.registry`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...device import to_host
from ...formats import blosc as blosc_format
from ...formats import crc32c
from ...formats.words import le32
from ...runtime.nvcomp import DecodeTimeout
from . import blosc
from .base import DecodeFailure
from .registry import stream


def frame_problem(name: str, head: bytes, tail: bytes, length: int, expected: int) -> str | None:
    """The error for a stored stream of ``length`` bytes whose first 32 and last 4 bytes are
    ``head`` and ``tail``, or None."""
    if length < 4:
        return f"{length} bytes is too short for a {name} stream (corrupt chunk)"
    problem = stream(name).check(head, tail, expected)
    return f"{problem} (corrupt chunk)" if problem else None


def length_problem(name: str, walked: int, length: int) -> str | None:
    """The error for a stream whose own structure ends at ``walked`` (-1: malformed) in a
    stored stream of ``length`` bytes, or None."""
    if walked == length:
        return None
    what = "runs past the end of" if walked < 0 else f"is {walked} bytes, not the {length} of"
    return f"{name} {stream(name).unit} {what} the stored stream (truncated or corrupt chunk)"


def stream_problem(name: str, data: np.ndarray, expected: int) -> str | None:
    """The error for one stored stream held on the host (its framing, and where its kind
    says where it ends, its length), or None."""
    problem = frame_problem(name, bytes(data[:32]), bytes(data[-4:]), len(data), expected)
    if problem:
        return problem
    walked = stream(name).walk(np, data, np.zeros(1, np.int64), np.array([len(data)], np.int64))
    return None if walked is None else length_problem(name, int(walked[0]), len(data))


def writes_into_output(codecs: tuple[str, ...]) -> bool:
    """Whether the chain's last decoder can write a chunk straight into the output (a
    trailing crc32c only strips bytes from what the codec before it wrote)."""
    return bool(codecs) and codecs[-1] != "crc32c"


def _ends_in_blosc(codecs: tuple[str, ...]) -> bool:
    return bool(codecs) and codecs[-1].startswith("blosc-")


def decodes_through_scratch(codecs: tuple[str, ...]) -> bool:
    """Whether decoding into the output still holds the chunk's decoded size beside it (Blosc
    decodes its streams into scratch and unshuffles from there)."""
    return _ends_in_blosc(codecs)


def decodes_into_boxes(codecs: tuple[str, ...]) -> bool:
    """Whether the chain's last decoder can write a whole chunk into its box of the output
    when the chunk is not one run there (Blosc's unshuffle, on the GPU: no scratch, no
    scatter; :class:`.base.Box`)."""
    return _ends_in_blosc(codecs)


def _steps(codecs: tuple[str, ...], nbytes: int):
    """The decoders of a chain in decode order: ``(name, expected, last, proven)``, where
    ``expected`` is what the step decodes to (the chunk plus the checksums still to strip) and
    ``proven`` says whether a crc32c checked the stored bytes before it."""
    for i, name in enumerate(codecs):
        expected = nbytes + 4 * sum(c == "crc32c" for c in codecs[i + 1 :])
        yield name, expected, i == len(codecs) - 1, "crc32c" in codecs[:i]


def decode_group(group: Any, read: Any) -> None:
    """Run one recipe's byte codecs over a group of staged tasks (:class:`~..tasks.Group` of
    the batches), in batched calls of the read's ``device.codecs``, by whoever the group's
    route names (``group.route``), with the read's settings; ``read.clock.lap(phase)``
    records the time of each."""
    tasks = group.tasks
    recipe = tasks[0].spec.recipe
    device, clock = read.device, read.clock
    xp = device.xp
    for name, expected, last, _proven in _steps(recipe.bytes_codecs, recipe.nbytes):
        if name == "crc32c":
            for t in tasks:
                try:
                    t.data = crc32c.strip(xp, t.data)
                except ValueError as exc:
                    raise t.error(str(exc)) from exc
            continue
        if name.startswith("blosc-"):
            _decode_blosc(group, name[len("blosc-") :], expected, read, last)
            continue
        aside = _on_host_instead(tasks, _check_frames(tasks, name, expected, xp), name, expected, xp)
        batch = [t for t in tasks if id(t) not in aside]
        clock.lap("decode prep")
        into = [t.target for t in batch] if last and any(t.target is not None for t in batch) else None
        try:
            decoded = (
                device.codecs.decode(
                    name,
                    [t.data for t in batch],
                    [expected] * len(batch),
                    into,
                    group.route.nvcomp,
                    group.route.isolated,
                    read.options,
                )
                if batch
                else []
            )
        except DecodeFailure as exc:
            raise batch[exc.index].error(f"{exc} (corrupt chunk)") from exc
        except DecodeTimeout as exc:
            raise batch[0].error(f"{exc} (a batch of {len(batch)} chunks from this one)") from exc
        for t in tasks:
            if id(t) in aside:
                t.data, t.landed = aside[id(t)], False
        for t, d in zip(batch, decoded):
            if len(d) != expected:
                raise t.error(f"{name} stream decoded to {len(d)} bytes, expected {expected}")
            t.data = d
            t.landed = into is not None and t.target is not None
        group.owner = decoded
        clock.lap(f"decode {name}")


def prepares(group: Any) -> bool:
    """Whether :func:`prepare_group` has work for this group: Blosc chunks decoded by the
    batches' decoders (nvCOMP on a GPU)."""
    codecs = group.tasks[0].spec.recipe.bytes_codecs
    if len(codecs) != 1 or not codecs[0].startswith("blosc-"):
        return False
    return group.route.batch_decoders


def prepare_group(group: Any, read: Any) -> None:
    """Start, on the current stream, what a group of staged tasks of ``read`` needs before its
    decode and that can run while the batch before it decodes (:func:`prepares`): the Blosc
    chunks' layout and, on a GPU, their streams packed for nvCOMP with their structure checks
    started; kept on ``group.ready`` for :func:`decode_group`."""
    if not prepares(group):
        return
    device = read.device
    tasks = group.tasks
    cname = tasks[0].spec.recipe.bytes_codecs[0][len("blosc-") :]
    buffer, lay = _blosc_layout(tasks, cname, tasks[0].spec.recipe.nbytes, device.xp)
    group.ready = (buffer, lay, blosc.ready_streams(device, buffer, lay, group.route))


def _blosc_layout(tasks: list[Any], cname: str, expected: int, xp: Any) -> tuple[Any, blosc_format.Layout]:
    """The buffer holding a group's Blosc chunks (on the device of array module ``xp``) and
    their layout (:func:`cupy_xarray.formats.blosc.layout`)."""
    staging = tasks[0].staging
    if staging is not None and all(t.staging is staging for t in tasks):
        buffer = staging
        starts = np.array([t.stage for t in tasks], dtype=np.int64)
    else:
        buffer = xp.concatenate([t.data for t in tasks])
        starts = np.cumsum([0] + [len(t.data) for t in tasks[:-1]]).astype(np.int64)
    lengths = np.array([len(t.data) for t in tasks], dtype=np.int64)

    def read_u32(positions: np.ndarray) -> np.ndarray:
        return le32(to_host(buffer[xp.asarray(positions[:, None] + np.arange(4)[None, :])]))

    try:
        return buffer, blosc_format.layout(read_u32, starts, lengths, expected, cname)
    except blosc_format.BloscLayoutError as exc:
        raise tasks[exc.index].error(str(exc)) from exc


def _decode_blosc(group: Any, cname: str, expected: int, read: Any, last: bool) -> None:
    """Blosc chunks: structure checked on the host, streams decoded in batches, blocks unshuffled."""
    tasks, device, clock = group.tasks, read.device, read.clock
    ready, group.ready = group.ready, None
    if ready is None:
        buffer, lay = _blosc_layout(tasks, cname, expected, device.xp)
        streams = None
    else:
        buffer, lay, streams = ready
    clock.lap("blosc layout")
    try:
        targets = [t.target for t in tasks] if last else None
        if not group.route.batch_decoders:
            threads = read.options.host_decode_threads()
            owners, views = blosc.decode_chunks_on_host(
                [t.data for t in tasks], expected, device, targets, threads
            )
        else:
            boxes = [t.box for t in tasks] if last else None
            owners, views = blosc.decode_chunks(
                buffer, lay, len(tasks), expected, read, group.route, targets, streams, boxes
            )
    except blosc_format.BloscLayoutError as exc:
        raise tasks[exc.index].error(str(exc)) from exc
    except DecodeTimeout as exc:
        raise tasks[0].error(f"{exc} (a batch of {len(tasks)} chunks from this one)") from exc
    for t, v in zip(tasks, views):
        t.data = v
        t.landed = last and (t.target is not None or v is None)  # None: unshuffled into its box
    group.owner = owners


def _on_host_instead(
    tasks: list[Any], problems: dict[int, str], name: str, expected: int, xp: Any
) -> dict[int, Any]:
    """Streams the batched checks refuse get a second look on the host: a chunk of several
    zstd frames or gzip members is valid Zarr (zarr-python reads it) that the batch's one
    stream per chunk does not model; the host's decoder, which checks everything, decodes it
    or the first refusal is raised. Returns the decoded bytes by task (arrays of ``xp``)."""
    done: dict[int, Any] = {}
    for t in tasks:
        problem = problems.get(id(t))
        if problem is None:
            continue
        try:
            out = stream(name).decode_host(to_host(t.data), expected, None)
        except Exception as exc:  # noqa: BLE001 - the batch's own finding is the one to report
            raise t.error(problem) from exc
        if len(out) != expected:
            raise t.error(problem)
        done[id(t)] = xp.asarray(np.ascontiguousarray(out))
    return done


def _check_frames(tasks: list[Any], name: str, expected: int, xp: Any) -> dict[int, str]:
    """Check every stream's header/trailer on the host (one gather, one small copy; ``xp``:
    the array module of the streams' device); what is wrong with each stream that fails, by
    task."""
    staging = tasks[0].staging
    shared = staging is not None and all(t.staging is staging for t in tasks)
    if not shared:
        heads = [to_host(t.data[:32]).tobytes() for t in tasks]
        tails = [to_host(t.data[-4:]).tobytes() for t in tasks]
    else:
        offs = np.array([t.stage for t in tasks], dtype=np.int64)
        lens = np.array([len(t.data) for t in tasks], dtype=np.int64)
        idx_h = offs[:, None] + np.minimum(np.arange(32)[None, :], np.maximum(lens - 1, 0)[:, None])
        idx_t = offs[:, None] + np.maximum(lens[:, None] - 4 + np.arange(4)[None, :], 0)
        both = to_host(staging[xp.asarray(np.concatenate([idx_h, idx_t], axis=1))])
        heads = [both[i, : min(32, lens[i])].tobytes() for i in range(len(tasks))]
        tails = [both[i, 32:].tobytes() for i in range(len(tasks))]
    problems: dict[int, str] = {}
    for t, head, tail in zip(tasks, heads, tails):
        problem = frame_problem(name, head, tail, len(t.data), expected)
        if problem:
            problems[id(t)] = problem
    if not shared:
        offs, walk = np.zeros(1, np.int64), stream(name).walk
        walked = [walk(np, to_host(t.data), offs, np.array([len(t.data)], np.int64)) for t in tasks]
        lengths = None if walked[0] is None else [int(w[0]) for w in walked]
    else:
        lengths = stream(name).walk(xp, staging, offs, lens)
    if lengths is not None:
        for t, n in zip(tasks, lengths):
            problem = length_problem(name, int(n), len(t.data))
            if problem and id(t) not in problems:
                problems[id(t)] = problem
    return problems


def decode_on_host(task: Any, data: np.ndarray, final: np.ndarray | None) -> np.ndarray:
    """Run a chunk's byte codecs over its stored bytes on this thread; the last decoder
    writes into ``final`` where given. Raises ChunkError naming the chunk.

    The host's libraries check every stream's framing as they decode (libzstd its blocks,
    zlib its end marker and trailer, liblz4 its bounds), each into a buffer of the size the
    chunk must have: the engine's own framing checks (:func:`stream_problem`) run only to
    name what a failed decode found.
    """
    recipe = task.spec.recipe
    for name, expected, last, _proven in _steps(recipe.bytes_codecs, recipe.nbytes):
        if name == "crc32c":
            try:
                data = crc32c.strip(np, data)
            except ValueError as exc:
                raise task.error(str(exc)) from exc
            continue
        into = final[:expected] if last and final is not None else np.empty(expected, np.uint8)
        if name.startswith("blosc-"):
            try:
                data = blosc.decode_one_on_host(data, expected, name[len("blosc-") :], into)
            except blosc_format.BloscLayoutError as exc:
                raise task.error(str(exc)) from exc
            continue
        failure: Exception | None = None
        try:
            out = stream(name).decode_host(data, expected, into)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the chunk
            out, failure = None, exc
        if out is None or len(out) != expected:
            problem = stream_problem(name, data, expected)
            if problem:
                raise task.error(problem) from failure
            if failure is not None:
                raise task.error(f"{name} decode failed: {failure} (corrupt chunk)") from failure
            raise task.error(f"{name} stream decoded to {len(out)} bytes, expected {expected}")
        data = out
    return data
