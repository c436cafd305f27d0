"""DSpark Triton kernels against their torch references: under Triton's interpreter on the
CPU (small shapes: it costs about a millisecond per program), compiled on the GPU when the
machine has one (the same tests, `kernel_device`)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from dspark.kernels.kv_cache import kv_inject, kv_inject_reference, kv_zero, kv_zero_reference
from dspark.kernels.library import KernelLibrary
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


def _batch(rng, spec: KernelSpec, window: int, num_blocks: int = 48, long: bool = False):
    """Three sequences: odd cached lengths, partially filled last blocks, interleaved blocks
    (`long`: one of them long enough for its blocks to be split over programs)."""
    bs = spec.block_size
    starts = [int(rng.integers(0, 2 * bs)) for _ in range(3)]
    if long:
        starts[1] += 9 * bs
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


def _seeded(*case) -> tuple[np.random.Generator, torch.Generator]:
    """Generators seeded by the test case itself, the same in every process (hash() of a
    str is salted per process)."""
    seed = zlib.crc32(repr(case).encode())
    return np.random.default_rng(seed), torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("window", "splits"), [(1, 1), (8, 1), (21, 1), (1, 3), (8, 3)])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_verify_attention_matches_reference(geometry, window, splits, dtype, kernel_device,
                                           tmp_path):
    """splits 3: one sequence's blocks are split over programs (flash-decoding) and the
    partial results combined by the reduce kernel."""
    head_dim, heads, kv_heads = geometry
    block = 32 if head_dim == 20 else 16
    spec = KernelSpec(head_dim, heads, kv_heads, block, dtype, q_tile=8)
    rng, gen = _seeded(geometry, window, splits, dtype)
    tables, start, new, qoff, tokens = _batch(rng, spec, window, long=splits > 1)
    t = DTYPES[dtype]
    dev = kernel_device
    k = torch.randn(48, kv_heads, block, head_dim, generator=gen).to(dev, t)
    v = torch.randn(48, kv_heads, block, head_dim, generator=gen).to(dev, t)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dev, t)
    tables, start, new, qoff = (x.to(dev) for x in (tables, start, new, qoff))
    scale = head_dim ** -0.5
    library = KernelLibrary(spec, str(tmp_path), interpret=dev.type == "cpu")
    got = verify_attention(q, k, v, tables, start, new, qoff, scale, library, splits=splits)
    want = verify_attention_reference(q, k, v, tables, start, new, qoff, scale)
    assert_close(got, want, TOLERANCE[dtype])


@pytest.mark.parametrize(("span", "splits"), [(5, 1), (20, 1), (5, 3), (40, 3)])
@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=lambda g: f"d{g[0]}h{g[1]}kv{g[2]}")
def test_verify_attention_honours_a_sliding_window(geometry, span, splits, kernel_device,
                                                   tmp_path):
    """A sliding-window layer: each query sees the last `span` keys up to itself; blocks
    wholly before a tile's window are skipped, and a split holding none of them weighs
    nothing in the reduce."""
    head_dim, heads, kv_heads = geometry
    spec = KernelSpec(head_dim, heads, kv_heads, 16, "float32", q_tile=8)
    rng, gen = _seeded("span", geometry, span, splits)
    tables, start, new, qoff, tokens = _batch(rng, spec, 8, long=splits > 1)
    dev = kernel_device
    k, v = (torch.randn(48, kv_heads, 16, head_dim, generator=gen).to(dev) for _ in range(2))
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dev)
    tables, start, new, qoff = (x.to(dev) for x in (tables, start, new, qoff))
    library = KernelLibrary(spec, str(tmp_path), interpret=dev.type == "cpu")
    got = verify_attention(q, k, v, tables, start, new, qoff, 0.25, library, splits=splits,
                           window=span)
    want = verify_attention_reference(q, k, v, tables, start, new, qoff, 0.25, span)
    assert_close(got, want, TOLERANCE["float32"])
    full = verify_attention_reference(q, k, v, tables, start, new, qoff, 0.25)
    assert not torch.allclose(got, full)  # the window cut something


@pytest.mark.parametrize(("span", "splits"), [(0, 1), (5, 1), (0, 3), (5, 3)])
def test_verify_attention_soft_caps_its_scores(span, splits, kernel_device, tmp_path):
    """Gemma 2's soft-cap, cap * tanh(score / cap), before the mask, in and out of a window
    and across splits; a small cap, so that it changes the output."""
    head_dim, heads, kv_heads = GEOMETRIES[0]
    spec = KernelSpec(head_dim, heads, kv_heads, 16, "float32", q_tile=8)
    rng, gen = _seeded("softcap", span, splits)
    tables, start, new, qoff, tokens = _batch(rng, spec, 8, long=splits > 1)
    dev = kernel_device
    k, v = (torch.randn(48, kv_heads, 16, head_dim, generator=gen).to(dev) for _ in range(2))
    q = 3 * torch.randn(tokens, heads, head_dim, generator=gen).to(dev)
    tables, start, new, qoff = (x.to(dev) for x in (tables, start, new, qoff))
    library = KernelLibrary(spec, str(tmp_path), interpret=dev.type == "cpu")
    got = verify_attention(q, k, v, tables, start, new, qoff, 0.25, library, splits=splits,
                           window=span, softcap=1.5)
    want = verify_attention_reference(q, k, v, tables, start, new, qoff, 0.25, span, 1.5)
    assert_close(got, want, TOLERANCE["float32"])
    uncapped = verify_attention_reference(q, k, v, tables, start, new, qoff, 0.25, span)
    assert not torch.allclose(got, uncapped, atol=1e-3)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_kv_inject_and_zero_match_reference(head_dim, dtype, kernel_device, tmp_path):
    spec = KernelSpec(head_dim, 6, 3, 16, dtype)
    t, dev = DTYPES[dtype], kernel_device
    _, gen = _seeded(head_dim, dtype)
    k_pool = torch.randn(10, 3, 16, head_dim, generator=gen).to(dev, t)
    v_pool = torch.randn(10, 3, 16, head_dim, generator=gen).to(dev, t)
    pools = [k_pool, v_pool, k_pool.clone(), v_pool.clone()]
    k_new = torch.randn(7, 3, head_dim, generator=gen).to(dev, t)
    v_new = torch.randn(7, 3, head_dim, generator=gen).to(dev, t)
    block = torch.tensor([3, 3, 8, 0, 9, 9, 2], dtype=torch.int32, device=dev)
    offset = torch.tensor([0, 1, 15, 7, 4, 5, 11], dtype=torch.int32, device=dev)
    library = KernelLibrary(spec, str(tmp_path), interpret=dev.type == "cpu")
    kv_inject(k_new, v_new, pools[0], pools[1], block, offset, library)
    kv_inject_reference(k_new, v_new, pools[2], pools[3], block, offset)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    kv_zero(pools[0], pools[1], block[:3], offset[:3], library)
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
    from dspark.runtime.bundle.bundle import open_bundle

    for path in compiled.values():
        bundle = open_bundle(path)
        for spec in bundle.models.values():
            ks = kernel_spec(spec, bundle.plan)
            for template in TEMPLATES:
                text = render(template, ks)
                compile(text, template, "exec")  # valid Python
                assert f"HEAD_DIM = tl.constexpr({ks.head_dim})" in text


def test_bundle_carries_cubins_per_arch(compiled):
    from dspark.kernels.aot import KERNELS
    from dspark.runtime.bundle.bundle import open_bundle, sha256_file

    bundle = open_bundle(compiled[("llama", "classic")])
    index = bundle.kernels
    assert index["mode"] == "aot" and index["archs"] == ["sm_80", "sm_90"]
    assert bundle.manifest.kernels["archs"] == ["sm_80", "sm_90"]
    [entry] = index["specs"].values()  # main and draft share one geometry
    assert sorted(entry["roles"]) == ["draft", "main"]
    for arch in ("sm_80", "sm_90"):
        assert set(entry["cubins"][arch]) == set(KERNELS)
        for built in entry["cubins"][arch].values():
            cubin = bundle.root / "kernels" / bundle.kernel_spec("main").tag / built["cubin"]
            assert cubin.read_bytes()[:4] == b"\x7fELF" and sha256_file(cubin) == built["sha256"]
    for source in entry["sources"]:
        compile((bundle.root / source).read_text(), source, "exec")


def test_toolchain_failure_leaves_a_jit_only_bundle(fixture_pairs, tmp_path, capsys,
                                                    monkeypatch):
    """A real Triton failure (an arch it cannot target), then --no-aot: the bundle still
    compiles, says JIT-only and why, and dsc inspect shows it."""
    from dspark.compiler import kernel_stage
    from dspark.runtime.bundle.bundle import open_bundle

    from cli_helpers import run_dsc

    main, draft = fixture_pairs[("gpt2", "classic")]
    monkeypatch.setattr(kernel_stage, "ARCHS", (20,))
    r = run_dsc(capsys, "compile", str(main), str(draft), "-o", str(tmp_path / "a.dsmodel"))
    assert r.code == 0 and "kernels: JIT-only bundle (Triton cannot compile" in r.err
    kernels = open_bundle(tmp_path / "a.dsmodel").manifest.kernels
    assert kernels["mode"] == "jit-only" and kernels["archs"] == []
    assert "Triton cannot compile for CUDA here" in kernels["reason"]
    r = run_dsc(capsys, "compile", str(main), str(draft), "-o", str(tmp_path / "b.dsmodel"),
                "--no-aot")
    assert r.code == 0
    r = run_dsc(capsys, "inspect", str(tmp_path / "b.dsmodel"))
    assert "kernels: jit-only (--no-aot)" in r.out
