"""Read ahead of dask: the boxes an array's next tasks will ask for, read in one engine read.

dask runs one task per thread, and each task asks its array for one box (a chunk, or the few
of a dask chunk), so its reads stay too small for the batched GPU route. Where an array's
boxes are asked for in order, :class:`ReadAhead` reads the next ones with the box asked for,
in one read whose window doubles with each box asked for in order (as an operating system
reads a file ahead), up to ``read_ahead_bytes``; the tasks that ask next take their box from
it. A box asked for out of order starts the window again at one box, so a selection read once
reads nothing more. A box read ahead and not asked for within ``read_ahead_linger`` seconds is
dropped. Where a window's read fails, each of its tasks reads its own box (its error, if any,
names its own chunk).

Where the compute's graph showed which boxes its tasks will ask for (:mod:`.dask_plan`), the
read-ahead needs no guess: :meth:`ReadAhead.expect` hands it those boxes in the order dask runs
them, and a box asked for among them is read with the next of them not read yet, up to
``read_ahead_bytes`` in one window; boxes read for it wait for their tasks until the compute
ends, and the boxes of no plan are read as above.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: set while a dask task reads its block (:class:`~.chunked.EngineChunkSource`)
_in_dask_block: contextvars.ContextVar[bool] = contextvars.ContextVar("cupy_xarray_dask_block", default=False)


@contextlib.contextmanager
def dask_block():
    """Mark the reads inside the block as a dask task's read of its block."""
    token = _in_dask_block.set(True)
    try:
        yield
    finally:
        _in_dask_block.reset(token)


def in_dask_block() -> bool:
    """Whether this read is a dask task's read of its block."""
    return _in_dask_block.get()


def wanted(mode: str, on_gpu: Callable[[], bool], dask: bool = False) -> bool:
    """Whether a read reads ahead, by the ``read_ahead`` setting: ``"on"``: every read of an
    array's boxes in order; ``"auto"``: a dask task's read of its block on a GPU (where dask's
    one-block reads stay too small for the batched route; ``on_gpu()`` is asked only then);
    ``"off"``: none. ``dask``: the reads are a dask compute's (without being in its task)."""
    if mode == "on":
        return True
    return mode == "auto" and (dask or in_dask_block()) and on_gpu()


#: the most boxes one window holds
MAX_BOXES = 4096
#: how much a window grows with each box asked for in order
GROWTH = 2


class _Slot:
    """A box being read ahead: set once its window's read ends."""

    __slots__ = ("done", "failed", "value", "when")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.failed = False
        self.when = 0.0


