"""Byte formats, both directions, as pure functions: what a store's bytes are, whoever
reads or writes them (the read engine and the writer both use them; they import neither).

    blosc.py   Blosc 1 chunks: header, block table, checks, prefixes, shuffles
    words.py   little- and big-endian 32-bit words out of byte arrays
"""
