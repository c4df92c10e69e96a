"""What a read works on: one :class:`ChunkTask` per chunk piece, grouped for decoding.

A task says where a piece's stored bytes are (file, offset, size, or the fetched bytes of a
remote store) and, in one :class:`Placement`, where its decoded bytes go in the output. The
state a group of chunks shares while it is decoded (what was started ahead for it, the
buffers its decoded bytes live in) belongs to its :class:`Group`, not to its first task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ChunkError
from .decoders.base import Box
from .io import ReadOp
from .plan import ChunkPiece, byte_span
from .spec import ArraySpec


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk piece's bytes go in its output; ``kind`` is one of:

    ``"scatter"``
        Decoded into a buffer of the whole chunk, then indexed into the output.
    ``"direct"``
        The stored bytes are one run of the output: read straight there. ``span``:
        (file offset, bytes, output byte offset).
    ``"copy"``
        The decoded bytes hold one run of the output: one copy. ``span``: (offset in the
        decoded chunk, bytes, output byte offset).
    ``"target"``
        As ``"copy"`` for a whole chunk, which the last codec decodes straight into
        ``view`` (output bytes) with no copy.
    ``"box"``
        A whole chunk that is a box of the output (a tile): the last codec writes into
        ``box`` (:class:`~.decoders.base.Box`).
    """

    kind: str = "scatter"
    span: tuple[int, int, int] | None = None
    view: Any = field(default=None, repr=False)
    box: Box | None = field(default=None, repr=False)


SCATTER = Placement()


@dataclass(eq=False, slots=True)
class ChunkTask:
    """One chunk piece of a read, located: its stored bytes, and where they go.

    Parameters
    ----------
    out
        Index of the read's output the piece belongs to.
    spec, piece
        The array and the piece of one of its chunks (chunk and output selections).
    path, key
        The file (or remote object) holding the bytes, and the chunk's name in errors.
    offset, nbytes
        Where the stored bytes start in ``path`` (or in ``blob``) and how many there are.
    blob
        Bytes fetched from a remote store (``offset`` is into it).
    ident
        The file's identity when it was located (:func:`.io.file_ident`): the file read
        must be that one.
    """

    out: int
    spec: ArraySpec
    piece: ChunkPiece
    path: str
    key: str
    offset: int
    nbytes: int
    blob: Any = field(default=None, repr=False)
    ident: tuple[int, int] | None = None
    placement: Placement = SCATTER
    #: the stored, then decoded, bytes while the task is read and decoded
    data: Any = field(default=None, repr=False)
    staging: Any = field(default=None, repr=False)  # the batch's staging buffer
    stage: int = 0  # byte offset of ``data`` in ``staging``
    landed: bool = False  # decoded straight into the output: nothing left to place
    span: tuple[int, int] | None = None  # host route: the bytes of the chunk the piece needs

    @property
    def direct(self) -> tuple[int, int, int] | None:
        """(file offset, nbytes, output byte offset) of a piece read straight into the output."""
        return self.placement.span if self.placement.kind == "direct" else None

    @property
    def copy(self) -> tuple[int, int, int] | None:
        """(decoded offset, nbytes, output byte offset) of a piece copied as one run."""
        return self.placement.span if self.placement.kind in ("copy", "target") else None

    @property
    def target(self) -> Any:
        """The output bytes the last codec decodes the whole chunk into, or None."""
        return self.placement.view if self.placement.kind == "target" else None

    @property
    def box(self) -> Box | None:
        """The box of the output the last codec decodes the whole chunk into, or None."""
        return self.placement.box if self.placement.kind == "box" else None

    def stored_span(self) -> tuple[int, int]:
        """The bytes of an uncompressed chunk the piece needs (:func:`.plan.byte_span`;
        the whole chunk for a compressed one), computed once."""
        if self.span is None:
            self.span = byte_span(self.spec.recipe, self.piece.chunk_sel)
        return self.span

    def read_op(self, offset: int, nbytes: int, dest: Any = None) -> ReadOp:
        """A read of ``nbytes`` of this piece's stored bytes at ``offset`` (of its file, or of
        its fetched bytes) into ``dest``, checked against the file it was located in."""
        return ReadOp(
            self.path,
            offset,
            nbytes,
            dest,
            self.spec.name,
            self.key,
            self.blob,
            self.spec.containment,
            self.ident,
        )

    def error(self, msg: str) -> ChunkError:
        """A ChunkError naming this task's array, chunk and file."""
        return ChunkError(msg, array=self.spec.name, chunk=self.key, path=self.path)

    def release(self) -> None:
        """Drop the buffers this task holds (device memory goes back to the pool)."""
        self.data = self.staging = None
        if self.placement.kind in ("target", "box"):
            self.placement = SCATTER


@dataclass(eq=False)
class Group:
    """Staged tasks of one recipe in one batch, decoded together.

    ``route``: the recipe's :class:`~.route.Route` (who decodes the group's streams, and
    whether in the decoder process); ``ready``: what was started for it ahead of its decode;
    ``owner``: keeps the buffers of its decoded bytes alive until they are placed.
    """

    tasks: list[ChunkTask]
    route: Any
    ready: Any = None
    owner: Any = None

    @property
    def recipe(self) -> Any:
        return self.tasks[0].spec.recipe

    def release(self) -> None:
        self.ready = self.owner = None
        for t in self.tasks:
            t.release()
