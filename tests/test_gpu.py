"""On a CUDA machine: the bundle's ahead-of-time cubins load and agree with JIT and the
reference, and the engine on the CUDA backend (onnxruntime CUDA EP + the kernels) is
lossless. Marked `gpu`: skipped cleanly, with the reason, without a CUDA device. The kernel
tests in test_kernels.py also run compiled on the GPU there (`kernel_device`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.compiler.reference import OriginalModel
from dspark.kernels.library import KernelLibrary, for_device
from dspark.kernels.verify_attention import verify_attention, verify_attention_reference
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.engine.engine import Engine
from dspark.runtime.model.device import cuda_problem
from dspark.runtime.sequence.request import GenerationRequest

pytestmark = pytest.mark.gpu


def test_bundle_cubins_load_and_match_jit(compiled, tmp_path):
    bundle = open_bundle(compiled[("llama", "classic")])
    spec = bundle.kernel_spec("main")
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    aot = for_device(spec, str(tmp_path), dev, bundle.kernels, bundle.root)
    expected = "cubin" if f"sm_{major}{minor}" in bundle.kernels["archs"] else "jit"
    assert aot.source == expected
    jit = KernelLibrary(spec, str(tmp_path))
    rng = torch.Generator().manual_seed(0)
    k = torch.randn(32, spec.num_kv_heads, spec.block_size, spec.head_dim, generator=rng)
    v = torch.randn(k.shape, generator=rng)
    q = torch.randn(9, spec.num_heads, spec.head_dim, generator=rng)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = [i32([[3, 7, 1, 0], [9, 4, 2, 5]]), i32([20, 41]), i32([4, 5]), i32([0, 4])]
    want = verify_attention_reference(q, k, v, *args, spec.head_dim ** -0.5)
    on = [x.to(dev) for x in (q, k, v, *args)]
    for library in (aot, jit):
        for splits in (1, 2):
            got = verify_attention(*on, spec.head_dim ** -0.5, library, splits=splits)
            assert (got.cpu() - want).abs().max() < 2e-5


@pytest.mark.skipif(cuda_problem() is not None, reason=str(cuda_problem()))
@pytest.mark.parametrize("pair", [("llama", "classic"), ("gpt2", "dynamo")],
                         ids=lambda p: "-".join(p))
def test_engine_on_cuda_is_lossless(fixture_pairs, compiled, pair):
    bundle = open_bundle(compiled[pair])
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (1, 5, 13, 34)]
    engine = Engine(bundle, "fixed", 4, max_batch=8, device="cuda")
    assert engine.arena.buffer.is_cuda
    seqs = engine.generate([GenerationRequest(tuple(p), 48, method="draft") for p in prompts])
    original = OriginalModel(fixture_pairs[pair][0])
    for p, seq in zip(prompts, seqs):
        assert seq.generated == original.greedy(p, 48)
    assert engine.arena.free_blocks == engine.plan.num_blocks
