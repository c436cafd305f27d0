"""The runtime as the compiler and other tools use it: a narrow public surface, so that
nothing outside the runtime reaches into runtime.cli or runtime.engine.

    run_cli(command, prog, args)   a click command run so that users see one clear line on
                                   an error (exit 2), never a traceback
    load_engine(bundle, ...)       a bundle's engine and tokenizer, ready to generate
                                   (imported when first called: `dsc --help` stays light)
"""

from __future__ import annotations

from dspark.runtime.cli.util import run_cli

__all__ = ["load_engine", "run_cli"]


def load_engine(*args, **kwargs):
    """runtime.engine.loader.load_engine (its arguments)."""
    from dspark.runtime.engine.loader import load_engine as load

    return load(*args, **kwargs)
