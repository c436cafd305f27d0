"""The input contract: a decoder-only causal LM with KV-cache I/O as optimum/HF export it.

    inputs   input_ids, [attention_mask], [position_ids], past_key_values.{i}.key|value
    outputs  logits, present.{i}.key|value
Checked on the graph's I/O alone (no weights loaded), so a wrong file fails in milliseconds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, POSITION_IDS
from dspark.runtime.errors import ModelInputError, UnmappableAttentionError

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
    # per layer, the rows its past buffer must have at least: a GroupQueryAttention with a
    # window-sized cache (sliding_window_cache=1, onnxruntime-genai's default for sliding
    # layers) refuses one smaller than its window; 0 elsewhere
    min_cache: tuple[int, ...] = ()

    def cache_rows(self, layer: int, past: int) -> int:
        """Rows of layer `layer`'s past buffer holding `past` positions."""
        return max(past, self.min_cache[layer]) if self.min_cache else past

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


GENAI_CONFIG = "genai_config.json"


def model_file(path: Path) -> Path:
    """The ONNX file a user's path names: the file itself, or in a folder the decoder its
    genai_config.json names (onnxruntime-genai's builder output), else its model.onnx."""
    if not path.is_dir():
        return path
    config = path / GENAI_CONFIG
    if config.is_file():
        try:
            name = json.loads(config.read_text())["model"]["decoder"]["filename"]
        except (ValueError, KeyError, TypeError):
            raise ModelInputError(f"{config}: no model.decoder.filename in it") from None
        return path / name
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    raise ModelInputError(f"{path}: a folder without {GENAI_CONFIG} or model.onnx")


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
    if heads and not head_dim and len(key.type.tensor_type.shape.dim) == 4:
        head_dim = fused_head_dim(g)
    if not heads or not head_dim:
        _refuse_contrib_attention(path, g)
        raise ModelInputError(
            f"{path}: past_key_values.0.key must be 4-D [batch, kv_heads, past, head_dim] "
            "with static kv_heads and head_dim (or a symbolic head_dim that its "
            "GroupQueryAttention's projection gives)"
        )
    return InputContract(
        path=path, num_layers=n, num_kv_heads=heads, head_dim=head_dim,
        inputs=tuple(i.name for i in g.input if i.name not in inits),
        input_ids_dtype=inputs[INPUT_IDS].type.tensor_type.elem_type,
        kv_dtype=key.type.tensor_type.elem_type,
        vocab_size=_static_last(next(o for o in g.output if o.name == LOGITS)),
        data_files=tuple(sorted({e.value for t in g.initializer for e in t.external_data
                                 if e.key == "location"})),
        min_cache=_window_caches(g, n),
    )


def _window_caches(g: onnx.GraphProto, layers: int) -> tuple[int, ...]:
    """min_cache: each layer's local_window_size where its GroupQueryAttention keeps a
    window-sized cache."""
    rows = [0] * layers
    for node in g.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "GroupQueryAttention" or not attrs.get("sliding_window_cache"):
            continue
        found = _PAST.match(node.input[3]) if len(node.input) > 3 else None
        if found and found.group(2) == "key" and int(found.group(1)) < layers:
            rows[int(found.group(1))] = max(0, int(attrs.get("local_window_size", 0)))
    return tuple(rows) if any(rows) else ()


def _static_last(vi: onnx.ValueInfoProto) -> int | None:
    dims = vi.type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def _refuse_contrib_attention(path: Path, g: onnx.GraphProto) -> None:
    """onnxruntime-genai's fp16 CPU builds run MultiHeadAttention (com.microsoft), which has no
    rewrite here: refused by name, not for the cache dims it leaves symbolic."""
    node = next((n for n in g.node if n.op_type in _UNMAPPED_CONTRIB
                 and n.domain == "com.microsoft"), None)
    if node is not None:
        raise UnmappableAttentionError(
            f"{path}: cannot map attention: {node.op_type} node '{node.name}' "
            "(onnxruntime-genai writes it for fp16 on CPU) is not supported; build the model "
            "fp32 or int4 (-p fp32 / -p int4), whose GroupQueryAttention is")


_UNMAPPED_CONTRIB = ("MultiHeadAttention", "Attention", "DecoderMaskedMultiHeadAttention")


def fused_head_dim(g: onnx.GraphProto) -> int | None:
    """head_dim of a graph whose cache dims are symbolic (onnxruntime-genai's `kv_cache_dim`):
    layer 0's GroupQueryAttention reads its query (packed q|k|v, or q alone) from a
    projection whose output width the weights give: a MatMul's [K, N] initializer or a
    MatMulNBits' N, maybe through a bias Add."""
    node = next((n for n in g.node if n.op_type == "GroupQueryAttention"
                 and past_name(0, "key") in n.input), None)
    if node is None:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    packed = len(node.input) < 2 or not node.input[1]
    heads = attrs.get("num_heads", 0) + (2 * attrs.get("kv_num_heads", 0) if packed else 0)
    width = _projection_width(g, node.input[0])
    return width // heads if width and heads and width % heads == 0 else None


def _projection_width(g: onnx.GraphProto, name: str) -> int | None:
    producers = {o: n for n in g.node for o in n.output}
    dims = {t.name: list(t.dims) for t in g.initializer}
    node = producers.get(name)
    while node is not None and node.op_type in PER_HEAD_NORM:  # a q/k norm per head
        name = node.input[0]  # (Gemma 3 through genai's builder: Reshape, norm, Reshape)
        node = producers.get(name)
    if node is not None and node.op_type == "Split":  # q of a packed projection
        return _split_width(g, node, list(node.output).index(name))
    if node is not None and node.op_type == "Add":  # a bias after the projection
        node = next((producers[i] for i in node.input if i in producers), None)
    if node is None:
        return None
    if node.op_type == "MatMulNBits":
        return next((a.i for a in node.attribute if a.name == "N"), None)
    if node.op_type == "MatMul" and len(dims.get(node.input[1], [])) == 2:
        return dims[node.input[1]][1]
    return None


PER_HEAD_NORM = ("Reshape", "SimplifiedLayerNormalization", "LayerNormalization",
                 "RMSNormalization")


def _split_width(g: onnx.GraphProto, split: onnx.NodeProto, index: int) -> int | None:
    """The width of a Split's output `index`, from its sizes: an initializer, a Constant
    node or (opset < 13) its attribute."""
    given = split.input[1] if len(split.input) > 1 else ""
    tensors = [t for t in g.initializer if t.name == given] + [
        a.t for n in g.node if n.op_type == "Constant" and given in n.output
        for a in n.attribute if a.name == "value"]
    sizes = [int(v) for v in onnx.numpy_helper.to_array(tensors[0]).ravel()] if tensors else (
        next((list(a.ints) for a in split.attribute if a.name == "split"), None))
    return sizes[index] if sizes and index < len(sizes) else None
