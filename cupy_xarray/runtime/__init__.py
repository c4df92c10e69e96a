"""What reading and writing both run on, knowing no Zarr.

buffers.py   pinned host memory, each thread's reusable buffers and CUDA streams
notes.py     what a read or write had to do differently, filed to its report
"""
