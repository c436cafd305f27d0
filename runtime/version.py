"""Versions written into and checked against every bundle."""

from __future__ import annotations

__version__ = "0.1.0"

# Bump when the bundle layout or manifest schema changes incompatibly.
BUNDLE_FORMAT_VERSION = 4  # 2: kernels/index.json with cubins per arch; 3: attention windows
# (a version-2 bundle of a sliding-window model attends every position: refused); 4: low-bit
# projections packed for MatMulInt4 at compile time (a version-3 bundle has none)
