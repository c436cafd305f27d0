"""Versions written into and checked against every bundle."""

from __future__ import annotations

__version__ = "0.1.0"

# Bump when the bundle layout or manifest schema changes incompatibly.
BUNDLE_FORMAT_VERSION = 2  # 2: kernels/index.json with cubins per arch
