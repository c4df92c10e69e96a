"""What a dask compute will ask of the engine's arrays, seen where dask's local scheduler starts it.

dask runs one task per thread and each task asks its array for one block, so the read-ahead
(:mod:`.readahead`) would otherwise guess from the order the blocks are asked in which come
next, and a guess starts small. dask's local schedulers (threads, sync) show their callbacks
the graph they are about to run, optimized (a selection fused into each block's read), and the
order they run it in. :class:`ComputePlan`, registered once among dask's callbacks, finds there
each engine array's block reads and hands them, in that order, to the array's read-ahead for
the length of the compute; the read-ahead then reads the first block asked for with the blocks
that follow it, as many as ``read_ahead_bytes`` allows, in one read.

A compute that holds no engine array costs a look at its data keys. Computes on
dask.distributed's workers see no plan; their reads read ahead as before.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

log = logging.getLogger("cupy_xarray")

_INSTALLED: list[Any] = []


def install(source_type: type) -> None:
    """Register the plan among dask's callbacks, once (again where it was lost), for arrays
    whose blocks ``source_type`` (the engine's dask chunk source) reads; nothing where dask
    has no task spec."""
    if _INSTALLED:
        from dask.callbacks import Callback

        callback = _INSTALLED[0]
        if callback is not None and callback._callback not in Callback.active:
            # (dask's callbacks are swapped out while a compute runs; two computes in
            # threads that end in another order than they started can leave them out)
            callback.register()
        return
    try:
        from dask.callbacks import Callback

        plan = ComputePlan(source_type)
    except ImportError:  # pragma: no cover - a dask without the task spec: no plans
        _INSTALLED.append(None)
        return
    callback = Callback(start_state=plan.start_state, finish=plan.finish)
    callback.register()
    _INSTALLED.append(callback)


class ComputePlan:
    """Tells each engine array which blocks a compute will read (dask's callbacks
    ``start_state`` and ``finish``).

    Parameters
    ----------
    source_type
        The type of the objects that dask's graphs hold for engine arrays, with ``plans`` (whether
        its reads would follow a plan), ``expect`` and ``unexpect`` methods.
    """

    def __init__(self, source_type: type) -> None:
        from dask._task_spec import DataNode, Task, TaskRef
        from dask.array.core import getter, getter_inline, getter_nofancy

        self.source_type = source_type
        self.spec = DataNode, Task, TaskRef
        self.getters = getter, getter_inline, getter_nofancy

    def start_state(self, dsk: Any, state: dict) -> None:
        try:
            self._start(dsk, state)
        except Exception:  # a plan only speeds the compute up: never fail it
            log.debug("no read-ahead plan for this compute", exc_info=True)
            state.pop("cupy_xarray_plans", None)

    def _start(self, dsk: Any, state: dict) -> None:
        kind = self.source_type
        sources = {k: v for k, v in state["cache"].items() if isinstance(v, kind) and v.plans()}
        if not sources:
            return
        rank = {k: i for i, k in enumerate(reversed(state["ready"]))}  # (ready pops its end)
        found: dict[Any, list] = {}
        for key, node in dsk.items():
            if key in sources:
                continue
            for ref, sel in self.block_reads(node):
                if ref in sources:
                    found.setdefault(ref, []).append((rank.get(key, len(rank)), sel))
        token = uuid.uuid4().hex
        told = state["cupy_xarray_plans"] = []
        for ref, reads in found.items():
            reads.sort(key=lambda r: r[0])
            if sources[ref].expect([sel for _, sel in reads], token):
                told.append((sources[ref], token))

    def finish(self, dsk: Any, state: dict, errored: bool) -> None:
        for source, token in state.pop("cupy_xarray_plans", ()):
            try:
                source.unexpect(token)
            except Exception:  # (as above)
                log.debug("a read-ahead plan did not end cleanly", exc_info=True)

    def block_reads(self, node: Any, names: dict | None = None, depth: int = 0):
        """``(source key, selection)`` of each block read in a task of dask's graph, fused
        tasks' inner graphs included (``names``: what an inner graph's input keys stand for)."""
        DataNode, Task, TaskRef = self.spec
        if not isinstance(node, Task) or depth > 16:
            return
        names = names or {}

        def value(arg: Any) -> Any:  # an argument as the outer graph names it
            if isinstance(arg, TaskRef):
                arg = names.get(arg.key, arg)
            return arg.value if isinstance(arg, DataNode) else arg

        if node.func in self.getters:
            if len(node.args) >= 2:
                source, sel = value(node.args[0]), value(node.args[1])
                if isinstance(source, TaskRef) and type(sel) is tuple:
                    yield source.key, sel
            return
        if node.has_subgraph():
            inner, _, inkeys, *outer = node.args
            inner_names = {
                k: names.get(a.key, a) if isinstance(a, TaskRef) else a for k, a in zip(inkeys, outer)
            }
            for task in inner.values():
                yield from self.block_reads(task, inner_names, depth + 1)
            return
        for arg in node.args:
            if isinstance(arg, Task):
                yield from self.block_reads(arg, names, depth + 1)
