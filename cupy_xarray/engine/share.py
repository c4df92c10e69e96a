"""Work shared as the read goes: one queue of chunks that both processors take from.

Where the scheduler splits a group between the processors (:meth:`.schedule.Scheduler.split`),
its chunks wait in one :class:`WorkQueue`. The batches (kvikio, then nvCOMP) take the planned
share from its front; the CPU threads take from its back, a chunk (or ``job_bytes``) at a
time, once the first batch's reads have landed (so that they do not slow them down). The plan
is a prediction; the queue corrects it as the read goes: when the batches have taken their
share and the CPU threads are still behind, the batches take more, but only where more is
left than the CPU threads decode, at the pace they show in this read, in the time one nvCOMP
call costs at the least.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

from .tasks import ChunkTask


def _work(t: ChunkTask) -> int:
    """A task's work: its decoded bytes."""
    return t.spec.recipe.nbytes


class WorkQueue:
    """Tasks that the batches take from the front and CPU threads from the back.

    Parameters
    ----------
    tasks
        The tasks, in the order they are stored (the batches read them in that order).
    front_bytes
        Decoded bytes the batches take before the CPU threads have shown their pace (None:
        half of the work).
    fixed_s
        The least seconds one more batch costs (an nvCOMP call): once the planned share is
        taken, the batches take more only where the CPU threads would need longer than this
        for what is left.
    max_ops
        The most tasks one batch takes.
    """

    def __init__(
        self,
        tasks: list[ChunkTask],
        front_bytes: int | None = None,
        fixed_s: float = 0.0,
        max_ops: int = 4096,
    ) -> None:
        self._tasks = deque(tasks)
        self._lock = threading.Lock()
        self.left = sum(_work(t) for t in tasks)
        self.planned = self.left // 2 if front_bytes is None else front_bytes
        self.fixed_s = fixed_s
        self.max_ops = max_ops
        self.closed = False
        #: tasks taken by each end, per recipe (``recipe.key``)
        self.front: Counter = Counter()
        self.back: Counter = Counter()
        self.taken_back: list[ChunkTask] = []  # what the CPU threads took (the progress bar)
        self.batches = 0
        self.back_started = 0.0  # when the CPU threads took their first job
        self.back_done = 0  # decoded bytes the CPU threads finished
        self.back_ended = 0.0  # when a CPU thread last found the queue empty

    def __len__(self) -> int:
        return len(self._tasks)

    def back_rate(self) -> float:
        """Decoded bytes per second the CPU threads finished in this read so far (0: none)."""
        if not self.back_started or not self.back_done:
            return 0.0
        return self.back_done / max(time.perf_counter() - self.back_started, 1e-6)

    def take_front(self, budget: int, cost=_work) -> list[ChunkTask]:
        """A batch: tasks from the front whose ``cost`` sums to at most ``budget`` (one at
        least): first what is left of the planned share; after it, all that is left, where
        the CPU threads have shown that they would need longer than ``fixed_s`` for it. Empty
        otherwise, or once the queue is closed."""
        with self._lock:
            if self.closed or not self._tasks:
                return []
            want = self.planned
            if want <= 0:
                rate = self.back_rate()
                if not self.back_started or (rate and self.left <= rate * self.fixed_s):
                    return []
                want = self.left
            got: list[ChunkTask] = []
            held = work = 0
            while self._tasks and len(got) < self.max_ops:
                t = self._tasks[0]
                if got and (held + cost(t) > budget or work + _work(t) > want):
                    break
                got.append(self._tasks.popleft())
                held += cost(t)
                work += _work(t)
                self.left -= _work(t)
                self.front[t.spec.recipe.key] += 1
            self.planned = max(0, self.planned - work)
            self.batches += 1
            return got

    def take_back(self, job_bytes: int, done: int = 0) -> list[ChunkTask]:
        """A CPU thread's job: tasks from the back up to ``job_bytes`` of work (one at
        least); empty once the queue is empty or closed. ``done``: the work of the thread's
        last job, now finished."""
        with self._lock:
            self.back_done += done
            if not self.back_started:
                self.back_started = time.perf_counter()
            got: list[ChunkTask] = []
            held = 0
            while not self.closed and self._tasks and (not got or held + _work(self._tasks[-1]) <= job_bytes):
                t = self._tasks.pop()
                got.append(t)
                held += _work(t)
                self.left -= _work(t)
                self.back[t.spec.recipe.key] += 1
            self.taken_back += got
            if not got:
                self.back_ended = time.perf_counter()
            return got

    def close(self) -> None:
        """Stop both ends taking (a task failed: the read ends with its error)."""
        with self._lock:
            self.closed = True

    def count(self, decisions: list[Any]) -> None:
        """Write what each end took into the read's shared decisions."""
        for d in decisions:
            if d.shared:
                d.gpu, d.host = self.front[d.key], self.back[d.key]
