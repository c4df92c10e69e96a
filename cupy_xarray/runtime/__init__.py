"""What reading and writing both run on, knowing no Zarr::

buffers.py    pinned host memory, each thread's reusable buffers and CUDA streams
notes.py      what a read or write had to do differently, filed to its report
pools.py      the process's thread pools, kept, one registry
nvcomp.py     nvCOMP's batched C API (ctypes), bounded waits
checksums.py  the checksums nvCOMP leaves out, on the GPU (kernels/checksums.cu)
kernels/      CUDA sources, compiled once per process
"""
