"""Weights read in pieces on every core (runtime/model/file_read.py): the bytes each part
names, whatever the pieces' borders, and a file that ends early named."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.model import file_read


def test_parts_read_whole_across_piece_borders(tmp_path, monkeypatch):
    monkeypatch.setattr(file_read, "PIECE", 4096)
    data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    parts = [(path, 0, 10_000), (path, 10_000, 1), (path, 12_345, 37_655), (path, 7, 0)]
    got = file_read.read_parts(parts)
    for (_, offset, n), array in zip(parts, got):
        assert array.dtype == np.uint8 and np.array_equal(array, data[offset:offset + n])


def test_a_short_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(file_read, "PIECE", 4096)
    path = tmp_path / "int4.bin"
    np.zeros(10_000, np.uint8).tofile(path)
    with pytest.raises(EOFError, match="int4.bin ends at byte 10000, before the 12000"):
        file_read.read_parts([(path, 2_000, 10_000)])