class ReadAhead:
    """The boxes of one array read ahead of the tasks that ask for them.

    Parameters
    ----------
    shape
        The array's shape.
    itemsize
        Bytes per element.
    read
        Reads a list of selections (tuples of slices) in one read; returns their arrays.
    hands_out
        ``read`` takes a second argument, ``ready(i, array)``, with which it may hand out
        each selection's array as soon as it is read, before the read ends: the task that
        asked for it takes it then.
    """

    def __init__(
        self, shape: tuple[int, ...], itemsize: int, read: Callable[..., list[Any]], hands_out: bool = False
    ) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.itemsize = itemsize
        self._read = read
        self._hands_out = hands_out
        self._lock = threading.Lock()
        self._extent: tuple[int, ...] | None = None  # a whole box's extent
        self._grid: tuple[int, ...] = ()
        self._held: dict[int, _Slot] = {}  # flat box index -> its slot
        self._served: set[int] = set()  # boxes read in this pass over the array (none read twice)
        self._window = 1
        self._last: int | None = None  # the box last asked for
        self._timer: threading.Timer | None = None
        self._party: list[tuple] | None = None  # (flat, key, slot) of asks gathering into a window
        self._reading = 0  # windows being read now
        self._early: list[tuple[list[int], list[int]]] = []  # boxes asked before the grid was known
        self._plans: dict[Any, _Plan] = {}  # the boxes computes will ask for, by compute
        #: boxes read ahead that a task took, and that were dropped unasked (tests, reports)
        self.hits = 0
        self.dropped = 0

    def get(
        self, key: tuple, budget: Callable[[], int], linger: float, wait_s: float = 0.0
    ) -> tuple[bool, Any]:
        """``(True, array)`` for the box ``key`` (a tuple of slices), read now with the next
        boxes or taken from an earlier window; ``(False, None)`` where ``key`` is no box of
        the array's grid (the caller reads it). ``budget()``: the bytes a window may hold,
        asked where a window would grow. ``wait_s``: where another window of the array is
        being read, how long a box not read yet waits for the asks of other threads, so
        that they are read in one window (dask starts a task on each of its threads at once)."""
        if self._plans:
            hk = _plan_key(key, self.shape)
            planned = None if hk is None else self._get_planned(hk[0], key, budget)
            if planned is not None:
                return True, planned[0]
        box = _box(key, self.shape)
        if box is None:
            return False, None
        lead = False
        with self._lock:
            flat = self._flat(*box)
            if flat is None:
                return False, None
            self._drop_expired(linger)
            slot = self._held.pop(flat, None)
            if slot is None and flat in self._served:  # asked again: a new pass over the array
                self._served.clear()
                self._last = None
            last, self._last = self._last, flat
            if slot is None:
                self._served.add(flat)
                if self._party is not None:  # a window is gathering its boxes: join it
                    slot = _Slot()
                    self._party.append((flat, key, slot))
                elif self._reading and wait_s > 0:
                    self._party = [(flat, key, None)]
                    lead = True
                else:
                    window = self._plan([(flat, key, None)], last, budget)
        if lead:
            window = self._lead(wait_s, last, budget)
        if slot is not None:
            slot.done.wait()
            if not slot.failed:
                with self._lock:
                    self.hits += 1
                return True, slot.value
            return True, self._read([key])[0]
        return True, self._read_window(window, linger)

    def _lead(self, wait_s: float, last: int | None, budget: Callable[[], int]) -> list[tuple]:
        """The window of the party this ask opened, once the others had ``wait_s`` to join;
        where planning it fails, its other asks read their own boxes (none waits for ever)."""
        party: list[tuple] = []
        try:
            time.sleep(wait_s)
            with self._lock:
                party, self._party = self._party or [], None
                return self._plan(party, last, budget)
        except BaseException:
            with self._lock:
                party, self._party = party or self._party or [], None
            for _, _, slot in party[1:]:
                slot.failed = True
                slot.done.set()
            raise

    def _plan(self, asked: list[tuple], last: int | None, budget: Callable[[], int]) -> list[tuple]:
        """The window (``(key, slot)`` pairs) of the boxes ``asked`` (``(flat, key, slot)``:
        the first one's asker reads it, the others wait on their slots), with the next boxes
        in the order they are asked in where there is one; its slots registered, and counted
        as being read until :meth:`_read_window` ends. ``last``: the box asked for before the
        first. Under the lock."""
        flats = [j for j, _, _ in asked]
        lo, hi = min(flats), max(flats)
        step = 0  # the order boxes are asked in: 1 onwards, -1 backwards (as dask may run them)
        if len(flats) > 1 and hi - lo <= 2 * len(flats) + 16:
            step = -1 if last is not None and hi < last else 1
        elif last is not None and 0 < abs(flats[0] - last) <= 2 * self._window + 16:
            step = 1 if flats[0] > last else -1
        if step:
            held = sum(1 for s in self._held.values() if s.done.is_set())
            cap = max(1, min(MAX_BOXES, budget() // max(1, self._box_bytes()) - held))
            self._window = min(cap, max(self._window * GROWTH, GROWTH * len(flats)))
        else:
            self._window = 1
        window = [(key, slot) for _, key, slot in asked]
        total = math.prod(self._grid)
        j = hi + 1 if step > 0 else lo - 1
        scan = 4 * self._window + 64  # (past boxes read already, a few windows on)
        while step and len(window) < self._window and 0 <= j < total and scan > 0:
            scan -= 1
            if j not in self._held and j not in self._served:
                slot = self._held[j] = _Slot()
                self._served.add(j)
                window.append((self._key(j), slot))
            j += step
        self._reading += 1
        return window

    def _read_window(self, window: list[tuple], linger: float, drops: bool = True) -> Any:
        keys = [key for key, _ in window]

        def ready(i: int, value: Any) -> None:  # box i is read: its task may take it now
            if i > 0:
                _fill(window[i][1], value)

        try:
            values = self._read(keys, ready) if self._hands_out and len(window) > 1 else self._read(keys)
        except BaseException as exc:
            for _, slot in window[1:]:
                if not slot.done.is_set():  # (a box handed out early is read)
                    slot.failed = True
                    slot.done.set()
            if len(window) == 1 or not isinstance(exc, Exception):
                raise
            return self._read(keys[:1])[0]  # its own box alone: its own error, if any
        finally:
            with self._lock:
                self._reading -= 1
        for (_, slot), value in zip(window[1:], values[1:]):
            _fill(slot, value)
        if len(window) > 1 and drops:
            with self._lock:
                self._schedule_drop(linger)
        return values[0]

    def expect(self, keys: list[tuple], token: Any) -> None:
        """The boxes (tuples of ints and slices) the tasks of the compute ``token`` will ask
        for, in the order they run; what is no box of the array is left out."""
        boxes = []
        for key in keys:
            hk = _plan_key(key, self.shape)
            if hk is not None:
                boxes.append((hk[0], key, hk[1] * self.itemsize))
        if boxes:
            with self._lock:
                self._plans[token] = _Plan(boxes)

    def unexpect(self, token: Any) -> None:
        """The compute ``token`` ended: what was read for it and not taken is dropped."""
        with self._lock:
            plan = self._plans.pop(token, None)
            if plan is not None:
                self.dropped += sum(1 for s in plan.slots.values() if s.done.is_set())
                plan.slots.clear()

    def _get_planned(self, hk: tuple, key: tuple, budget: Callable[[], int]) -> tuple[Any] | None:
        """``(array,)`` for a box a plan holds (taken from its window, or read with the next
        boxes of the plan), else None."""
        with self._lock:
            plan = next((p for p in self._plans.values() if hk in p.left), None)
            if plan is None:
                return None
            slot = plan.take(hk)
            if slot is None:
                window = plan.window(hk, key, budget)
                self._reading += 1
        if slot is not None:
            slot.done.wait()
            if not slot.failed:
                with self._lock:
                    self.hits += 1
                return (slot.value,)
            return (self._read([key])[0],)
        return (self._read_window(window, linger=0.0, drops=False),)

    def _schedule_drop(self, linger: float) -> None:
        """Under the lock: drop boxes nobody asked for once they lingered (one timer at a time)."""

        def drop() -> None:
            with self._lock:
                self._timer = None
                self._drop_expired(linger)
                if self._held:
                    self._schedule_drop(linger)

        if self._timer is None:
            self._timer = threading.Timer(linger + 0.05, drop)
            self._timer.daemon = True
            self._timer.start()

    def _drop_expired(self, linger: float) -> None:
        """Under the lock: forget read boxes older than ``linger`` seconds."""
        now = time.monotonic()
        old = [j for j, s in self._held.items() if s.done.is_set() and now - s.when > linger]
        for j in old:
            del self._held[j]
        self.dropped += len(old)

    def held(self) -> int:
        """Boxes read ahead and not yet taken."""
        with self._lock:
            return len(self._held)

    def _box_bytes(self) -> int:
        return math.prod(self._extent or (1,)) * self.itemsize

    def _flat(self, starts: list[int], stops: list[int]) -> int | None:
        """The flat index of box ``starts:stops`` on the grid of boxes; None where it is no
        box of it. The grid is set by the first box that shows a whole box's extent (one that
        does not end at the array's end on an axis where it does not start at 0: dask's last
        boxes are cut short), and set again by such a box of another extent. Under the lock."""
        ext = self._extent
        if ext is None or not _on_grid(starts, stops, ext, self.shape):
            extents = [b - a for a, b in zip(starts, stops)]
            whole = all(b < n or a == 0 for a, b, n in zip(starts, stops, self.shape))
            if not whole or not _on_grid(starts, stops, extents, self.shape):
                if ext is None and len(self._early) < MAX_BOXES:  # its asker reads it: not again
                    self._early.append((starts, stops))
                return None
            if ext is not None:
                self._held.clear()  # another grid: what was read ahead is for the old one
                self._served.clear()
                self._window, self._last = 1, -1
            ext = self._extent = tuple(extents)
            self._grid = tuple(-(-n // e) for n, e in zip(self.shape, ext))
            early, self._early = self._early, []
            self._served.update(self._index(a, ext) for a, b in early if _on_grid(a, b, ext, self.shape))
        return self._index(starts, ext)

    def _index(self, starts: list[int], ext: tuple[int, ...]) -> int:
        index = 0
        for a, e, g in zip(starts, ext, self._grid):
            index = index * g + a // e
        return index

    def _key(self, flat: int) -> tuple:
        ext = self._extent or ()
        idx = []
        for g in reversed(self._grid):
            idx.append(flat % g)
            flat //= g
        return tuple(slice(i * e, min((i + 1) * e, n)) for i, e, n in zip(reversed(idx), ext, self.shape))


def _fill(slot: _Slot, value: Any) -> None:
    """Give a box read ahead its array, where it has none yet (a box handed out early keeps
    it; a read started again hands it out twice)."""
    if not slot.done.is_set():
        slot.value, slot.when = value, time.monotonic()
        slot.done.set()


class _Plan:
    """The boxes one compute will ask for, in order, and the slots of those read for it.

    Parameters
    ----------
    boxes
        ``(hkey, key, nbytes)`` of each box its tasks will ask for, in the order they run; a
        box asked for by several tasks appears as often.
    """

    def __init__(self, boxes: list[tuple]) -> None:
        self.boxes = boxes
        self.left: dict[tuple, int] = {}  # asks to come, by box
        self.at: dict[tuple, int] = {}  # its first place in the order
        for i, (hk, _, _) in enumerate(boxes):
            self.left[hk] = self.left.get(hk, 0) + 1
            self.at.setdefault(hk, i)
        self.slots: dict[tuple, _Slot] = {}  # boxes read (or being read) for asks to come
        self.first = 0  # no box before this place is left to read

    def take(self, hk: tuple) -> _Slot | None:
        """The slot of box ``hk`` where it was read (or is being read) for this ask, which is
        counted; None where its asker reads it."""
        left = self.left[hk] - 1
        if left:
            self.left[hk] = left
        else:
            del self.left[hk]
        slot = self.slots.get(hk)
        if slot is not None and not left:
            del self.slots[hk]
        return slot

    def window(self, hk: tuple, key: tuple, budget: Callable[[], int]) -> list[tuple]:
        """The window (``(key, slot)`` pairs) of an ask of box ``hk`` that is not read yet: it,
        then the boxes of the plan after it that no window holds, then those before it, up to
        ``budget()`` bytes with the boxes read and not taken; their slots registered."""
        held = sum(self.boxes[self.at[h]][2] for h in self.slots)
        room = budget() - held - self.boxes[self.at[hk]][2]
        window = [(key, None)]  # (asked for again later, it is read again then)
        start = self.at[hk] + 1
        for i in itertools.chain(range(start, len(self.boxes)), range(self.first, start - 1)):
            h, k, nbytes = self.boxes[i]
            if h in self.slots or h not in self.left or h == hk:
                continue
            if nbytes > room or len(window) >= MAX_BOXES:
                break
            room -= nbytes
            self.slots[h] = _Slot()
            window.append((k, self.slots[h]))
        while self.first < len(self.boxes) and self._read_or_taken(self.boxes[self.first][0]):
            self.first += 1
        return window

    def _read_or_taken(self, hk: tuple) -> bool:
        return hk in self.slots or hk not in self.left


def _plan_key(key: tuple, shape: tuple[int, ...]) -> tuple[tuple, int] | None:
    """A hashable form of ``key`` (ints and slices of step 1, one per axis, as dask's block
    reads are) and the elements it selects; None for any other key."""
    if type(key) is not tuple or len(key) != len(shape):
        return None
    parts: list = []
    size = 1
    for k, n in zip(key, shape):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step != 1 or stop <= start:
                return None
            parts.append((start, stop))
            size *= stop - start
        elif isinstance(k, numbers.Integral) and not isinstance(k, bool) and -n <= k < n:
            parts.append(int(k) % n)
        else:
            return None
    return tuple(parts), size


def cover(keys: list[tuple], shape: tuple[int, ...]) -> tuple[tuple, list[tuple]] | None:
    """Where the boxes ``keys`` tile one box exactly (each place of it in one of them), that
    box and each key's place in it; else None (a key that is no box, gaps, overlaps)."""
    if len(keys) < 2:
        return None
    boxes = [_box(k, shape) for k in keys]
    if any(b is None for b in boxes):
        return None
    ndim = len(shape)
    lo = [min(b[0][d] for b in boxes) for d in range(ndim)]
    hi = [max(b[1][d] for b in boxes) for d in range(ndim)]
    if sum(math.prod(b - a for a, b in zip(*box)) for box in boxes) != math.prod(
        b - a for a, b in zip(lo, hi)
    ):
        return None
    cuts = [sorted({a for b in boxes for a in (b[0][d], b[1][d])}) for d in range(ndim)]
    if math.prod(len(c) - 1 for c in cuts) > 4 * len(boxes) + 64:
        return None  # (boxes of many sizes: not worth the count)
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    count = np.zeros([len(c) - 1 for c in cuts], np.int32)
    for starts, stops in boxes:
        count[tuple(slice(at[d][starts[d]], at[d][stops[d]]) for d in range(ndim))] += 1
    if not (count == 1).all():
        return None
    whole = tuple(slice(a, b) for a, b in zip(lo, hi))
    places = [tuple(slice(a - o, b - o) for a, b, o in zip(*box, lo)) for box in boxes]
    return whole, places


def _box(key: tuple, shape: tuple[int, ...]) -> tuple[list[int], list[int]] | None:
    """The starts and stops of ``key`` where it is a box (a slice of step 1 on every axis,
    inside the array), else None."""
    if len(key) != len(shape) or not all(isinstance(s, slice) and s.step in (None, 1) for s in key):
        return None
    starts = [s.start or 0 for s in key]
    stops = [n if s.stop is None else s.stop for s, n in zip(key, shape)]
    if any(b <= a or a < 0 or b > n for a, b, n in zip(starts, stops, shape)):
        return None
    return starts, stops


def _on_grid(starts, stops, extent, shape) -> bool:
    """Whether ``starts:stops`` is one box of the grid of ``extent`` boxes over ``shape``."""
    return all(a % e == 0 and b == min(a + e, n) for a, b, e, n in zip(starts, stops, extent, shape))
