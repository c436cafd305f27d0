"""Tiny random-init Hugging Face folders, written by the optimum venv's own transformers (4.x:
its config keys, e.g. `rope_theta`, are what optimum reads), each exported by optimum's
exporter (`main_export`, what `optimum-cli export onnx` calls; one process pays torch's and
optimum's imports once, not once per model). Run by arch_fixtures.build_optimum_exports with
that venv's python:

    python tests/optimum_models.py HF OUT ARCH...    # OUT/ARCH.tmp/model.onnx, ...
"""

import sys
from pathlib import Path

import torch
import transformers as t

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              initializer_range=0.25)
CONFIGS = {
    "llama": lambda: t.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "phi3": lambda: t.Phi3Config(**COMMON, pad_token_id=0),
    "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=8),
    "gemma3": lambda: t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16,
                                         sliding_window=8),
    # its scale computed at run time from Shape(q)[-1:], a learned position table
    "gpt2": lambda: t.GPT2Config(vocab_size=320, n_embd=64, n_layer=3, n_head=4,
                                 n_positions=1024, initializer_range=0.25),
    # each expert's tokens picked by NonZero: shapes that follow the routing
    "qwen3-moe": lambda: t.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, head_dim=16),
    # the cache cast to its own type, 8 rotated dims
    "gptj": lambda: t.GPTJConfig(vocab_size=320, n_embd=64, n_layer=3, n_head=4, rotary_dim=8,
                                 n_positions=4096, initializer_range=0.25),
    "phi": lambda: t.PhiConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
                               partial_rotary_factor=0.5),
}


def main() -> None:
    from optimum.exporters.onnx import main_export

    hf, out = Path(sys.argv[1]), Path(sys.argv[2])
    for arch in sys.argv[3:]:
        torch.manual_seed(1234)
        t.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval().save_pretrained(
            str(hf / f"{arch}-hf"))
        main_export(str(hf / f"{arch}-hf"), output=str(out / f"{arch}.tmp"),
                    task="text-generation-with-past")


if __name__ == "__main__":
    main()
