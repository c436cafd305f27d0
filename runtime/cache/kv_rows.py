"""KV cache rows in numpy, bit for bit as the CPU op stores them (kernels/cpu_kv.c).

    float32   the values
    float16   each value rounded to nearest, ties to even (numpy's astype)
    int8      scale = max|x| / 127 per row; q = clip(rint(x / scale), -127, 127) (0 where
              the scale is 0), stored as dim bytes and then the scale's 4; read as q * scale
Every step is one IEEE float32 operation, so numpy, the C op and the reference's ONNX ops
(compiler/kv_rounding.py) round alike. What attention reads of a row is `load(store(x))`:
`round_rows`.
"""

from __future__ import annotations

import numpy as np

_127 = np.float32(127)


def _int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / _127
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def store(x: np.ndarray, dtype: str) -> np.ndarray:
    """Rows [..., dim] of float32 as the cache holds them: float32, float16, or int8 rows
    as bytes [..., dim + 4]."""
    if dtype == "int8":
        q, scale = _int8(x)
        return np.concatenate([q.view(np.uint8), scale.view(np.uint8)], axis=-1)
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float16 if dtype == "float16" else np.float32)


def load(rows: np.ndarray, dtype: str) -> np.ndarray:
    """What `store` wrote, as float32 [..., dim]."""
    if dtype == "int8":
        rows = np.ascontiguousarray(rows)
        q = rows[..., :-4].view(np.int8).astype(np.float32)
        return q * rows[..., -4:].view(np.float32)
    return rows.astype(np.float32)


def round_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """The values attention reads after `x` was cached as `dtype`."""
    if dtype == "int8":
        q, scale = _int8(x)
        return q.astype(np.float32) * scale
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past 65504: infinity, as a cast gives
            return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x, np.float32)
