"""Main models beyond the fixture pairs, built by code and cached like them: more
architectures exported classic, a LongRoPE Phi-3 (dynamo and onnxruntime-genai's builder),
and optimum's own exports (in its venv)."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.compiler.hf_export import export_causal_lm

from model_fixtures import GENAI_BUILDER, SLIDING_WINDOW, VOCAB, _genai_tokenizer, recipe_hash

LONGROPE_SWITCH = 256  # the Phi-3 LongRoPE fixture's original_max_position_embeddings


def _longrope_model():
    """A tiny Phi-3 with LongRoPE: other frequencies once the call's longest position passes
    LONGROPE_SWITCH (Phi-3's 128k models; transformers picks them per forward)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(1234)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8, "original_max_position_embeddings": LONGROPE_SWITCH}
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        original_max_position_embeddings=LONGROPE_SWITCH, rope_parameters=rope,
        initializer_range=0.25, pad_token_id=0, attn_implementation="sdpa")).eval()


def build_longrope_fixtures(root: Path) -> dict[str, Path]:
    """{"dynamo": main.onnx (torch.onnx dynamo: a Where between the two frequency sets),
    "genai": a model folder (onnxruntime-genai's builder: an If between two rope caches)}."""
    import subprocess
    import sys

    folder = root / f"fixtures-{recipe_hash()}" / "longrope"
    out = {"dynamo": folder / "dynamo" / "main.onnx", "genai": folder / "genai"}
    if not out["dynamo"].exists():
        tmp = out["dynamo"].parent.with_suffix(".tmp")
        export_causal_lm(_longrope_model(), tmp / "main.onnx", "dynamo")
        tmp.rename(out["dynamo"].parent)
    if not (out["genai"] / "genai_config.json").exists():
        hf = folder / "hf"
        if not (hf / "config.json").exists():
            _longrope_model().save_pretrained(str(hf))
            _genai_tokenizer(hf)
        tmp = out["genai"].with_suffix(".tmp")
        subprocess.run([sys.executable, str(GENAI_BUILDER), "-i", str(hf), "-o", str(tmp),
                        "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
        tmp.rename(out["genai"])
    return out


# More architectures, main models only, exported classic (eager, opset 17): each family's
# own attention and rotary code as transformers writes it (q/k norms, fused projections,
# rope scalings that do not switch on the length, layers without rope).
MORE_ARCHS = ("qwen3", "qwen2", "phi3", "olmo2", "granite", "starcoder2", "smollm3",
              "llama3-rope", "gemma2", "mixtral", "qwen3-moe", "gptj", "phi", "gpt-neox",
              "falcon", "gpt2", "opt", "cohere")
EXPORT_FORMS = {"cohere": "dynamo"}  # the classic exporter fails on it ("same rank")
MIXTURES = ("mixtral", "qwen3-moe")  # 8 experts, 2 a token: a trace of 3 tokens misses some


def more_config(arch: str):
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.25, attn_implementation="eager")
    if arch == "qwen3":  # a q/k norm per head, tied head
        return t.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if arch == "phi3":  # packed qkv and gate/up projections
        return t.Phi3Config(**common, pad_token_id=0)
    if arch == "olmo2":  # the q/k norm over all heads, norms after the blocks
        return t.Olmo2Config(**common)
    if arch == "granite":  # embedding, residual, attention and logits multipliers
        return t.GraniteConfig(**common, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, logits_scaling=4.0)
    if arch == "starcoder2":  # biases, LayerNorm, a GELU MLP
        return t.Starcoder2Config(**common, sliding_window=None)
    if arch == "smollm3":  # every 4th layer without rope (NoPE)
        return t.SmolLM3Config(**{**common, "num_hidden_layers": 4}, pad_token_id=0)
    if arch == "llama3-rope":  # Llama 3.1's frequency-dependent rope scaling
        return t.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512})
    if arch == "gemma2":  # sliding layers of 8, no soft-capping (build_capped_gemma2 has it)
        return t.Gemma2Config(**common, head_dim=16, sliding_window=SLIDING_WINDOW,
                              attn_logit_softcapping=None, final_logit_softcapping=None)
    if arch == "qwen2":
        return t.Qwen2Config(**common)
    if arch == "gptj":  # rotary on the first 8 dims, pairs interleaved; the cache cast
        return t.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, rotary_dim=8,
                            n_positions=4096, initializer_range=0.25,
                            attn_implementation="eager")
    if arch == "phi":  # Phi-2: half the head rotated, attention and MLP in parallel
        return t.PhiConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                           partial_rotary_factor=0.5)
    if arch == "gpt-neox":  # Pythia: a quarter rotated, packed qkv per head
        return t.GPTNeoXConfig(**{k: v for k, v in common.items()
                                  if k != "num_key_value_heads"}, rotary_pct=0.25)
    if arch == "falcon":  # the new decoder: kv groups packed with their queries
        return t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                              num_attention_heads=4, new_decoder_architecture=True,
                              num_kv_heads=2, initializer_range=0.25,
                              attn_implementation="eager")
    if arch == "gpt2":  # a learned position table, Conv1D projections
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=1024,
                            initializer_range=0.25, attn_implementation="eager")
    if arch == "opt":  # a learned position table read at the position + 2
        return t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=1024,
                           word_embed_proj_dim=64, init_std=0.25,
                           attn_implementation="eager")
    if arch == "cohere":  # interleaved rotary, LayerNorm without bias, parallel block
        return t.CohereConfig(**{**common, "attn_implementation": "sdpa"})
    if arch == "mixtral":
        return t.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                               sliding_window=None)
    if arch == "qwen3-moe":  # experts, a q/k norm
        return t.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, head_dim=16)
    raise ValueError(arch)


