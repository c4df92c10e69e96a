"""The decoder process: nvCOMP decodes streams it cannot check in a process of its own.

nvCOMP's zstd, deflate and gzip decoders "can only operate on valid input data": a damaged
stream can fault (the CUDA context is lost) or hang. So streams no check has proven are
decoded by a second process over memory this process owns and shares with it (CUDA IPC on
a GPU; a shared file on the host, which CI uses to prove the same machinery)::

    arena.py    memory both processes see, one per batch: the streams in, the decoded bytes out
    worker.py   the decoder process: maps an arena, decodes its streams, answers statuses and sizes
    client.py   start, a spare kept warm, batches in flight, the watchdog, kill and restart,
                arenas kept a short while for the next batch

A stream that faults or hangs costs only that process: the watchdog kills it, the spare takes
over, and the caller decodes the batch again on CPU threads (which name a damaged chunk).
"""

from .client import DecoderLost, decode_batch, decoder_processes, release_arenas, start_wait

__all__ = ["DecoderLost", "decode_batch", "decoder_processes", "release_arenas", "start_wait"]
