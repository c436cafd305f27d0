"""Running a click CLI so users see one clear line, never a traceback.

Usage errors and DSparkError exit 2 with `prog: error: ...`; an interrupt exits 130; anything
unexpected is an internal error (exit 1), with the traceback only under DSPARK_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
import traceback

import click

from dspark.runtime.env import hugepage_env, read_env
from dspark.runtime.errors import DSparkError


def fail(prog: str, message: str, code: int) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def with_hugepages() -> None:
    """Re-run this command line with glibc's huge-page tunable set (see env.hugepage_env);
    returns only if it is set already or not wanted."""
    env = hugepage_env()
    if env is None or not sys.executable:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot re-run (an embedded interpreter): run without, only slower
        return


def run_cli(command: click.Command, prog: str, args: list[str] | None = None) -> None:
    try:
        result = command.main(args=args, prog_name=prog, standalone_mode=False)
    except click.exceptions.Abort:
        fail(prog, "interrupted", 130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DSparkError as e:
        fail(prog, str(e), e.exit_code)
    except KeyboardInterrupt:
        fail(prog, "interrupted", 130)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        if read_env().debug:
            traceback.print_exc()
        fail(prog, f"internal error: {type(e).__name__}: {e} (DSPARK_DEBUG=1 for details)", 1)
    sys.exit(result if isinstance(result, int) else 0)
