"""How the packages depend on each other: no import cycle between packages (module-level
imports; a package is compiler.passes, runtime.bundle, ..., or a top-level module such as
runtime.errors), and the compiler reaches the runtime only through its data (bundle, spec,
config), its models and `runtime.api`, never runtime.cli or runtime.engine."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("compiler", "runtime", "kernels")


def _imports(path: Path, function_level: bool) -> list[str]:
    """The dspark modules `path` imports (without the `dspark.` prefix)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if function_level else tree.body
    return [n.module.removeprefix("dspark.") for n in nodes
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("dspark.")]


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            source = _package(".".join(path.relative_to(ROOT).with_suffix("").parts))
            edges[source] |= {t for m in _imports(path, False)
                              if (t := _package(m)) != source}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_package_level_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_the_compiler_uses_the_runtimes_public_api():
    reached = {(str(path.relative_to(ROOT)), m) for path in (ROOT / "compiler").rglob("*.py")
               for m in _imports(path, True)
               if m.startswith(("runtime.cli", "runtime.engine"))}
    assert not reached, sorted(reached)


SCRIPT_FOLDERS = ("samples", "bench", "tools")


def test_every_script_is_listed_in_its_folders_readme():
    for folder in SCRIPT_FOLDERS:
        readme = (ROOT / folder / "README.md").read_text()
        scripts = [p.name for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".c")]
        assert scripts, folder
        missing = [name for name in scripts if f"`{name}`" not in readme]
        assert not missing, f"{folder}/README.md does not list {missing}"


def test_no_test_imports_a_script():
    """Scripts are run, not imported: a test that needs one runs it (a subprocess)."""
    scripts = {p.stem for folder in SCRIPT_FOLDERS for p in (ROOT / folder).glob("*.py")}
    for path in (ROOT / "tests").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for alias in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not names & scripts, f"{path.name} imports {sorted(names & scripts)}"
        text = path.read_text()
        assert not any(f'ROOT / "{folder}"))' in text for folder in SCRIPT_FOLDERS), (
            f"{path.name} puts a script folder on sys.path")


def test_dsruns_command_line_imports_no_torch_before_it_reruns_itself():
    """dsrun re-runs itself with glibc's tunables (runtime/cli/util.py) once its module is
    imported: torch imported there would be imported twice (~2.4 s a command)."""
    import subprocess
    import sys

    code = ("import sys, dspark.runtime.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnxruntime')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout
