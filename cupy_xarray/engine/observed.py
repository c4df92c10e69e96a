"""What this process's reads observed: each processor's pace per stream kind, and the I/O's.

The route of a group that either processor may decode (:meth:`.schedule.Scheduler.routes`)
is chosen from three times: the GPU's (the batch's reads, then one nvCOMP call: a fixed cost
set by its longest stream, plus its bytes at the GPU's rate), the CPU threads' (the bytes at
the pool's rate) and the time of a split where both work. Before a read has shown anything,
the figures are the stream kind's :class:`~.decoders.Rates` (measured on an H200 host, or on
this machine by ``warm_up(measure=True)``). Every read then corrects them with what it saw:
the seconds nvCOMP's calls took against what the figures said, the pool's bytes per second,
the bytes per second of the batches' reads. So a card, core count or codec that runs slower
or faster than the figures is routed by its own pace from its next reads on.

The first observation of each figure in a process is not learned from: a process's first
nvCOMP call loads its kernels and sets up the decoder process's memory (two seconds on an H100
where a warm call takes 70 ms), its first reads open kvikio, its first CPU jobs start threads.
After that, one read moves a figure at most threefold, so that one read slowed by something
else (another process, a page cache miss) cannot send the next reads the wrong way.

The CPU threads' pace is kept twice: alone (a host route) and beside the batches (the back of
a shared queue, where kvikio's reads and the decoder process take cores and memory bandwidth
from them); each route's time is figured with the pace it will run at.

The figures miss what no stage measures (contention, scatter, hand-offs). So each route's whole
time is learned as well (:func:`saw_outcome`): the read's wall time over what the model said,
per stream kind, route and read size (within a factor of four). A route that ran slower than
its figures is charged that much the next time, so a split that does not pay is not chosen
again, and the route that ran faster takes the reads of that size. A route is only learned
where it runs, so what it is charged would never change once another route takes its reads;
with the ``route_forget`` setting each read routed elsewhere forgets a share of it
(:func:`passed_over`, :func:`outcome`), less the more reads the factor was learned from, so
that one slow read (another process on the GPU, a page cache miss) keeps a route from a size
for a few reads, not for good. What is forgotten only lowers the charge: a route that runs
slow again is charged from the factor it had learned, at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

#: weight of the newest observation (the rest: what earlier reads saw)
NEW = 0.5
#: the most one observation moves a figure (a factor)
STEP = 3.0


@dataclass
class Pace:
    """One device's pace for one stream kind.

    Attributes
    ----------
    gpu_k
        Observed nvCOMP call seconds over the figures' prediction.
    pool
        Decoded bytes per second of the CPU threads together, alone (0: not seen yet).
    pool_shared
        The same, beside the batches (the back of a shared queue).
    io
        Stored bytes per second of a batch's reads (0: not seen yet).
    gpu_seen, pool_seen, pool_shared_seen, io_seen
        How many observations made each figure (-1: none yet, the first one is a warm-up).
    """

    gpu_k: float = 1.0
    pool: float = 0.0
    pool_shared: float = 0.0
    io: float = 0.0
    gpu_seen: int = -1
    pool_seen: int = -1
    pool_shared_seen: int = -1
    io_seen: int = -1

    def warm(self, route: str) -> bool:
        """Whether what ``route`` runs on has run in this process before (its start-up costs
        are behind it): nvCOMP for the batches and a split, the CPU threads for the host route."""
        if route == "host":
            return max(self.pool_seen, self.pool_shared_seen) >= 0
        return self.gpu_seen >= 0


_lock = threading.Lock()
_paces: dict[tuple[str, str], Pace] = {}
#: (device, kind, route, size class) -> [wall time over the model's time, observations,
#: reads routed elsewhere since]
_outcomes: dict[tuple[str, str, str, int], list] = {}
#: the bounds of a route's factor: its figures are off by no more than this
OUTCOME_LOW, OUTCOME_HIGH = 0.25, 4.0


def pace(device_key: str, kind: str) -> Pace:
    """A copy of the pace seen for ``kind`` on ``device_key`` (new figures where none)."""
    with _lock:
        p = _paces.get((device_key, kind))
        return Pace(**p.__dict__) if p is not None else Pace()


def _mix(old: float, new: float, seen: int) -> float:
    if seen <= 0 or old <= 0:
        return new
    return (1 - NEW) * old + NEW * min(old * STEP, max(old / STEP, new))


def _learn(
    device_key: str, kind: str, name: str, value: float, low: float = 0.0, high: float = float("inf")
) -> None:
    """Mix ``value`` into the pace's figure ``name`` (``gpu_k``, ``pool`` or ``io``), within
    ``low`` and ``high``; the figure's first observation only counts as its warm-up."""
    seen = f"{name.removesuffix('_k')}_seen"
    with _lock:
        p = _paces.setdefault((device_key, kind), Pace())
        count = getattr(p, seen)
        if count >= 0:
            setattr(p, name, min(high, max(low, _mix(getattr(p, name), value, count))))
        setattr(p, seen, count + 1)


