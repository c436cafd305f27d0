"""Tiny random-init Hugging Face pairs exported to ONNX, built by code and cached.

Each architecture has a main model and a smaller draft (fewer layers, sharing the main's
embeddings and first layers, so the draft often agrees with the main), both exported in the
three forms users produce: classic (eager, opset 17), dynamo (sdpa, opset 23) and sdpa
(optimum-cli's: the classic exporter over sdpa attention, opset 18, NaN guards). Two have
sliding-window layers of 8 positions: gemma3 (5 sliding layers, then a global one, q/k norm,
tied head) and mistral (every layer sliding).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dspark.compiler.hf_export import export_causal_lm

ARCHS = ("llama", "gpt2", "gemma3", "mistral")
FORMS = ("classic", "dynamo", "sdpa")
PAIRS = tuple((a, f) for a in ARCHS for f in FORMS)
SLIDING_WINDOW = 8  # gemma3's and mistral's
MAIN_LAYERS = {"gemma3": 6}  # Gemma 3's pattern: 5 sliding layers, then a global one
VOCAB = 320
RECIPE = 5  # bump when fixture configs change


def _config(arch: str, layers: int, attn: str):
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, sliding_window=SLIDING_WINDOW,
                                max_position_embeddings=4096, initializer_range=0.25,
                                attn_implementation=attn)
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, sliding_window=SLIDING_WINDOW,
                             max_position_embeddings=4096, initializer_range=0.25,
                             attn_implementation=attn, tie_word_embeddings=False)
    if arch == "llama":
        from transformers import LlamaConfig

        # GQA: 4 query heads share 2 KV heads; larger init so logits are decisive (few near-ties)
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, initializer_range=0.25,
                           attn_implementation=attn, tie_word_embeddings=False)
    from transformers import GPT2Config

    # positions to the compiler's default max_seq_len (which it runs the model at)
    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=2048,
                      initializer_range=0.25, attn_implementation=attn)


def _model_class(arch: str):
    import transformers

    return getattr(transformers, {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
                                  "gemma3": "Gemma3ForCausalLM",
                                  "mistral": "MistralForCausalLM"}[arch])


def make_pair(arch: str, attn: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Main (3 layers, gemma3 6) and draft (its first layer, same embeddings and head)."""
    torch.manual_seed(1234)
    cls = _model_class(arch)
    main = cls(_config(arch, MAIN_LAYERS.get(arch, 3), attn)).eval()
    draft = cls(_config(arch, 1, attn)).eval()
    draft.load_state_dict(main.state_dict(), strict=False)
    return main, draft


def recipe_hash() -> str:
    import transformers

    blob = json.dumps({"recipe": RECIPE, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "export": hashlib.sha256(
                           Path(__import__("dspark.compiler.hf_export", fromlist=["x"]).__file__)
                           .read_bytes()).hexdigest()})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_fixtures(root: Path) -> dict[tuple[str, str], tuple[Path, Path]]:
    """{(arch, form): (main.onnx, draft.onnx)}, exported once per recipe into root."""
    from parallel_builds import in_processes

    folder = root / f"fixtures-{recipe_hash()}"
    pairs = {(arch, form): (folder / f"{arch}-{form}" / "main.onnx",
                            folder / f"{arch}-{form}" / "draft.onnx") for arch, form in PAIRS}
    missing = [(arch, form, paths[0].parent) for (arch, form), paths in pairs.items()
               if not all(p.exists() for p in paths)]
    # the dynamo exports first: they take 20-40 s each, the others a second or two
    in_processes([(export_pair, job) for job in sorted(missing, key=lambda j: j[1] != "dynamo")])
    return pairs


def export_pair(arch: str, form: str, folder: Path) -> None:
    """One fixture pair exported into `folder` (written beside it, then renamed)."""
    main, draft = make_pair(arch, "eager" if form == "classic" else "sdpa")
    tmp = folder.with_suffix(".tmp")
    for model, name in ((main, "main.onnx"), (draft, "draft.onnx")):
        export_causal_lm(model, tmp / name, form)
    tmp.rename(folder)


