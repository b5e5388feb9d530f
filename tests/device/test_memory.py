"""keras_mp.device.memory: what it reads, and the freed heap it hands back."""

import pytest


def test_release_free_heap_hands_freed_pages_back():
    """glibc keeps freed heap resident; keras_mp hands it back after a new
    train function's first call (keras_mp.device.memory)."""
    import ctypes
    import ctypes.util

    from keras_mp.device import memory

    if not ctypes.util.find_library("c") or memory.process_rss() is None:
        pytest.skip("needs Linux and a C library")
    if not memory.release_free_heap():
        pytest.skip("this C library has no malloc_trim")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 MiB in small blocks (below the mmap threshold: they live in the heap).
    blocks = [libc.malloc(4096) for _ in range(16384)]
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    held = memory.process_rss()
    for b in blocks[:-1]:  # the last stays: the free space below it is not the heap's top
        libc.free(b)
    freed = memory.process_rss()
    fn = memory.released_after_first_call(lambda: None)
    fn()
    after = memory.process_rss()
    libc.free(blocks[-1])
    # free() alone kept the pages; the first call's release gave them back.
    assert held - freed < 16 * 2**20 and held - after > 48 * 2**20, (held, freed, after)
