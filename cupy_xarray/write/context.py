"""A Write: the engine's side of one ``to_zarr`` call, what its arrays and dask blocks share.

It is made once per call, in the calling thread: the store's root, the settings in effect
there (the dask blocks written on other threads write with them), the encoders, the file
threads and the report every array's and block's write is counted in.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..options import Options, get_options
from ..runtime.pools import kept_pool
from .chunks import Target, WriteReport, write_array
from .encoders import CPUEncoder, GPUEncoder, Recipe, SharedEncoder


class Write:
    """The engine's side of one ``to_zarr`` call.

    Parameters
    ----------
    root
        The local store's directory.
    overwrite
        Chunks may be there already (an append, a region): the file of a chunk that now holds
        only the fill value is deleted, as zarr-python does.
    write_empty
        ``to_zarr``'s ``write_empty_chunks`` (None: zarr's ``array.write_empty_chunks``).
    options
        The settings (default: those in effect here).
    """

    def __init__(
        self,
        root: Path,
        overwrite: bool = False,
        write_empty: bool | None = None,
        options: Options | None = None,
    ) -> None:
        self.root = Path(root)
        self.overwrite = overwrite
        self.write_empty = write_empty
        self.options = options or get_options()
        threads = self.options.host_decode_threads()
        self.gpu, self.cpu = GPUEncoder(threads, self.options), CPUEncoder(threads)
        self.shared = SharedEncoder(self.gpu, self.cpu, self.options)
        self.pool = kept_pool("write", threads)
        self.report = WriteReport()
        self._lock = threading.Lock()

    def write(self, target: Target, data: Any, origin: tuple[int, ...] | None = None) -> None:
        """Write the chunks of ``target`` that ``data`` covers (from chunk ``origin`` on), from
        where it lies; counted in :attr:`report`."""
        part = write_array(self, target, data, origin)
        with self._lock:
            self.report.add(part)

    def encoder_for(self, on_gpu: bool, recipe: Recipe, chunk_bytes: int, nbytes: int) -> Any:
        """The encoder of ``nbytes`` of data, in chunks of ``chunk_bytes``. Data on the host:
        CPU threads; on the GPU (``on_gpu``): nvCOMP and CPU threads sharing the batches,
        nvCOMP alone, or CPU threads, the first that supports the chain (CPU threads where the
        chain's share of them, the ``write_cpu_share_*`` options, is 1, and for a compressed
        write of fewer than ``write_gpu_min_bytes``: faster than one nvCOMP call)."""
        small = recipe.compressed and nbytes < self.options.write_gpu_min_bytes
        if on_gpu and self.shared.share(recipe) < 1 and not small:
            for choice in (self.shared, self.gpu):
                if choice.supports(recipe, chunk_bytes):
                    return choice
        return self.cpu
