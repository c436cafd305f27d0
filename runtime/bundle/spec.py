"""What a compiled model is: its segments, its SpeculativeVerify ops and its KV geometry.

Written by the compiler into manifest.json, read back by the runtime. Plain frozen data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

VERIFY_DOMAIN = "ai.dspark"
VERIFY_OP = "SpeculativeVerify"
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
LOGITS = "logits"
LOGITS_INDEX = "logits_index"

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LAYOUTS = ("heads", "tokens")  # SpeculativeVerify's tensor layouts (VerifyOp)


@dataclass(frozen=True)
class VerifyOp:
    """One ai.dspark::SpeculativeVerify(q, k_new, v_new) -> out node.

    layout "heads" (as exported): q is [1, num_heads, T, head_dim], k_new and v_new
    [1, num_kv_heads, T, head_dim], out has q's shape. Layout "tokens" (the compiler's
    verify_layout pass): q/k/v hold the same values token-major in any shape (memory order
    token, head, dim) and out is [1, T, num_heads * head_dim]. The op appends k_new/v_new to
    layer `layer` of the cache and attends each new token over its own sequence's positions
    up to and including itself: all of them (window 0), or the last `window` (a sliding
    window layer: the query at position p sees p-window+1 .. p). A score is scale * q . k,
    soft-capped to softcap * tanh(score / softcap) where softcap > 0 (Gemma 2), before the
    mask and the softmax.
    """

    name: str
    layer: int
    q: str
    k: str
    v: str
    out: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    after_segment: int
    layout: str = "heads"
    window: int = 0
    softcap: float = 0.0  # 0: none

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout {self.layout!r} not in {LAYOUTS}")
        if self.window < 0:
            raise ValueError(f"{self.name}: window {self.window} < 0")

    def first_key(self, position: int) -> int:
        """The first position the query at `position` attends to."""
        return max(0, position - self.window + 1) if self.window else 0


@dataclass(frozen=True)
class Segment:
    index: int
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ModelSpec:
    role: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str
    inputs: tuple[str, ...]  # input_ids and, if used, position_ids and logits_index
    graph_file: str  # the whole rewritten graph (SpeculativeVerify nodes inside)
    weights_file: str  # shared external data of graph_file and every segment
    segments: tuple[Segment, ...]
    verify_ops: tuple[VerifyOp, ...]
    # positions the bundle serves at most: its rotary tables' rows, and the length its
    # attention spans were proven to (dsc compile --max-seq-len); None: older bundles
    max_positions: int | None = None
    # graph_file with its low-bit projections as MatMulInt4, their groups packed beside it
    # (compiler/int4_stage.py); None: none is eligible
    int4_graph_file: str | None = None

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's attention window (0: every earlier position), by layer."""
        return tuple(op.window for op in sorted(self.verify_ops, key=lambda op: op.layer))

    def same_cache(self, other: ModelSpec) -> bool:
        """Whether `other`'s KV cache has this model's layers, heads and dtype."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype) == (
            other.num_layers, other.num_kv_heads, other.head_dim, other.kv_dtype)

    def __post_init__(self) -> None:
        if self.kv_dtype not in _DTYPE_BYTES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} not in {sorted(_DTYPE_BYTES)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.kv_dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        d = dict(d)
        d["inputs"] = tuple(d["inputs"])
        d["segments"] = tuple(
            Segment(**{**s, "inputs": tuple(s["inputs"]), "outputs": tuple(s["outputs"])})
            for s in d["segments"]
        )
        d["verify_ops"] = tuple(VerifyOp(**op) for op in d["verify_ops"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
