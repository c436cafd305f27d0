"""Memory a finished compile stage freed, handed back to the system.

Python frees a stage's arrays and protos, but glibc's allocator keeps most of the freed
memory for reuse, so the process's RSS stays at the stage's peak and a compile climbs
stage by stage. malloc_trim(0) after each stage (compiler/progress.py) hands it back, in
about a millisecond. No garbage collection: arrays and protos go when their last reference
does, and a full collection costs a small model's compile a large share of its time.
Nothing happens where libc has no malloc_trim (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release() -> None:
    trim = _trim()
    if trim is not None:
        trim(0)