# onnxruntime-genai's builder output (python -m onnxruntime_genai.models.builder): name ->
# (architecture, precision). llama: tied embeddings (int4: a GatherBlockQuantized embedding
# and MatMulNBits without zero points); qwen2: layers 1-2 slide over 8 positions, kept in
# window-sized caches (the builder's default for sliding layers); gemma3: 5 sliding layers of
# 8, then a global one, a q/k norm per head between the packed projection's Split and the
# GroupQueryAttention (built through samples/genai_builder.py, which hands the builder
# transformers 5's per-layer-type rope in the form it reads); qwen3: a q/k norm per head,
# tied head; phi3: packed projections in the checkpoint
GENAI = {"llama-fp32": ("llama", "fp32"), "llama-int4": ("llama", "int4"),
         "qwen2-fp32": ("qwen2", "fp32"), "gemma3-fp32": ("gemma3", "fp32"),
         "qwen3-fp32": ("qwen3", "fp32"), "phi3-fp32": ("phi3", "fp32"),
         "gemma2-fp32": ("gemma2", "fp32"), "granite-fp32": ("granite", "fp32")}
# built beside GENAI (the same builder process) for the refusal test, not compiled: the
# builder writes MultiHeadAttention, not GroupQueryAttention, for fp16 on the CPU
REFUSED_GENAI = {"llama-fp16": ("llama", "fp16")}
GENAI_BUILDER = Path(__file__).resolve().parents[1] / "samples" / "genai_builder.py"


def _genai_model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.25)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)).eval()
    if arch == "gemma3":
        return _model_class(arch)(_config(arch, MAIN_LAYERS[arch], "eager")).eval()
    if arch in ("qwen3", "phi3", "gemma2", "granite"):
        from arch_fixtures import more_config
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(more_config(arch)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True,
                                        sliding_window=SLIDING_WINDOW, max_window_layers=1,
                                        tie_word_embeddings=False)).eval()


def _genai_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the 320 ids with the special tokens the builder expects
    (Qwen's pad token among them, so it adds none past the vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    words = _main_words()
    words[VOCAB - 1] = "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(
        {w: i for i, w in enumerate(words)}, False), unk_token="w0", eos_token="<|endoftext|>")
    tok.save_pretrained(str(folder))


def build_genai_fixtures(root: Path) -> dict[str, Path]:
    """{name: model folder} of GENAI, built once per recipe into root (REFUSED_GENAI's
    beside them, in the same folder)."""
    import json
    import subprocess
    import sys

    folder = root / f"fixtures-{recipe_hash()}" / "genai"
    recipes = {**GENAI, **REFUSED_GENAI}
    out = {name: folder / name for name in recipes}
    missing = [name for name in recipes if not (out[name] / "genai_config.json").exists()]
    for name in missing:
        hf = folder / f"{recipes[name][0]}-hf"
        if not (hf / "config.json").exists():
            _genai_model(recipes[name][0]).save_pretrained(str(hf))
            _genai_tokenizer(hf)
    if missing:  # one process: torch's and the builder's imports paid once, not per model
        builds = [["-i", folder / f"{recipes[name][0]}-hf", "-o",
                   out[name].with_suffix(".tmp"), "-p", recipes[name][1], "-e", "cpu"]
                  for name in missing]
        subprocess.run([sys.executable, GENAI_BUILDER, "--many", json.dumps(builds, default=str)],
                       check=True, capture_output=True)
    for name in missing:
        out[name].with_suffix(".tmp").rename(out[name])
    return {name: out[name] for name in GENAI}


EMOJI = "🛒"
SHIFT = 11  # draft id = (main id + SHIFT) % VOCAB


def _main_words() -> list[str]:
    words = [f"w{i}" for i in range(300)] + ["<user>", "<assistant>", "hello", "world",
                                             "<system>", EMOJI, "Add", "to", "cart"]
    return words + [f"x{i}" for i in range(VOCAB - len(words))]  # every model id a word


def _tokenizer(vocab: dict[str, int], byte_level: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
             pre_tokenizers.Split(Regex(r"<[a-z]+>"), behavior="isolated")]
    if byte_level:  # the seed's draft: non-ASCII text becomes one token per byte
        steps += [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                  pre_tokenizers.Split(Regex(r"[^\x00-\x7F]"), behavior="isolated")]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if byte_level:
        tok.decoder = decoders.ByteLevel()
    return tok


