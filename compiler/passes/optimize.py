"""Stage 1, optimize: onnxruntime offline optimization, then ONNX shape inference.

Basic level only: it folds constants and removes redundant nodes but adds no contrib ops
(the extended level's fusions are EP-specific and would hide the attention pattern).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from dspark.compiler.contract import InputContract
from dspark.compiler.passes.token_quant import per_token_model, per_token_quantized
from dspark.runtime.bundle.spec import VERIFY_DOMAIN
from dspark.runtime.errors import ModelInputError
from dspark.runtime.model.sessions import make_session


def optimize(contract: InputContract, workdir: Path, role: str) -> Path:
    """Write `role`.opt.onnx (weights in `role`.opt.weights) into workdir; return its path."""
    out = workdir / f"{role}.opt.onnx"
    config = {
        "session.optimized_model_external_initializers_file_name": f"{role}.opt.weights",
        "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    }
    try:
        make_session(contract.path, level="basic", optimized_path=out, config=config,
                     prepack=False)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelInputError(f"{contract.path}: onnxruntime cannot load it: {first}") from None
    _quantize_per_token(out, f"{role}.opt.weights", contract)
    inferred = workdir / f"{role}.inferred.onnx"
    model = infer_types(out)
    pin_casts(model)
    # onnxruntime lists every domain it knows in the model it writes, ours too (version 1000)
    # once this process has registered the CPU op: the bundle must not depend on that.
    kept = [o for o in model.opset_import if o.domain != VERIFY_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.save(model, str(inferred))
    return inferred


ORT_CAST = "InsertedPrecisionFreeCast_"  # onnxruntime's name for the casts it inserts


def pin_casts(model: onnx.ModelProto) -> int:
    """Rename the casts onnxruntime inserted around its float32 kernels in a float16 model.

    Loading a model, onnxruntime removes a Cast to float16 followed by one back to float32
    when it inserted them itself, which it tells by this name: the value is then not rounded
    to float16. The optimized model keeps only the casts whose rounding the model computes,
    so the bundle must keep them all, also where the rewrite puts a cast to float32 after
    one (a float16 key into a float32 cache). Returns how many were renamed."""
    renamed = 0
    for node in model.graph.node:
        if node.name.startswith(ORT_CAST):
            node.name = "PinnedCast_" + node.name[len(ORT_CAST):]
            renamed += 1
    return renamed


def _quantize_per_token(path: Path, weights: str, contract: InputContract) -> None:
    """Activations quantized per tensor become per token (passes/token_quant.py), in the
    optimized file itself: the probes run it."""
    if not per_token_quantized(onnx.load(str(path), load_external_data=False)):
        return
    model = onnx.load(str(path))
    per_token_model(model, contract, contract.path)
    (path.parent / weights).unlink(missing_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=weights,
              size_threshold=1024)


def infer_types(path: Path) -> onnx.ModelProto:
    """The model (weights left external) with types and shapes of every tensor.

    ONNX inference stops at contrib ops (an int4 draft's MatMulNBits); onnxruntime's symbolic
    inference knows them, so it runs when the graph has any (it reads the weights: without
    them its types come out incomplete).
    """
    model = onnx.load(str(path), load_external_data=False)
    if all(n.domain in ("", "ai.onnx") for n in model.graph.node):
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        full = SymbolicShapeInference.infer_shapes(onnx.load(str(path)), auto_merge=True,
                                                   guess_output_rank=True)
    except Exception:  # noqa: BLE001 - fall back to what ONNX itself can infer
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    del model.graph.value_info[:]
    model.graph.value_info.extend(full.graph.value_info)
    return model
