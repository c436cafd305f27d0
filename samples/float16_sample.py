"""Build the float16 sample: the SmolLM2 sample's main through onnxruntime's
convert_float_to_float16 with float32 inputs and outputs (`keep_io_types`, as many hub
repositories' `model_fp16.onnx` are made), compiled with the sample's int4 draft.

    python samples/smollm2.py         # the sample pair, first
    python samples/float16_sample.py  # build/smollm2-f16/main.onnx, build/smollm2-f16.dsmodel
    python samples/float16_sample.py --sample build/peers/optimum \
        --out build/smollm2-optimum-f16 --bundle build/smollm2-optimum-f16.dsmodel
                                      # optimum's export (bench/bench_peers.py --setup)
    python samples/float16_sample.py --float16-io --out build/smollm2-f16io \
        --bundle build/smollm2-f16io.dsmodel   # float16 inputs, outputs and cache

onnxruntime runs such a model's MatMuls and Softmax in float32 between casts; dsc reads its
attention through them (docs/models.md).
"""

from __future__ import annotations

import onnx
from int8_sample import arguments, converted


def _converter(keep_io_types: bool):
    def convert(src, dst) -> None:
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=keep_io_types)
        onnx.save(model, str(dst), save_as_external_data=True, location="main.onnx.data")

    return convert


def main() -> None:
    args = arguments(__doc__, "smollm2-f16", lambda p: p.add_argument(
        "--float16-io", action="store_true", help="float16 inputs, outputs and cache"))
    converted(args, _converter(keep_io_types=not args.float16_io))


if __name__ == "__main__":
    main()
