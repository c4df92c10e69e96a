"""Place: where each piece's bytes go in its output, and putting them there, on either device.

Planning gives every located task one :class:`~.tasks.Placement` (read straight into the
output, one copy, decoded straight into the output, decoded into its box, or scattered).
Placing then follows it: decoded groups of the batches (:func:`place_group`), chunks the
CPU threads decoded into host memory (:func:`place_from_host`, one function whatever the
device: queued copies to a GPU, NumPy on the CPU), fetched uncompressed tiles
(:func:`place_fetched`), and small GPU reads assembled in pinned host memory first
(:func:`host_twins`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.buffers import pinned_buffer, thread_stream
from .decoders import Box, decodes_into_boxes, writes_into_output
from .plan import contiguous_span
from .scatter import Boxes, box_copies, chunk_box, copy_bytes, place_chunk, scatter
from .tasks import ChunkTask, Group, Placement


def bytes_of(out: Any) -> Any:
    """The bytes of a C-contiguous output, as one flat uint8 view."""
    return out.reshape(-1).view(np.uint8)


# -- planning ---------------------------------------------------------------------------------


def plan_direct(task: ChunkTask, out_shape: tuple[int, ...]) -> None:
    """A piece whose bytes are one run of both its chunk and the output: read straight there
    (uncompressed), or copied as one run once decoded."""
    recipe = task.spec.recipe
    c_order = (
        recipe.transpose is None and not recipe.needs_swap and (recipe.order == "C" or len(recipe.shape) <= 1)
    )
    if not c_order:
        return
    src = contiguous_span(recipe.shape, task.piece.chunk_sel)
    dst = contiguous_span(out_shape, task.piece.out_sel)
    if src is None or dst is None or src[1] != dst[1]:
        return
    size = recipe.dtype.itemsize
    if recipe.is_raw:
        task.placement = Placement("direct", (task.offset + src[0] * size, src[1] * size, dst[0] * size))
    else:
        task.placement = Placement("copy", (src[0] * size, src[1] * size, dst[0] * size))


def plan_target(task: ChunkTask, out_bytes: Any) -> None:
    """Let the last codec decode a whole chunk straight into the output, skipping the copy:
    only where its decoded bytes are one run of the output, aligned for nvCOMP."""
    if task.copy is None or not writes_into_output(task.spec.recipe.bytes_codecs):
        return
    src_off, n, dst = task.copy
    if src_off == 0 and n == task.spec.recipe.nbytes and dst % 16 == 0:
        whole = dst == 0 and n == len(out_bytes)  # (a GPU slice costs a call per chunk)
        task.placement = Placement("target", task.copy, view=out_bytes if whole else out_bytes[dst : dst + n])


def plan_box(task: ChunkTask, out: Any, out_bytes: Any) -> None:
    """Let the last codec decode a whole chunk that is a box of the output (a tile) straight
    into it, where the chain can (:func:`.decoders.decodes_into_boxes`)."""
    if task.placement.kind != "scatter" or not decodes_into_boxes(task.spec.recipe.bytes_codecs):
        return
    geometry = chunk_box(task.spec.recipe, task.piece, out.shape)
    if geometry is not None:
        task.placement = Placement("box", box=Box(out_bytes, *geometry))


def check_size(task: ChunkTask) -> None:
    """A stored chunk's size, where it proves something: not empty; exact when uncompressed."""
    recipe = task.spec.recipe
    if recipe.bytes_codecs:
        if task.nbytes == 0:
            raise task.error("chunk is empty (0 bytes)")
        return
    if task.nbytes != recipe.nbytes:
        raise task.error(
            f"chunk is {task.nbytes} bytes, expected {recipe.nbytes} "
            "for an uncompressed chunk (truncated or corrupt)"
        )


def prepare(tasks: list[ChunkTask], out: Any) -> None:
    """Check the located tasks' sizes and plan where their bytes go in ``out`` (the boxes of
    tiles are planned once the tasks have their routes: :func:`plan_boxes`)."""
    out_bytes = bytes_of(out)
    for t in tasks:
        check_size(t)
        plan_direct(t, out.shape)
        plan_target(t, out_bytes)


