"""optimum's own exports (`optimum-cli export onnx --task text-generation-with-past`, in its
venv with transformers 4), as users bring them: each compiles with its windows read off the
running model and verifies against the original at every position up to the bundle's last."""

from __future__ import annotations

import numpy as np
import pytest
from arch_fixtures import OPTIMUM_ARCHS, build_optimum_exports
from lossless import assert_greedy_like_original

from dspark.compiler.compile import CompileOptions
from dspark.compiler.reference import OriginalModel
from dspark.compiler.verify import verify_model
from dspark.runtime.bundle.bundle import open_bundle

from bundle_cache import compiled


@pytest.fixture(scope="module")
def exports():
    from conftest import BUILD

    return build_optimum_exports(BUILD)


@pytest.mark.parametrize("arch", list(OPTIMUM_ARCHS))
def test_an_optimum_export_compiles_and_verifies(exports, arch, tmp_path):
    bundle = open_bundle(compiled(CompileOptions(exports[arch], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=512, kv_budget_mb=8)))
    assert tuple(bundle.model("main").windows) == OPTIMUM_ARCHS[arch]
    report = verify_model(bundle, "main", exports[arch], seqs=3, steps=3)
    assert report.ok(1e-3) and report.longest == 512, report
    assert report.max_abs_diff <= 1e-3 and report.argmax_agree == 1.0, report


@pytest.mark.parametrize("arch", list(OPTIMUM_ARCHS))
def test_an_optimum_export_generates_its_own_greedy_tokens(exports, arch, tmp_path):
    """Batched, plain and with lookup drafts: the original's greedy tokens (a near-tie fork
    forgiven). Qwen 3 MoE runs experts that no token of a forward picked (empty tensors)."""
    bundle = open_bundle(compiled(CompileOptions(exports[arch], None, tmp_path / "b.dsmodel",
                                                 max_seq_len=512, kv_budget_mb=8)))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (1, 5, 13, 40)]
    assert_greedy_like_original(bundle, OriginalModel(exports[arch]), prompts)
