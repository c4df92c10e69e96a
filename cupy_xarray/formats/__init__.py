"""Byte formats, both directions, as pure functions: what a store's bytes are, whoever
reads or writes them (the read engine and the writer both use them; they import neither).

    blosc.py      Blosc 1 chunks: header, block table, checks, prefixes, shuffles
    sharding.py   a shard's layout and index; the sharding_indexed codec read from metadata
    crc32c.py     zarr's crc32c codec: the checksum after the bytes it covers
    words.py      little- and big-endian 32-bit words out of byte arrays
"""
