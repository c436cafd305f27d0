"""samples/peer_setup.py's choice of llama.cpp build: with dsrun forced to its AVX2 path the
peer runs a build without AVX-512, so both engines run what an AVX2-only CPU would."""

from __future__ import annotations

import pytest

setup = pytest.importorskip("peer_setup")


def test_the_forced_avx2_path_runs_llama_cpp_built_without_avx512(monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_ISA", "AVX2 ")
    assert setup.llama_target() == "avx2"
    assert setup.llama_bin().parent.name == "build-avx2"
    flags = setup.LLAMA_BUILDS["avx2"]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=OFF" in flags
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags


@pytest.mark.parametrize("isa", [None, "avx512_vnni", "generic"])
def test_other_runs_use_the_native_build(monkeypatch, isa):
    if isa is None:
        monkeypatch.delenv("DSPARK_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("DSPARK_CPU_ISA", isa)
    assert setup.llama_target() == "native"
    assert setup.llama_bin().parent.name == "build"
    assert "-DGGML_NATIVE=ON" in setup.LLAMA_BUILDS["native"]
