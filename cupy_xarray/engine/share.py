"""Work shared as the read goes: one queue of chunks that both processors take from.

A GPU read's compressed chunks that either processor may decode go to one :class:`WorkQueue`.
The batches (kvikio, then nvCOMP) take from its front, in groups large enough to fill the GPU;
the CPU threads take from its back, a chunk (or ``job_bytes``) at a time, until the two ends
meet. No prediction decides who decodes what: a processor that runs slower on this card, core
count or codec simply takes less. The one figure used, ``seed_bytes``, is what CPU threads
decode in the time one nvCOMP call takes at the least: the batches stop taking once less than
that is left (the CPU threads finish it sooner), and a read smaller than that never starts a
batch at all (a one-chunk selection).
"""

from __future__ import annotations

import threading
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
    seed_bytes
        The batches take nothing once fewer decoded bytes than this are left.
    max_ops
        The most tasks one batch takes.
    """

    def __init__(self, tasks: list[ChunkTask], seed_bytes: int = 0, max_ops: int = 4096) -> None:
        self._tasks = deque(tasks)
        self._lock = threading.Lock()
        self.seed_bytes = seed_bytes
        self.max_ops = max_ops
        self.left = sum(_work(t) for t in tasks)
        self.closed = False
        #: tasks taken by each end, per recipe (``id(recipe)``)
        self.front: Counter = Counter()
        self.back: Counter = Counter()
        self.taken_back: list[ChunkTask] = []  # what the CPU threads took (the progress bar)
        self.batches = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def take_front(self, budget: int, cost=_work) -> list[ChunkTask]:
        """A batch: tasks from the front whose ``cost`` sums to at most ``budget`` (one at
        least) and to at most half of the work left (at least ``seed_bytes``): the CPU
        threads go on taking from the back while it is read and decoded. Empty once less
        than ``seed_bytes`` is left, or the queue is closed."""
        with self._lock:
            if self.closed or not self._tasks or self.left < max(self.seed_bytes, 1):
                return []
            want = min(budget, max(self.seed_bytes, self.left // 2))
            got: list[ChunkTask] = []
            held = 0
            while self._tasks and len(got) < self.max_ops:
                t = self._tasks[0]
                if got and held + cost(t) > want:
                    break
                got.append(self._tasks.popleft())
                held += cost(t)
                self.left -= _work(t)
                self.front[id(t.spec.recipe)] += 1
            self.batches += 1
            return got

    def take_back(self, job_bytes: int) -> list[ChunkTask]:
        """A CPU thread's job: tasks from the back up to ``job_bytes`` of work (one at
        least); empty once the queue is empty or closed."""
        with self._lock:
            got: list[ChunkTask] = []
            held = 0
            while not self.closed and self._tasks and (not got or held + _work(self._tasks[-1]) <= job_bytes):
                t = self._tasks.pop()
                got.append(t)
                held += _work(t)
                self.left -= _work(t)
                self.back[id(t.spec.recipe)] += 1
            self.taken_back += got
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
