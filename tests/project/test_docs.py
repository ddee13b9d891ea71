"""The README is a landing page and docs/ the pages behind it: every link lands, every file named exists.

Reads text only (no model, no torch): the README and every ``docs/*.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300  # a landing page: what, the two commands, one example, links

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# a path into the repository as prose names it: benchmarks/..., examples/..., autoprec/...
NAMED_PATH = re.compile(r"(?<![\w./-])((?:benchmarks|examples|autoprec)/[\w./-]*)")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def without_fences(text: str) -> str:
    """The page without its fenced blocks: a link inside a code block is code, not a link."""
    return FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but ``-`` and ``_``, spaces as ``-``."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", without_fences(page.read_text()), flags=re.MULTILINE)
    return {anchor(heading) for heading in headings}


def links(page: Path) -> list[str]:
    return LINK.findall(without_fences(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_lands(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page_id(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_named_path_exists(page):
    named = {match.rstrip(".,:;") for match in NAMED_PATH.findall(page.read_text())}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{page_id(page)} names files that do not exist: {missing}"


def test_readme_fits_on_a_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def set_up_commands(text: str) -> list[str]:
    """The fenced commands that go from nothing to a result: those that start by installing."""
    blocks = [block.strip() for block in FENCE.findall(text)]
    return [block for block in blocks if block.startswith("pip install")]


def test_readme_holds_exactly_two_commands():
    commands = set_up_commands(README.read_text())
    assert len(commands) == 2, f"README.md should hold exactly two set-up-to-result commands, found {commands}"
    tune, tests = commands
    assert "autoprec tune examples/" in tune, "the first command tunes a shipped example"
    assert (ROOT / tune.split("autoprec tune ")[1].split()[0]).exists()
    assert tests == 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command (its pip quieter): the two must not drift apart."""
    _, tests = set_up_commands(README.read_text())
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci
    assert tests.split(" && ", 1)[1].replace("pip install", "python -m pip install -q") in ci


def test_every_docs_page_is_in_the_index():
    index = DOCS / "README.md"
    linked = {(DOCS / target.partition("#")[0]).resolve() for target in links(index) if not target.startswith("#")}
    unlisted = [page.name for page in DOCS.glob("*.md") if page != index and page.resolve() not in linked]
    assert not unlisted, f"docs/README.md does not link: {unlisted}"
    assert "docs/README.md" in {target.partition("#")[0] for target in links(README)}
