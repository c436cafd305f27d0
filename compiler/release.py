"""Memory a finished compile stage freed, handed back to the system.

Python frees a stage's arrays and protos, but glibc's allocator keeps most of the freed
memory for reuse, so the process's RSS stays at the stage's peak: an int4 1.2B main's
compile climbed stage by stage to 4.7x its weights. A collection and malloc_trim(0) after
each stage (compiler/progress.py) hand it back (to 3.3x there). Nothing happens where libc
has no malloc_trim (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release() -> None:
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
