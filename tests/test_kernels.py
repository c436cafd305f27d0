"""DSpark Triton kernels against their torch references, under TRITON_INTERPRET=1 on the CPU
(small shapes: the interpreter costs about a millisecond per program). GPU runs are marked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.kernels.kv_cache import kv_inject, kv_inject_reference, kv_zero, kv_zero_reference
from dspark.kernels.render import TEMPLATES, render
from dspark.kernels.spec import KernelSpec
from dspark.kernels.verify_attention import verify_attention, verify_attention_reference

TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (head_dim, heads, kv heads): GQA groups 1, 3 and 4, an odd head_dim, SmolLM2's geometry
GEOMETRIES = [(16, 4, 4), (24, 6, 2), (20, 8, 2), (64, 9, 3)]


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """allclose that names the first mismatches."""
    diff = (got.float() - want.float()).abs()
    bad = diff > tol * (1 + want.float().abs())
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        rows = [f"  {tuple(i)}: got {got[tuple(i)].item():.6g} want {want[tuple(i)].item():.6g}"
                for i in idx]
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} differ (max {diff.max():.3g}, "
                             f"tolerance {tol}); first:\n" + "\n".join(rows))


def _batch(rng, spec: KernelSpec, window: int, num_blocks: int = 24):
    """Three sequences: odd cached lengths, partially filled last blocks, interleaved blocks."""
    bs = spec.block_size
    starts = [int(rng.integers(0, 2 * bs)) for _ in range(3)]
    news = [window, max(1, window - 1), window]
    need = [-(-(s + n) // bs) for s, n in zip(starts, news)]
    perm = rng.permutation(num_blocks)[: sum(need)]
    tables, pos = [], 0
    for n in need:
        tables.append(list(perm[pos:pos + n]) + [0] * (max(need) - n))
        pos += n
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    qoff = np.concatenate([[0], np.cumsum(news)[:-1]]).tolist()
    return i32(tables), i32(starts), i32(news), i32(qoff), sum(news)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("window", [1, 8, 21])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_verify_attention_matches_reference(geometry, window, dtype, tmp_path):
    head_dim, heads, kv_heads = geometry
    block = 32 if head_dim == 20 else 16
    spec = KernelSpec(head_dim, heads, kv_heads, block, dtype, q_tile=8)
    rng = np.random.default_rng(hash((geometry, window, dtype)) % 2**32)
    tables, start, new, qoff, tokens = _batch(rng, spec, window)
    t = DTYPES[dtype]
    k = torch.randn(24, kv_heads, block, head_dim).to(t)
    v = torch.randn(24, kv_heads, block, head_dim).to(t)
    q = torch.randn(tokens, heads, head_dim).to(t)
    scale = head_dim ** -0.5
    got = verify_attention(q, k, v, tables, start, new, qoff, scale, spec, str(tmp_path),
                           interpret=True)
    want = verify_attention_reference(q, k, v, tables, start, new, qoff, scale)
    assert_close(got, want, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_kv_inject_and_zero_match_reference(head_dim, dtype, tmp_path):
    spec = KernelSpec(head_dim, 6, 3, 16, dtype)
    t = DTYPES[dtype]
    k_pool, v_pool = torch.randn(10, 3, 16, head_dim).to(t), torch.randn(10, 3, 16, head_dim).to(t)
    pools = [k_pool, v_pool, k_pool.clone(), v_pool.clone()]
    k_new, v_new = torch.randn(7, 3, head_dim).to(t), torch.randn(7, 3, head_dim).to(t)
    block = torch.tensor([3, 3, 8, 0, 9, 9, 2], dtype=torch.int32)
    offset = torch.tensor([0, 1, 15, 7, 4, 5, 11], dtype=torch.int32)
    kv_inject(k_new, v_new, pools[0], pools[1], block, offset, spec, str(tmp_path),
              interpret=True)
    kv_inject_reference(k_new, v_new, pools[2], pools[3], block, offset)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    kv_zero(pools[0], pools[1], block[:3], offset[:3], spec, str(tmp_path), interpret=True)
    kv_zero_reference(pools[2], pools[3], block[:3], offset[:3])
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert not pools[0][3, :, 0].any() and pools[0][3, :, 2].any()


def test_rendering_is_a_pure_function_of_the_spec():
    spec = KernelSpec(64, 9, 3, 16)
    assert render("verify_attention", spec) == render("verify_attention", KernelSpec(64, 9, 3, 16))
    render.cache_clear()
    again = render("verify_attention", spec)
    assert again == render("verify_attention", spec) and "GROUP = tl.constexpr(3)" in again
    assert render("verify_attention", KernelSpec(64, 9, 3, 32)) != again


def test_templates_render_for_every_fixture_model(compiled):
    from dspark.compiler.kernel_stage import kernel_spec
    from dspark.runtime.bundle import open_bundle

    for path in compiled.values():
        bundle = open_bundle(path)
        for spec in bundle.models.values():
            ks = kernel_spec(spec, bundle.plan)
            for template in TEMPLATES:
                text = render(template, ks)
                compile(text, template, "exec")  # valid Python
                assert f"HEAD_DIM = tl.constexpr({ks.head_dim})" in text
