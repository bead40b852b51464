"""The README is the first screen and docs/ holds the reference: every page is reachable and every link lands."""

import re
from pathlib import Path

from tests.helpers import ROOT

# A newcomer reads the README on a few screens; reference material belongs in docs/.
README_MAX_BYTES = 10_000
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list:
    """The lines outside fenced code blocks (a `# comment` in a bash block is not a heading)."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, -1 on repeats."""
    seen, found = {}, set()
    for line in _prose(text):
        heading = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list:
    """Each relative link of `page` whose file is missing, or whose #anchor is no heading of that file."""
    broken = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto: — not checked offline
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def _pages() -> list:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_lands():
    assert len(_pages()) > 3, "docs/ holds the reference pages"
    assert [b for page in _pages() for b in broken_links(page)] == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    orphans = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert orphans == []


def test_readme_stays_a_first_screen():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move reference material into docs/"


def test_the_link_check_catches_a_planted_break(tmp_path):
    """Negative control: a missing file, a wrong anchor and a heading inside a code block are all reported."""
    (tmp_path / "other.md").write_text(
        "# Memory: will it fit?\n\n## `finetune plan`\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#memory-will-it-fit) [ok](other.md#finetune-plan) [web](https://example.com)\n"
                    "[gone](missing.md) [bad](other.md#memory) [fenced](other.md#not-a-heading)\n"
                    "```\n[inside a code block](missing-too.md)\n```\n")
    assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#memory (no such heading)",
                                  "page.md: other.md#not-a-heading (no such heading)"]
    assert anchors("# A\n# A\n## What \"the same step\" means, and how\n") == {"a", "a-1",
                                                                                "what-the-same-step-means-and-how"}
