"""docs/design.md stays true to the tree: every module path it names exists, every package
has a row in its parts table, and it cites nothing outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "src" / "lazytrain"


def test_every_module_path_the_design_doc_names_exists():
    text = DOC.read_text()
    names = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    assert len(names) > 30  # the concern table names most modules
    missing = sorted(n for n in names
                     if not (PACKAGE / n).is_file() and not (ROOT / n).is_file())
    assert not missing, f"docs/design.md names modules that do not exist: {missing}"


def test_every_package_has_a_row_in_the_parts_table():
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= rows, f"packages without a row: {sorted(packages - rows)}"


def test_the_design_doc_cites_no_file_outside_the_repository_and_no_issue():
    text = DOC.read_text()
    assert "../" not in text and "DESIGN.md" not in text and "STYLE.md" not in text
    assert not re.search(r"issue\s*#?\d|#\d+\b", text, flags=re.I)


def test_no_source_file_cites_a_file_outside_the_repository_or_an_issue_number():
    import re

    src = Path(__file__).resolve().parents[1] / "src" / "lazytrain"
    outside = re.compile(r"DESIGN\.md|STYLE\.md|PLANNER_NOTES|\.\./shared|hardware\.json"
                         r"|\bissue [0-9]|\(issue\b|TODO\(#")
    found = [f"{p.relative_to(src)}:{n}: {line.strip()}"
             for p in sorted(src.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not found, "\n".join(found)
