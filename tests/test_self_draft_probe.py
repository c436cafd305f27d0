"""samples/self_draft_probe.py's fewer-bit rounding and bound (the probe itself needs the
Hugging Face folder bench_peers.py --setup writes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
probe = pytest.importorskip("self_draft_probe")


def test_rounding_keeps_each_block_on_its_grid():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    for bits in (2, 3):
        r = probe.round_bits(w, bits).reshape(6, 2, 32)
        b = w.reshape(6, 2, 32)
        assert all(len(torch.unique(block)) <= 2 ** bits for block in r.reshape(-1, 32))
        assert torch.allclose(r.min(-1).values, b.min(-1).values, atol=1e-6)
        assert torch.allclose(r.max(-1).values, b.max(-1).values, atol=1e-6)
        assert (r - b).abs().max() <= (b.max(-1).values - b.min(-1).values).max() / (2 ** bits - 1)


def test_weights_already_on_the_grid_stay():
    lo, scale = -0.3, 0.05
    levels = torch.randint(0, 8, (4, 32), generator=torch.Generator().manual_seed(1))
    levels[:, 0], levels[:, 1] = 0, 7  # each block spans the whole grid
    w = levels * scale + lo
    assert torch.allclose(probe.round_bits(w, 3), w, atol=1e-6)


def test_at_bits_restores():
    layers = torch.nn.ModuleList([torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(64, 4)])
    before = [m.weight.data.clone() for m in layers if isinstance(m, torch.nn.Linear)]
    saved = probe.at_bits(layers, 2)
    assert not torch.equal(layers[0].weight.data, before[0])
    for module, weight in saved:
        module.weight.data = weight
    assert all(torch.equal(m.weight.data, b)
               for m, b in zip([m for m in layers if isinstance(m, torch.nn.Linear)], before))


def test_bound_is_one_for_a_useless_draft_and_grows_with_acceptance():
    assert probe.bound(0.0, 0.0) == pytest.approx(1.0)
    assert probe.bound(0.9, 0.1) > probe.bound(0.5, 0.1) > 1.0
    assert probe.bound(0.5, 0.75) < 1.0
