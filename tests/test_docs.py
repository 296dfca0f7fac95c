"""The documentation's links: every relative link in the repository's Markdown reaches a file, and every
``#anchor`` a heading of the file it names, as GitHub makes them (a retitled section breaks no link)."""

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: link text kept, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one gets -1, -2, ... as on GitHub."""
    found, seen = set(), Counter()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", path.read_text()), re.M):
        name = slug(heading)
        found.add(f"{name}-{seen[name]}" if seen[name] else name)
        seen[name] += 1
    return found


def markdown_files() -> list[Path]:
    """The project's own Markdown: not a hidden folder's (.venv, caches, a lease's carry) or a build's."""
    parts = (p.relative_to(ROOT).parts for p in ROOT.rglob("*.md"))
    return [ROOT.joinpath(*q) for q in parts if not any(x.startswith(".") or x == "artifacts" for x in q)]


def test_every_relative_link_reaches_its_file_and_heading():
    broken, checked = [], 0
    for path in markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", path.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto: (not reachable here)
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            dest = path.parent / file if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert checked > 100  # the links were found


def test_anchors_are_made_as_github_makes_them(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Where it stands\n## 2. All modes at one budget (CPU, 2–3 runs)\n# Where it stands")
    assert anchors(page) == {
        "where-it-stands",
        "where-it-stands-1",
        "2-all-modes-at-one-budget-cpu-23-runs",
    }
