"""The input contract: a decoder-only causal LM with KV-cache I/O as optimum/HF export it.

    inputs   input_ids, [attention_mask], [position_ids], past_key_values.{i}.key|value
    outputs  logits, present.{i}.key|value
Checked on the graph's I/O alone (no weights loaded), so a wrong file fails in milliseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, POSITION_IDS
from dspark.runtime.errors import ModelInputError

ATTENTION_MASK = "attention_mask"
NUMPY_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
               onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}
_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


@dataclass(frozen=True)
class InputContract:
    path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    inputs: tuple[str, ...]
    input_ids_dtype: int  # onnx.TensorProto elem type
    kv_dtype: int
    vocab_size: int | None  # the logits' last dim when static
    data_files: tuple[str, ...]  # external data files the model names, relative to it

    @property
    def has_attention_mask(self) -> bool:
        return ATTENTION_MASK in self.inputs

    @property
    def has_position_ids(self) -> bool:
        return POSITION_IDS in self.inputs

    @property
    def removed_inputs(self) -> tuple[str, ...]:
        """Graph inputs the runtime replaces (the KV cache, the mask)."""
        return tuple(n for n in self.inputs if _PAST.match(n) or n == ATTENTION_MASK)


def load_header(path: Path) -> onnx.ModelProto:
    """The model without external weights; a clear error if it is not a readable ONNX file."""
    if not path.exists():
        raise ModelInputError(f"{path}: no such file")
    if not path.is_file():
        raise ModelInputError(f"{path}: not a file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except PermissionError:
        raise ModelInputError(f"{path}: permission denied") from None
    except (DecodeError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError, OSError,
            RuntimeError) as e:
        raise ModelInputError(f"{path}: not an ONNX model ({type(e).__name__})") from None


def _layers(names: list[str], pattern: re.Pattern) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for n in names:
        if m := pattern.match(n):
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return found


def _static_dim(vi: onnx.ValueInfoProto, axis: int) -> int | None:
    dims = vi.type.tensor_type.shape.dim
    return dims[axis].dim_value if len(dims) == 4 and dims[axis].HasField("dim_value") else None


def check_contract(path: Path, model: onnx.ModelProto) -> InputContract:
    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in inits}
    outputs = [o.name for o in g.output]
    if not inputs or not outputs:
        raise ModelInputError(f"{path}: graph has no inputs or no outputs")
    past, present = _layers(list(inputs), _PAST), _layers(outputs, _PRESENT)
    if not past or not present:
        raise ModelInputError(
            f"{path}: no KV-cache I/O; DSpark needs a decoder exported with past "
            "(inputs past_key_values.{i}.key|value, outputs present.{i}.key|value); "
            f"found inputs {sorted(inputs)}, outputs {outputs}"
        )
    n = len(past)
    for name, found in (("past_key_values", past), ("present", present)):
        missing = [i for i in range(n) if found.get(i) != {"key", "value"}]
        if sorted(found) != list(range(n)) or missing:
            raise ModelInputError(f"{path}: {name}.{{i}}.key|value incomplete for layers {missing}")
    if INPUT_IDS not in inputs:
        raise ModelInputError(f"{path}: no input_ids input (inputs: {sorted(inputs)})")
    if LOGITS not in outputs:
        raise ModelInputError(f"{path}: no logits output (outputs: {outputs})")
    extra = set(inputs) - {INPUT_IDS, ATTENTION_MASK, POSITION_IDS} - {past_name(i, k)
                                                                      for i in range(n)
                                                                      for k in ("key", "value")}
    if extra:
        raise ModelInputError(f"{path}: unexpected inputs {sorted(extra)} (not a decoder-only LM?)")
    key = inputs[past_name(0, "key")]
    heads, head_dim = _static_dim(key, 1), _static_dim(key, 3)
    if not heads or not head_dim:
        raise ModelInputError(
            f"{path}: past_key_values.0.key must be 4-D [batch, kv_heads, past, head_dim] "
            "with static kv_heads and head_dim"
        )
    return InputContract(
        path=path, num_layers=n, num_kv_heads=heads, head_dim=head_dim,
        inputs=tuple(i.name for i in g.input if i.name not in inits),
        input_ids_dtype=inputs[INPUT_IDS].type.tensor_type.elem_type,
        kv_dtype=key.type.tensor_type.elem_type,
        vocab_size=_static_last(next(o for o in g.output if o.name == LOGITS)),
        data_files=tuple(sorted({e.value for t in g.initializer for e in t.external_data
                                 if e.key == "location"})),
    )


def _static_last(vi: onnx.ValueInfoProto) -> int | None:
    dims = vi.type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
