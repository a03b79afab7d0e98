"""The documentation's relative links lead somewhere: every linked file exists and every
``#anchor`` names a heading of the page it points to (GitHub's anchor rules)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(p for p in ROOT.rglob("*.md") if not {".venv", "node_modules", "var"} & set(p.parts))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", flags=re.S)


def _anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: Path):
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert broken == []


def test_the_readme_layout_names_what_is_in_the_tree():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    named = re.findall(r"^(\S+)/\s", layout.split("```")[1], flags=re.M)
    assert named, "the layout block names the top-level folders"
    assert [n for n in named if not (ROOT / n).is_dir()] == []


def test_every_test_the_security_page_names_exists():
    """docs/security.md says which test covers each class of attack: each named test is
    there, so a renamed or deleted test cannot leave a claim behind."""
    page = (ROOT / "docs" / "security.md").read_text()
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)", page))
    assert len(named) >= 15, "the page names the tests that cover each class"
    missing = [
        f"{path}::{name}"
        for path, name in sorted(named)
        if not (ROOT / path).exists()
        or not re.search(rf"^(?:async )?def {name}\(", (ROOT / path).read_text(), flags=re.M)
    ]
    assert missing == []
