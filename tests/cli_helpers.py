"""Run the CLIs in-process exactly as their console scripts do, capturing exit code and output."""

from __future__ import annotations

from dataclasses import dataclass

import click
import pytest

from dspark.compiler.cli import cli
from dspark.runtime.cli.util import run_cli


@dataclass
class Result:
    code: int
    out: str
    err: str


def _run(capsys: pytest.CaptureFixture, command: click.Command, prog: str, args) -> Result:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(command, prog, [str(a) for a in args])
    captured = capsys.readouterr()
    return Result(int(exc.value.code or 0), captured.out, captured.err)


def run_dsc(capsys: pytest.CaptureFixture, *args: str) -> Result:
    return _run(capsys, cli, "dsc", args)


def run_dsrun(capsys: pytest.CaptureFixture, *args: str) -> Result:
    from dspark.runtime.cli.main import cli as dsrun_cli

    return _run(capsys, dsrun_cli, "dsrun", args)
