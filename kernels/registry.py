"""Kernel renderers by name: each maps a list of model constants to bundle files.

The DSpark Triton kernels register here; the compiler's kernel stage calls every entry.
"""

from __future__ import annotations

from collections.abc import Callable

RENDERERS: dict[str, Callable[[list], dict[str, bytes]]] = {}
