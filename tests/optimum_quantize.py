"""optimum's dynamic int8 quantization (ORTQuantizer, its avx512_vnni config: per tensor) of
an optimum export, run by arch_fixtures.build_optimum_quantized with the optimum venv's
python:

    python tests/optimum_quantize.py EXPORT_FOLDER OUT all|no-attention

`all` quantizes every MatMul, as `optimum-cli onnxruntime quantize --avx512_vnni` does (the
attention's too); `no-attention` leaves the attention's MatMuls out (nodes_to_exclude).
"""

import sys

import onnx
from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig


def main() -> None:
    source, out, kind = sys.argv[1:4]
    graph = onnx.load(f"{source}/model.onnx", load_external_data=False).graph
    attention = [n.name for n in graph.node
                 if n.op_type == "MatMul" and "self_attn/MatMul" in n.name]
    config = AutoQuantizationConfig.avx512_vnni(
        is_static=False, per_channel=False,
        nodes_to_exclude=attention if kind == "no-attention" else [])
    ORTQuantizer.from_pretrained(source, file_name="model.onnx").quantize(
        save_dir=out, quantization_config=config)


if __name__ == "__main__":
    main()
