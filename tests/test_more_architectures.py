"""Architectures beyond the fixture pairs, as users bring them (transformers' own modelling
code, the classic exporter): each compiles with every attention a SpeculativeVerify node and
its logits the original's at every position up to the bundle's last, window crossings
included (`dsc verify`'s check)."""

from __future__ import annotations

import pytest
from arch_fixtures import MORE_ARCHS, build_more_archs

from dspark.compiler.compile import CompileOptions
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle

from bundle_cache import compiled
from model_fixtures import SLIDING_WINDOW

LAYERS = {"smollm3": 4}
WINDOWED = {"gemma2": (SLIDING_WINDOW, 0, SLIDING_WINDOW)}  # Gemma 2: every other layer


@pytest.fixture(scope="module")
def mains():
    from conftest import BUILD

    return build_more_archs(BUILD)


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_it_compiles_and_verifies_exactly(mains, arch, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(mains[arch], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=512, kv_budget_mb=8)))
    spec = bundle.model("main")
    assert len(spec.verify_ops) == LAYERS.get(arch, 3)
    assert tuple(spec.windows) == WINDOWED.get(arch, (0,) * LAYERS.get(arch, 3))
    report = verify_model(bundle, "main", mains[arch], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 512, report
    assert report.max_abs_diff <= 1e-3 and report.argmax_agree == 1.0, report