def build_mapped_pair(root: Path) -> dict[str, Path]:
    """A main with one token for the emoji, and a draft whose tokenizer has the emoji as
    four byte tokens and every other id shifted: the draft is the main model with its
    vocabulary rows permuted into that layout, so once mapped it predicts like the main."""
    import json

    folder = root / f"fixtures-{recipe_hash()}" / "mapped"
    paths = {"main": folder / "main" / "main.onnx", "draft": folder / "draft" / "draft.onnx",
             "main_tok": folder / "main", "draft_tok": folder / "draft"}
    if paths["main"].exists() and paths["draft"].exists():
        return paths
    words = _main_words()
    main_vocab = {w: i for i, w in enumerate(words)}
    missing = {EMOJI, "x0", "x1", "x2"}  # the draft has 4 byte tokens in their place
    draft_vocab = {w: (i + SHIFT) % VOCAB for i, w in enumerate(words) if w not in missing}
    emoji_bytes = [chr(c) for c in (0xF0, 0x141, 0x13D, 0x134)]  # ByteLevel's f0 9f 9b 92
    free = sorted(set(range(VOCAB)) - set(draft_vocab.values()))
    draft_vocab.update(dict(zip(emoji_bytes, free)))
    tmp = folder.with_suffix(".tmp")
    for side, vocab, byte_level in (("main", main_vocab, False), ("draft", draft_vocab, True)):
        (tmp / side).mkdir(parents=True, exist_ok=True)
        _tokenizer(vocab, byte_level).save(str(tmp / side / "tokenizer.json"))
        (tmp / side / "tokenizer_config.json").write_text(json.dumps({"unk_token": "w0"}))
    main, _ = make_pair("llama", "eager")
    draft, _ = make_pair("llama", "eager")
    order = torch.zeros(VOCAB, dtype=torch.long)  # draft row d <- main row order[d]
    for w, d in draft_vocab.items():
        order[d] = main_vocab.get(w, main_vocab["w0"])
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight[order])
        draft.lm_head.weight.copy_(main.lm_head.weight[order])
    to_draft = torch.tensor([(m + SHIFT) % VOCAB for m in range(VOCAB)])
    fit_byte_embeddings(main, draft, [draft_vocab[b] for b in emoji_bytes],
                        main_vocab[EMOJI], to_draft, order)
    export_causal_lm(main, tmp / "main" / "main.onnx", "classic")
    export_causal_lm(draft, tmp / "draft" / "draft.onnx", "classic")
    tmp.rename(folder)
    return paths


def fit_byte_embeddings(main, draft, byte_ids: list[int], emoji: int, to_draft: torch.Tensor,
                        order: torch.Tensor, steps: int = 300, lr: float = 0.05) -> float:
    """Distil the draft's embeddings of the emoji's byte tokens (its only tokens with no main
    counterpart) so that, having read them, it continues as the main does after its one
    emoji token: what a byte-level draft that met emoji in training knows. Without this the
    random-init draft's byte rows are noise and nothing after an emoji can agree. Only those
    rows move. Returns the final top-1 agreement after the emoji on held-out sequences."""
    weight = draft.model.embed_tokens.weight
    weight.requires_grad_(True)
    rows = torch.zeros(VOCAB, 1)
    rows[byte_ids] = 1.0
    opt = torch.optim.Adam([weight], lr=lr)
    gen = torch.Generator().manual_seed(5)
    n = len(byte_ids)

    def batch(size: int, prefix: int | None = None):
        if prefix is None:
            prefix = int(torch.randint(0, 7, (1,), generator=gen))
        words = torch.randint(0, 300, (size, prefix + 8), generator=gen)
        main_ids = torch.cat([words[:, :prefix], torch.full((size, 1), emoji),
                              words[:, prefix:]], 1)
        draft_ids = torch.cat([to_draft[words[:, :prefix]],
                               torch.tensor(byte_ids).expand(size, n),
                               to_draft[words[:, prefix:]]], 1)
        with torch.no_grad():
            want = main(main_ids).logits[:, prefix:][..., order]  # draft id order
        got = draft(draft_ids).logits[:, prefix + n - 1:]
        return want, got

    for _ in range(steps):
        want, got = batch(32)
        loss = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1),
                                          log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        weight.grad *= rows
        opt.step()
    weight.requires_grad_(False)
    with torch.no_grad():
        pairs = [batch(64, prefix) for prefix in range(7)]
    return sum(float((w.argmax(-1) == g.argmax(-1)).float().mean()) for w, g in pairs) / 7


JSON_CORPUS = ['{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true}',
               '{"id": 7, "items": [{"sku": "x1", "qty": 2}], "note": null, "price": 9.5}',
               "the user asks for a short answer in json with a name and a list of values",
               '{"city": "Paris", "country": "France", "population": 2100000}']


def json_tokenizer():
    """A byte-level BPE tokenizer of 319 tokens and <eos>, trained on a little JSON: every
    string has a spelling, so a grammar can drive the 320-id fixture models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(JSON_CORPUS * 4, trainer)
    return tok
