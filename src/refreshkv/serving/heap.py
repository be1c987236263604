"""Memory that finished requests' state held, given back to the system.

glibc keeps what a process frees in its heap: blocks under its mmap threshold, which rises to the largest block freed
so far (about 0.9 MB, one layer's C_p keys of a SmolLM2 request at K = 1024), are never returned, so a server's RSS
stayed at the peak of its requests' C_p after they finished (docs/results/vllm-load/). `malloc_trim` returns the
heap's free pages; it runs once no request holds plugin state, and every `TRIM_EVERY` requests released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

TRIM_EVERY = 16  # requests released between two trims while others still run (a trim walks the whole heap)


@functools.cache
def _malloc_trim():  # type: ignore[no-untyped-def]
    """glibc's `malloc_trim`, or None under another C library."""
    name = ctypes.util.find_library("c")
    return None if name is None else getattr(ctypes.CDLL(name), "malloc_trim", None)


class FreedHeap:
    def __init__(self) -> None:
        self.released = 0  # requests released since the last trim
        self.holding = 0  # requests holding state after the last update
        self.trims = 0

    def after_update(self, released: int, holding: int) -> None:
        """`released` requests' state just went and `holding` requests still have some (a parked request's state may
        also have gone between updates): trim when the last one went, or every `TRIM_EVERY` releases."""
        self.released += released
        emptied = holding == 0 and (self.holding > 0 or self.released > 0)
        self.holding = holding
        if emptied or self.released >= TRIM_EVERY:
            trim = _malloc_trim()
            if trim is not None:
                trim(0)
                self.trims += 1
            self.released = 0


HEAP = FreedHeap()  # one per worker process
