"""bench/peer_setup.py's choice of llama.cpp build, asked as the benchmark runs it: with
dsrun forced to its AVX2 path the peer runs a build without AVX-512, so both engines run what
an AVX2-only CPU would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_runner import run_script


def _build(isa: str | None, monkeypatch) -> dict:
    monkeypatch.delenv("DSPARK_CPU_ISA", raising=False)
    done = run_script("bench/peer_setup.py", "llama-build", check=True, capture_output=True,
                      text=True, env={"DSPARK_CPU_ISA": isa} if isa is not None else None)
    return json.loads(done.stdout)


def test_the_forced_avx2_path_runs_llama_cpp_built_without_avx512(monkeypatch):
    build = _build("AVX2 ", monkeypatch)
    assert build["target"] == "avx2" and Path(build["bin"]).parent.name == "build-avx2"
    assert "-DGGML_NATIVE=OFF" in build["flags"] and "-DGGML_AVX512=OFF" in build["flags"]
    assert "-DGGML_AVX2=ON" in build["flags"] and "-DGGML_FMA=ON" in build["flags"]


@pytest.mark.parametrize("isa", [None, "avx512_vnni", "generic"])
def test_other_runs_use_the_native_build(isa, monkeypatch):
    build = _build(isa, monkeypatch)
    assert build["target"] == "native" and Path(build["bin"]).parent.name == "build"
    assert "-DGGML_NATIVE=ON" in build["flags"]