def export_config(path: Path, config, form: str) -> None:
    """A random-init model of `config` (seed 1234) exported in `form` to `path` (written
    beside, then renamed: a failed export leaves nothing)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    tmp = path.parent.with_suffix(".tmp")
    export_causal_lm(model, tmp / path.name, form)
    tmp.rename(path.parent)


def _export_once(jobs: dict[str, tuple[Path, object, str]]) -> dict[str, Path]:
    """{name: path} of jobs {name: (path, config, form)}, the missing ones exported side by
    side (parallel_builds.py)."""
    from parallel_builds import in_processes

    missing = [job for job in jobs.values() if not job[0].exists()]
    in_processes([(export_config, job) for job in sorted(missing, key=lambda j: j[2] != "dynamo")])
    return {name: job[0] for name, job in jobs.items()}


def build_more_archs(root: Path) -> dict[str, Path]:
    """{arch: main.onnx} for MORE_ARCHS, exported once per recipe into root."""
    folder = root / f"fixtures-{recipe_hash()}" / "more"
    return _export_once({arch: (folder / arch / "main.onnx", more_config(arch),
                                EXPORT_FORMS.get(arch, "classic")) for arch in MORE_ARCHS})


# Gemma 2 as it ships: soft-capped attention scores and final logits (small caps here, 2 and
# 3, so that the caps change what the model computes at these weights), sliding layers of 8
# between global ones; both exporters.
CAPPED_FORMS = ("classic", "dynamo")


def capped_gemma2_config():
    import transformers as t

    return t.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, sliding_window=SLIDING_WINDOW,
                          max_position_embeddings=4096, initializer_range=0.25,
                          attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                          attn_implementation="eager")


def build_capped_gemma2(root: Path) -> dict[str, Path]:
    """{form: main.onnx} of the soft-capped Gemma 2, exported once per recipe into root."""
    folder = root / f"fixtures-{recipe_hash()}" / "gemma2-capped"
    return _export_once({form: (folder / form / "main.onnx", capped_gemma2_config(), form)
                         for form in CAPPED_FORMS})


# optimum's exporter itself (optimum-cli export onnx --task text-generation-with-past), in
# its own venv (`python bench/peer_setup.py optimum-venv`: optimum-onnx pins transformers 4)
OPTIMUM_ARCHS = {"llama": (0, 0, 0), "qwen3": (0, 0, 0), "phi3": (0, 0, 0),
                 "mistral": (SLIDING_WINDOW,) * 3, "gemma3": (SLIDING_WINDOW,) * 5 + (0,),
                 "gpt2": (0, 0, 0), "qwen3-moe": (0, 0, 0), "gptj": (0, 0, 0),
                 "phi": (0, 0, 0)}


def optimum_venv() -> Path:
    """The bin folder of optimum's venv, as the peer benchmark makes it (once; the path is
    its last line, after pip's)."""
    from script_runner import run_script

    return Path(run_script("bench/peer_setup.py", "optimum-venv", check=True,
                           capture_output=True, text=True).stdout.splitlines()[-1])


def build_optimum_exports(root: Path) -> dict[str, Path]:
    """{arch: model.onnx} of OPTIMUM_ARCHS as optimum exports them, built once into root."""
    import shutil
    import subprocess

    folder = root / "fixtures-optimum"
    out = {arch: folder / arch / "model.onnx" for arch in OPTIMUM_ARCHS}
    missing = [arch for arch, path in out.items() if not path.exists()]
    if missing:
        for arch in missing:
            shutil.rmtree(out[arch].parent.with_suffix(".tmp"), ignore_errors=True)
        subprocess.run([str(optimum_venv() / "python"),
                        str(Path(__file__).with_name("optimum_models.py")), str(folder / "hf"),
                        str(folder), *missing], check=True, capture_output=True)
        for arch in missing:
            out[arch].parent.with_suffix(".tmp").rename(out[arch].parent)
    return out


def build_optimum_quantized(root: Path) -> dict[str, Path]:
    """optimum's dynamic int8 quantization of its Llama export (tests/optimum_quantize.py):
    {"all": every MatMul quantized, the attention's too; "no-attention": those left out}."""
    import shutil
    import subprocess

    export = build_optimum_exports(root)["llama"].parent
    folder = root / "fixtures-optimum-int8"
    out = {kind: folder / kind / "model_quantized.onnx" for kind in ("all", "no-attention")}
    for kind, path in out.items():
        if path.exists():
            continue
        tmp = path.parent.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([str(optimum_venv() / "python"),
                        str(Path(__file__).with_name("optimum_quantize.py")), str(export),
                        str(tmp), kind], check=True, capture_output=True)
        tmp.rename(path.parent)
    return out
