"""The README and docs/ hold together: every relative link names a file that exists, and every
`page.md#anchor` a heading of that page (GitHub's anchors); the README stays short (the rest is
in docs/). Pure text, no Ray.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import REPO

pytestmark = pytest.mark.timeout(60)

README_MAX_LINES = 200
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where `[x](y)` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (code, links and emphasis reduced to
    their words), lowercased, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", text)):
        base = anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    """Each relative link of `page` whose file (or heading) does not exist, with why."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if EXTERNAL.match(target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif not linked.is_relative_to(repo.resolve()) and path:
            broken.append(f"{target}: outside the repository")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    return broken


def test_every_relative_link_resolves():
    broken = {str(page.relative_to(REPO)): broken_links(page) for page in pages()}
    broken = {page: links for page, links in broken.items() if links}
    assert not broken, f"broken links: {broken}"


def test_the_docs_have_their_pages_and_the_readme_links_them():
    docs = {page.name for page in pages()[1:]}
    assert {"README.md", "training.md", "config-reference.md", "security.md"} <= docs
    linked = set(LINK.findall(prose((REPO / "README.md").read_text())))
    unlinked = {name for name in docs if f"docs/{name}" not in linked}
    assert not unlinked, f"docs pages the README does not link: {sorted(unlinked)}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a missing file, a missing heading and a link outside the repository
    are reported; links in code, external links and good anchors are not."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "elsewhere.md").write_text("# x\n")
    (repo / "docs" / "page.md").write_text(
        "# A page\n\n## Train on a Ray cluster with `ray job submit`\n\n## Same\n\n## Same\n"
    )
    (repo / "README.md").write_text(
        "# t\n\n"
        "[ok](docs/page.md#train-on-a-ray-cluster-with-ray-job-submit) [dup](docs/page.md#same-1)\n"
        "[self](#t) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](docs/missing.md) [no heading](docs/page.md#nope)\n"
        "[out](../elsewhere.md)\n"
    )
    broken = broken_links(repo / "README.md", repo)
    assert [entry.split(":")[0] for entry in broken] == [
        "docs/missing.md",
        "docs/page.md#nope",
        "../elsewhere.md",
    ], broken