def take_located(read: Any, i: int, found: list[ChunkTask], missing: list, shape: tuple = ()) -> None:
    """Request ``i`` of ``read`` located: ``found`` its tasks, ``missing`` the pieces whose
    chunks do not exist. Its output is made where it is not yet (``shape``; filled with the
    fill value at once where any chunk is missing), else the missing pieces' regions are
    filled; then where each task's bytes go is planned (:func:`prepare`)."""
    spec, device = read.requests[i][0], read.device
    if missing:
        read.filled.add(i)
    if read.outs[i] is None:
        read.outs[i] = read.new_output(i, shape, fill=bool(missing))
    else:
        for p in missing:
            scatter(device.xp, read.outs[i], p.out_sel, spec.fill_value)
    read.report.chunks += len(found)
    prepare(found, read.outs[i])


def plan_boxes(batched: list[ChunkTask], outs: list) -> None:
    """:func:`plan_box` for the tasks read with the batches (the host route's own jobs place
    their chunks themselves)."""
    flat: dict[int, Any] = {}
    for t in batched:
        if t.out not in flat:
            flat[t.out] = bytes_of(outs[t.out])
        plan_box(t, outs[t.out], flat[t.out])


# -- placing ----------------------------------------------------------------------------------


def place_group(group: Group, read: Any, geometry: dict) -> None:
    """Place a decoded group of the batches into the read's outputs: a copy per run, the
    tiles' boxes in one kernel launch per output, the rest scattered; ``geometry``: per
    output, the box copies its pieces take, kept across the read's batches
    (:class:`.scatter.Boxes`)."""
    outs, device = read.outs, read.device
    xp = device.xp
    boxes: dict[int, Boxes] = {}
    for t in group.tasks:
        if t.landed:
            continue
        recipe = t.spec.recipe
        if len(t.data) < recipe.nbytes:
            raise t.error(f"chunk holds {len(t.data)} bytes, expected {recipe.nbytes}")
        if t.copy is not None:
            src_off, n, dst = t.copy
            copy_bytes(outs[t.out], dst, t.data, src_off, n, xp)
            continue
        placer = boxes.get(t.out)
        if placer is None:
            placer = boxes[t.out] = Boxes(outs[t.out], geometry.setdefault(t.out, {}))
        if not placer.add(t.data, recipe, t.piece):
            place_chunk(xp, outs[t.out], t.data, recipe, t.piece)
    for placer in boxes.values():
        placer.run(xp)


def queue_copies(
    task: ChunkTask, data: np.ndarray, out: Any, cupy: Any, stream: Any, options: Any, boxes=None
) -> None:
    """Queue on ``stream`` what places a piece from host memory (``data``: its decoded chunk,
    or for a direct piece its run) into a GPU output: one copy for a run, 2-D copies for a box
    of rows (:func:`.scatter.box_copies`, within the read's ``options``), else a scratch chunk
    and the scatter kernel.
    ``boxes``: where given (``data`` in page-locked memory), a tile's box is added there for
    one kernel launch that reads it in place. The caller waits for the stream before
    ``data`` is reused."""
    rt = cupy.cuda.runtime
    h2d = rt.memcpyHostToDevice
    src = data.ctypes.data
    recipe = task.spec.recipe
    if task.direct is not None:
        _, n, dst = task.direct
        rt.memcpyAsync(out.data.ptr + dst, src, n, h2d, stream.ptr)
    elif task.target is not None:
        rt.memcpyAsync(task.target.data.ptr, src, recipe.nbytes, h2d, stream.ptr)
    elif task.copy is not None:
        s, k, d = task.copy
        rt.memcpyAsync(out.data.ptr + d, src + s, k, h2d, stream.ptr)
    elif boxes is not None and boxes.add(data, recipe, task.piece):
        pass  # copied by the caller's kernel launch, from where it is
    elif (
        copies := box_copies(recipe, task.piece, out.shape, options.box_max_copies, options.box_min_row)
    ) is not None:
        for s, d, width, height, spitch, dpitch in copies:
            rt.memcpy2DAsync(out.data.ptr + d, dpitch, src + s, spitch, width, height, h2d, stream.ptr)
    else:
        with stream:
            scratch = cupy.empty(recipe.nbytes, dtype=cupy.uint8)
            lo, hi = task.stored_span()  # only the bytes read
            if hi > lo:
                rt.memcpyAsync(scratch.data.ptr + lo, src + lo, hi - lo, h2d, stream.ptr)
            place_chunk(cupy, out, scratch, recipe, task.piece)


