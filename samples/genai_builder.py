"""onnxruntime-genai's model builder, run as `python -m onnxruntime_genai.models.builder` is,
with one adaptation: transformers 5 gives Gemma 3 its rope as per-layer-type
`rope_parameters` ({"full_attention": ..., "sliding_attention": ...}), which the builder
(0.18) reads as one flat dict and `rope_local_base_freq`; they are handed over in that form.
Its Phi-3 reads a LongRoPE scaling's kind as transformers 4's "type" (5: "rope_type").

    python samples/genai_builder.py -i HF_FOLDER -o OUT -p fp32|int4 -e cpu
    python samples/genai_builder.py --many '[["-i", ...], ...]'   # several, imports paid once
"""

from __future__ import annotations

import runpy
import sys


def _flat_rope(config):
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "sliding_attention" in rope and "full_attention" in rope:
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_parameters = dict(rope["full_attention"])
    elif isinstance(rope, dict) and rope.get("rope_type") == "longrope" and "type" not in rope:
        config.rope_parameters = {**rope, "type": "longrope"}  # Phi-3's builder reads "type"
    return config


def adapt() -> None:
    """Hand every config the builder loads over in the form it reads (once per process)."""
    import transformers

    load = transformers.AutoConfig.from_pretrained.__func__
    transformers.AutoConfig.from_pretrained = classmethod(
        lambda cls, *a, **k: _flat_rope(load(cls, *a, **k)))


def build(args: list[str]) -> None:
    """One builder run with these command-line arguments (after `adapt()`)."""
    sys.argv = ["onnxruntime_genai.models.builder", *args]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


def main() -> None:
    adapt()
    if sys.argv[1:2] == ["--many"]:
        import json

        for args in json.loads(sys.argv[2]):
            build([str(a) for a in args])
    else:
        build(sys.argv[1:])


if __name__ == "__main__":
    main()
