"""Numeric probes of the original (optimized) model.

Some facts are easiest to read off the running model rather than its graph: the exact
shapes of q/k/v, what an integer tensor *means* (the batch size? each token's position?),
whether attention is causal. A probe runs the model at a few (batch, past, new) shapes with
extra tensors exposed as outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from dspark.compiler.contract import ATTENTION_MASK, NUMPY_TYPES, InputContract, past_name
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, POSITION_IDS
from dspark.runtime.errors import ModelInputError
from dspark.runtime.model.sessions import make_session


@dataclass(frozen=True)
class ProbeShape:
    batch: int
    past: int
    new: int


# Batch 1, as the runtime always runs (a flattened batch is one row of T tokens; some exports,
# e.g. dynamo's RotaryEmbedding, only run at batch 1). Past, new and their sums all differ, so
# a value that moves with them is told apart from a constant.
PROBE_SHAPES = (ProbeShape(1, 5, 3), ProbeShape(1, 7, 4), ProbeShape(1, 9, 5))


def feeds(contract: InputContract, shape: ProbeShape, ids: np.ndarray,
          only: set[str] | None = None) -> dict[str, np.ndarray]:
    """Inputs for the original model: `ids` [batch, new] after `past` random cached tokens.
    With `only`, just those inputs, and the cache as zeros (for graphs that read its shape)."""
    rng = np.random.default_rng(shape.past)
    kv = NUMPY_TYPES[contract.kv_dtype]
    out = {INPUT_IDS: ids.astype(NUMPY_TYPES.get(contract.input_ids_dtype, np.int64))}
    if contract.has_attention_mask:
        out[ATTENTION_MASK] = np.ones((shape.batch, shape.past + shape.new), np.int64)
    if contract.has_position_ids:
        pos = shape.past + np.arange(shape.new, dtype=np.int64)
        out[POSITION_IDS] = np.broadcast_to(pos, (shape.batch, shape.new)).copy()
    for i in range(contract.num_layers):
        dims = (shape.batch, contract.num_kv_heads, contract.cache_rows(i, shape.past),
                contract.head_dim)
        for kind in ("key", "value"):
            name = past_name(i, kind)
            if only is None:
                out[name] = rng.standard_normal(dims).astype(kv)
            elif name in only:
                out[name] = np.zeros(dims, kv)
    return out if only is None else {k: v for k, v in out.items() if k in only}


_QUIET = ort.RunOptions()
_QUIET.log_severity_level = 4  # a failing run is reported once, as the compile's error line


class ProbeRunError(ModelInputError):
    """onnxruntime failed to run the original at a probe's shape; `reason` is its message."""

    def __init__(self, path: Path, shape: ProbeShape, reason: str):
        super().__init__(f"{path}: onnxruntime cannot run it ({shape.past} cached tokens, "
                         f"{shape.new} new): {reason}")
        self.reason = reason


def _first_line(e: Exception) -> str:
    """onnxruntime's message without its source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split("Status Message: ", 1)[-1]


class Prober:
    """The original model in onnxruntime with chosen intermediate tensors exposed."""

    def __init__(self, model_path: Path, contract: InputContract, expose: dict[str, int],
                 vocab_size: int):
        model = onnx.load(str(model_path), load_external_data=False)
        present = {o.name for o in model.graph.output}
        for name, elem_type in sorted(expose.items()):
            if name not in present:
                model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
        path = model_path.with_name(model_path.stem + ".probe.onnx")
        onnx.save(model, str(path))
        self.session = make_session(path, level="none", prepack=False)
        self.contract = contract
        self.vocab_size = vocab_size

    def run(self, names: list[str], shape: ProbeShape, ids: np.ndarray | None = None
            ) -> dict[str, np.ndarray]:
        if ids is None:
            rng = np.random.default_rng(shape.new)
            ids = rng.integers(0, min(self.vocab_size, 1000), (shape.batch, shape.new))
        try:
            out = self.session.run(names, feeds(self.contract, shape, ids), _QUIET)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
            raise ProbeRunError(self.contract.path, shape, _first_line(e)) from None
        return dict(zip(names, out))

    def run_all(self, names: list[str]) -> list[dict[str, np.ndarray]]:
        return [self.run(names, s) for s in PROBE_SHAPES]

    def check_causal(self) -> None:
        """Changing token j must not change the logits of tokens before j."""
        shape = ProbeShape(1, 2, 6)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, min(self.vocab_size, 1000), (1, shape.new))
        changed = ids.copy()
        changed[0, 3] = (changed[0, 3] + 1) % min(self.vocab_size, 1000)
        a = self.run([LOGITS], shape, ids)[LOGITS]
        b = self.run([LOGITS], shape, changed)[LOGITS]
        diff = float(np.abs(a[:, :3].astype(np.float64) - b[:, :3]).max())
        if diff > 1e-4 * max(1.0, float(np.abs(a).max())):
            raise ModelInputError(
                f"{self.contract.path}: not a causal LM: changing token 3 changed the logits of "
                f"tokens 0-2 by {diff:.3g} (encoder or bidirectional attention?)"
            )