def place_from_host(task: ChunkTask, data: np.ndarray, out: Any, device: Any, options: Any) -> None:
    """Place a piece decoded (or read) into host memory by a CPU thread: on a GPU, through this
    thread's stream (:func:`queue_copies`, with the read's ``options``), waited for before
    ``data`` is reused; on the CPU, one copy or a scatter."""
    if device.host_memory:
        if task.copy is not None:
            src, n, dst = task.copy
            copy_bytes(out, dst, data, src, n, np)
        else:
            place_chunk(np, out, data, task.spec.recipe, task.piece)
        return
    stream = thread_stream(device.xp)
    try:
        queue_copies(task, data, out, device.xp, stream, options)
    finally:
        stream.synchronize()  # the host buffers are reused by this thread's next job, an error's way too


def place_fetched(tasks: list[ChunkTask], outs: list[Any], device: Any, options: Any, blob_bytes) -> None:
    """Copy fetched uncompressed chunks into their GPU outputs from the calling thread, every
    copy queued before one wait; the boxes of pieces in page-locked memory all with one kernel
    launch, which reads them where they landed. ``blob_bytes(task, offset, size)``: a task's
    fetched bytes; ``options``: the read's settings.

    A pool job per chunk, each waiting for its own copies, cost more than the copies (1 GiB
    of 4 MiB tiles over loopback HTTP on an H200: 5.3 GB/s; 2-D copies queued here: 6.5; one
    kernel: 7.4, against 8.9 for the fetches alone)."""
    cupy = device.xp
    stream = thread_stream(cupy)
    boxes: dict[int, Boxes] = {}  # per output: the boxes of page-locked pieces, one kernel
    try:
        for task in tasks:
            out = outs[task.out]
            at, size = (
                (task.direct[0], task.direct[1]) if task.direct is not None else (task.offset, task.nbytes)
            )
            data = np.ascontiguousarray(blob_bytes(task, at, size))
            n = task.spec.recipe.nbytes
            if task.direct is None and len(data) < n:
                raise task.error(f"chunk holds {len(data)} bytes, expected {n}")
            placer = None
            if task.spec.source.lands_pinned(options):  # page-locked: the kernel may read it in place
                placer = boxes.get(task.out)
                if placer is None:
                    placer = boxes[task.out] = Boxes(out)
            queue_copies(task, data, out, cupy, stream, options, placer)
        with stream:
            for placer in boxes.values():
                placer.run(cupy)
    finally:
        stream.synchronize()  # the fetched bytes are released once this returns, an error's way too


# -- small GPU reads assembled on the host ----------------------------------------------------


def assembles(on_host: list[ChunkTask]) -> bool:
    """Whether assembling a small GPU read in a pinned twin saves copies: not for one piece
    read straight into the output, which its job reads into the thread's own pinned buffer
    and copies once (no twin to allocate and copy from)."""
    return len(on_host) > 1 or on_host[0].direct is None


def host_twins(read: Any, on_host: list[ChunkTask], batches: list) -> list | None:
    """Pinned host twins of a small GPU read's outputs (the ``host_assembly_bytes`` option),
    where the host route's jobs assemble it; None for other reads. The tasks' straight-into-
    the-output targets are planned again, on the twins."""
    outs = read.outs
    if read.device.host_memory or batches or not on_host or not assembles(on_host):
        return None
    used = {t.out for t in on_host}
    if sum(outs[i].nbytes for i in used) > read.options.host_assembly_bytes:
        return None
    twins: list[Any] = [None] * len(outs)
    for i in used:
        out, spec = outs[i], read.requests[i][0]
        twin = pinned_buffer(out.nbytes)[: out.nbytes].view(out.dtype).reshape(out.shape)
        if i in read.filled:
            np.copyto(twin, spec.fill_value, casting="unsafe")
        twins[i] = twin
    for t in on_host:
        if t.placement.kind == "target":
            t.placement = Placement("copy", t.copy)
        plan_target(t, bytes_of(twins[t.out]))
    return twins


def copy_twins(twins: list, read: Any) -> None:
    """Copy each assembled twin into the read's output on the GPU; returns once the copies are
    done (the twins' pinned memory goes back to the pool)."""
    xp = read.device.xp
    rt = xp.cuda.runtime
    stream = xp.cuda.get_current_stream()
    for twin, out in zip(twins, read.outs):
        if twin is not None and out.nbytes:
            rt.memcpyAsync(out.data.ptr, twin.ctypes.data, out.nbytes, rt.memcpyHostToDevice, stream.ptr)
    stream.synchronize()
