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
