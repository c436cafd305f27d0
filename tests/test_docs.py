"""The README and docs/ link only to files inside the repository, and every link resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def links(page):
    return LINK.findall(page.read_text())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(page):
    for target in links(page):
        path = target.split("#", 1)[0]
        assert "://" not in target, f"{page.name} links outside the repository: {target}"
        if not path:
            continue
        resolved = (page.parent / path).resolve()
        assert resolved.is_relative_to(ROOT), f"{page.name} links above the repository: {target}"
        assert resolved.exists(), f"{page.name} links to a missing file: {target}"


def test_every_docs_page_is_reachable_from_the_readme():
    reachable, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        for target in links(page):
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if path.suffix == ".md" and path.exists() and path not in reachable:
                reachable.add(path)
                todo.append(path)
    missing = [p.name for p in PAGES[1:] if p.resolve() not in reachable]
    assert not missing, f"docs pages no link reaches from the README: {missing}"


def _render(reports: Path, page: str, tmp_path: Path) -> str:
    """bench/report_benchmarks.py run on `page` (a copy) with the reports in `reports`."""
    from script_runner import run_script

    out = tmp_path / "page.md"
    out.write_text(page)
    done = run_script("bench/report_benchmarks.py", "--reports", reports, "--out", out,
                      capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def _sections(page: str) -> dict[str, list[str]]:
    found, heading = {}, None
    for line in page.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            found[heading] = []
        elif heading is not None:
            found[heading].append(line)
    return found


def test_a_partial_benchmark_rerun_keeps_the_other_sections(tmp_path):
    """bench/report_benchmarks.py rewrites the sections whose report is there and keeps the
    page's others as they stand (each names the revision it measured)."""
    import json

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    reports = tmp_path / "reports"
    reports.mkdir()
    assert _render(reports, page, tmp_path).strip() == page.strip()
    (reports / "gemma3_bench.json").write_text(json.dumps({
        "cpu": "CPU Test", "revision": "abc1234", "classes": [
            {"class": "chat", "tps_plain": 10.0, "tps_spec": 20.0, "speedup": 2.0,
             "acceptance_rate": 0.5, "c": 0.3, "identical": True}]}))
    new = _sections(_render(reports, page, tmp_path))
    old = _sections(page)
    gemma = next(h for h in old if h.startswith("Gemma 3 270M: speculation"))
    assert "| chat | 10.0 | 20.0 | 2.00x | 0.50 | 0.30 | yes |" in new[gemma]
    assert "CPU Test; measured at abc1234" in new[gemma]
    assert all(new[h] == old[h] for h in old if h != gemma)
    (reports / "gemma3_bench.json").unlink()
    assert "Not run for this page." in _render(reports, "", tmp_path)
