"""Shared fixtures: tiny exported model pairs, their compiled bundles, the SmolLM2 sample."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The checkout's own folders are packages named as they map into dspark (compiler, runtime,
# kernels, templates). With the checkout's root on sys.path (`python -m pytest` puts the
# working directory first), `import kernels` finds ours instead of Hugging Face's `kernels`,
# which transformers 5.25 requires and imports: every fixture export failed. So the root
# leaves sys.path before anything imports transformers, and child Pythons (tests run
# `python -m dspark...` and scripts from the root) do not prepend their working directory.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

import torch  # noqa: E402

# Without a GPU the DSpark Triton kernels run on CPU tensors under Triton's interpreter, which
# must be chosen before Triton is first imported (its own library functions are decorated
# then). With one, the same kernel tests run compiled on the GPU.
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspark.runtime.model.sessions import init_threads  # noqa: E402

init_threads()  # the shared onnxruntime pool must exist before the first session

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
sys.path.insert(0, str(ROOT / "tests"))

from dspark.compiler.compile import CompileOptions  # noqa: E402

from bundle_cache import compiled as compiled_bundle  # noqa: E402
from model_fixtures import build_fixtures  # noqa: E402

# the fixture bundles' KV arena: every engine zero-fills its arena at construction (0.18 s
# for the 512 MB default), and no test needs more than this
TEST_KV_MB = 32


@pytest.fixture(scope="session")
def fixture_pairs() -> dict[tuple[str, str], tuple[Path, Path]]:
    return build_fixtures(BUILD)


@pytest.fixture(scope="session")
def compiled(fixture_pairs, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every fixture pair compiled with default flags."""
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    for (arch, form), (main, draft) in fixture_pairs.items():
        path = root / f"{arch}-{form}.dsmodel"
        out[(arch, form)] = compiled_bundle(CompileOptions(main, draft, path,
                                                           kv_budget_mb=TEST_KV_MB))
    return out


@pytest.fixture(scope="session")
def self_bundle(fixture_pairs, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, main.onnx): the llama fixture with itself as the draft (every draft token is
    accepted; its cache geometry is the main's, so it reads the main's cache)."""
    main, _ = fixture_pairs[("llama", "classic")]
    out = tmp_path_factory.mktemp("self") / "self.dsmodel"
    return compiled_bundle(CompileOptions(main, main, out, kv_budget_mb=TEST_KV_MB)), main


@pytest.fixture(scope="session")
def int4_self_bundle(fixture_pairs, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, main.onnx): the llama fixture with its own low-bit copy as the draft (`dsc
    quantize`, as samples/smollm2.py makes SmolLM2's: 4-bit projections with mins, an 8-bit
    head): a draft that reads the main's cache and runs its projections as MatMulInt4."""
    from dspark.compiler.quantize import quantize_file

    main, _ = fixture_pairs[("llama", "classic")]
    root = tmp_path_factory.mktemp("int4self")
    quantize_file(main, root / "draft.onnx")
    out = root / "int4self.dsmodel"
    return (compiled_bundle(CompileOptions(main, root / "draft.onnx", out,
                                           kv_budget_mb=TEST_KV_MB)), main)


@pytest.fixture(scope="session")
def smollm2_pair() -> Path:
    """The README's sample: SmolLM2-135M-Instruct fp32 main + int4 draft (cached in build/),
    made as a user makes it: samples/smollm2.py, run."""
    from script_runner import run_script

    out = BUILD / "smollm2"
    run_script("samples/smollm2.py", "--out", out, check=True)
    return out


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_pair, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2") / "smollm2.dsmodel"
    return compiled_bundle(CompileOptions(smollm2_pair / "main.onnx",
                                          smollm2_pair / "draft.onnx", path))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def tok_bundle(fixture_pairs, tmp_path_factory) -> Path:
    """The llama fixture with a small word-level tokenizer and a chat template."""
    return _tok_bundle(fixture_pairs, tmp_path_factory.mktemp("tok"), "llama")


@pytest.fixture(scope="session")
def gpt2_tok_bundle(fixture_pairs, tmp_path_factory) -> Path:
    """The same for gpt2 (learned positions, no rotary tables), at 2048 positions."""
    return _tok_bundle(fixture_pairs, tmp_path_factory.mktemp("tok-gpt2"), "gpt2", 2048)


def _tok_bundle(fixture_pairs, root: Path, arch: str, max_seq_len: int = 64) -> Path:
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(300)}
    words.update({"<user>": 300, "<assistant>": 301, "hello": 302, "world": 303,
                  "<system>": 304})
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"<[a-z]+>"), behavior="isolated")])
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template":
                                                                    CHAT_TEMPLATE}))
    main, draft = fixture_pairs[(arch, "classic")]
    out = root / "tok.dsmodel"
    return compiled_bundle(CompileOptions(main, draft, out, tokenizer=root / "tok",
                                          max_seq_len=max_seq_len, kv_budget_mb=TEST_KV_MB))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly, with the reason, where there is no CUDA device."""
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where the kernel tests run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if CUDA else torch.device("cpu")


@pytest.fixture(scope="session")
def json_bundles(fixture_pairs, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every fixture pair with a byte-level BPE tokenizer (fits their 320 ids) that can spell
    any JSON, an EOS token and a chat template: structured output on random models."""
    import json

    from model_fixtures import json_tokenizer

    root = tmp_path_factory.mktemp("json")
    (root / "tok").mkdir()
    json_tokenizer().save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<eos>"}))
    return {(arch, form): compiled_bundle(CompileOptions(
        main, draft, root / f"json-{arch}-{form}.dsmodel", tokenizer=root / "tok",
        max_seq_len=1024, kv_budget_mb=TEST_KV_MB))
        for (arch, form), (main, draft) in fixture_pairs.items() if arch in ("llama", "gpt2")}


@pytest.fixture(scope="session")
def json_bundle(json_bundles) -> Path:
    """The llama (classic export) one of them."""
    return json_bundles[("llama", "classic")]
