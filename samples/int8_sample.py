"""Build the int8 sample: the SmolLM2 sample's main through onnxruntime's quantize_dynamic
(int8 weights per column, activations quantized at run time, as optimum's dynamic configs
and many hub repositories' `model_quantized.onnx` are), compiled with the sample's int4 draft.

    python samples/smollm2.py       # the sample pair, first
    python samples/int8_sample.py   # build/smollm2-q8/main.onnx, build/smollm2-q8.dsmodel

`dsc compile` makes its per-tensor quantization per token (compiler/passes/token_quant.py);
docs/models.md and docs/performance.md give what it measured.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def arguments(doc: str, name: str, more=None) -> argparse.Namespace:
    """--sample (the folder of the main to convert: main.onnx or model.onnx), --draft (its
    folder's tokenizer files come along), --out and --bundle for the converted main;
    more(parser) adds a converter's own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if more is not None:
        more(p)
    p.add_argument("--sample", type=Path, default=Path("build/smollm2"))
    p.add_argument("--draft", type=Path, default=Path("build/smollm2/draft.onnx"))
    p.add_argument("--out", type=Path, default=Path(f"build/{name}"))
    p.add_argument("--bundle", type=Path, default=Path(f"build/{name}.dsmodel"))
    return p.parse_args()


def converted(args: argparse.Namespace, convert) -> None:
    """convert(main, tmp) writes the converted main; it lands in --out beside the draft's
    tokenizer files and is compiled with the draft into --bundle."""
    main_onnx = next((f for f in (args.sample / "main.onnx", args.sample / "model.onnx")
                      if f.exists()), None)
    if main_onnx is None or not args.draft.exists():
        sys.exit(f"error: {args.sample}/main.onnx or {args.draft}: no such file (run "
                 "samples/smollm2.py first)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (args.draft.parent / name).exists():
            shutil.copy(args.draft.parent / name, args.out / name)
    tmp = args.out / "main.tmp.onnx"
    convert(main_onnx, tmp)
    tmp.rename(args.out / "main.onnx")
    dsc = Path(sys.executable).parent / "dsc"
    subprocess.run([str(dsc), "compile", str(args.out / "main.onnx"), str(args.draft), "-o",
                    str(args.bundle), "--force"], check=True)


def main() -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    converted(arguments(__doc__, "smollm2-q8"), lambda src, dst: quantize_dynamic(
        src, dst, weight_type=QuantType.QInt8, per_channel=True))


if __name__ == "__main__":
    main()
