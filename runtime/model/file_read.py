"""Weights read from a bundle's files into this process's memory, fast.

A plain read() into fresh memory faults its pages in one 4 KiB page at a time inside the
kernel's copy, even where glibc asked for huge pages (dsrun's hugetlb tunable): each piece
here is written to first (its faults then take huge pages) and read into after, and the
pieces go to one thread per core (read() releases the GIL). The figures:
docs/experiments.md, "Figures behind the source's choices".
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PIECE = 4 << 20  # bytes a thread reads at once (whole huge pages)


def read_parts(parts: list[tuple[Path, int, int]]) -> list[np.ndarray]:
    """Each (path, offset, bytes) as a fresh uint8 array; a file that ends early raises
    EOFError naming it."""
    out = [np.empty(n, np.uint8) for _, _, n in parts]
    pieces = [(path, offset, array, lo) for (path, offset, n), array in zip(parts, out)
              for lo in range(0, n, PIECE)]
    if len(pieces) <= 1:
        for piece in pieces:
            _read_piece(*piece)
        return out
    with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1)) as pool:
        for done in pool.map(lambda p: _read_piece(*p), pieces):
            del done
    return out


def _read_piece(path: Path, offset: int, array: np.ndarray, lo: int) -> None:
    hi = min(len(array), lo + PIECE)
    array[lo:hi] = 0  # fault the pages in first (huge pages), then read into them
    view = memoryview(array)[lo:hi]
    with open(path, "rb", buffering=0) as f:
        f.seek(offset + lo)
        got = 0
        while got < hi - lo:
            n = f.readinto(view[got:])
            if not n:
                raise EOFError(f"{path} ends at byte {offset + lo + got}, before the "
                               f"{offset + len(array)} its weights need")
            got += n