def saw_gpu(device_key: str, kind: str, seconds: float, predicted: float) -> None:
    """An nvCOMP call took ``seconds`` where the figures said ``predicted``."""
    if seconds > 0 and predicted > 0:
        _learn(device_key, kind, "gpu_k", seconds / predicted, 0.05, 20.0)


def saw_pool(device_key: str, kind: str, nbytes: int, seconds: float, shared: bool = False) -> None:
    """The CPU threads decoded ``nbytes`` in ``seconds`` of wall time, every thread busy
    (``shared``: beside the batches)."""
    if seconds > 0 and nbytes > 0:
        _learn(device_key, kind, "pool_shared" if shared else "pool", nbytes / seconds)


def saw_io(device_key: str, kind: str, nbytes: int, seconds: float) -> None:
    """A batch's reads brought ``nbytes`` stored bytes in ``seconds``."""
    if seconds > 0 and nbytes > 0:
        _learn(device_key, kind, "io", nbytes / seconds)


def size_class(nbytes: int) -> int:
    """Reads within a factor of four of each other share their routes' factors."""
    return max(0, int(nbytes)).bit_length() // 2


def outcome(device_key: str, kind: str, route: str, nbytes: int, forget: float = 0.0) -> float | None:
    """What reads of ``nbytes`` by ``route`` took over what the model said (None: none seen).

    ``forget`` (the ``route_forget`` setting): the share of the factor's distance from 1 (as
    a power) forgotten for each read routed elsewhere since the route last ran at that size,
    divided by the reads it was learned from."""
    with _lock:
        seen = _outcomes.get((device_key, kind, route, size_class(nbytes)))
        if not seen:
            return None
        factor, count, passed = seen
    if forget > 0 and passed and count:
        factor **= max(0.0, 1.0 - forget / count) ** passed
    return factor


def saw_outcome(
    device_key: str, kind: str, route: str, nbytes: int, seconds: float, predicted: float
) -> None:
    """A read of ``nbytes`` by ``route`` took ``seconds`` where the model said ``predicted``
    (call it only for a read whose route was warm: :meth:`Pace.warm`)."""
    if seconds <= 0 or predicted <= 0:
        return
    ratio = min(OUTCOME_HIGH, max(OUTCOME_LOW, seconds / predicted))
    with _lock:
        seen = _outcomes.setdefault((device_key, kind, route, size_class(nbytes)), [1.0, 0, 0])
        seen[0] = ratio if seen[1] == 0 else _mix(seen[0], ratio, seen[1])
        seen[1] += 1
        seen[2] = 0


def passed_over(device_key: str, kind: str, route: str, nbytes: int) -> None:
    """A read of ``nbytes`` went to another route than ``route``: one more read since
    ``route`` last ran at that size (what :func:`outcome` forgets by)."""
    with _lock:
        seen = _outcomes.get((device_key, kind, route, size_class(nbytes)))
        if seen:
            seen[2] += 1


def forget() -> None:
    """Drop everything seen (tests)."""
    with _lock:
        _paces.clear()
        _outcomes.clear()
