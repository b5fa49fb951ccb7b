"""What the project publishes reads as finished: no placeholder left unfilled in docs/ or the top-level documents,
and every markdown table renders whole."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCUMENTS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md"])
# A figure still to be filled in: __NEEDLE_WALL__, {{figure}}, <TODO>, TBD, XXX.
PLACEHOLDER = re.compile(r"__[A-Z][A-Z0-9_]*__|\{\{[^}]*\}\}|<TODO>|\bTBD\b|\bXXX\b")


def table_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every run of consecutive lines that start with ``|`` outside code blocks."""
    blocks: list[tuple[int, list[str]]] = []
    in_code, current, start = False, [], 0
    for number, line in enumerate(text.splitlines() + [""], start=1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            if not current:
                start = number
            current.append(line)
        elif current:
            blocks.append((start, current))
            current = []
    return blocks


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unfilled_placeholder(document: Path):
    found = [f"{document.name}:{n}: {m.group()}" for n, line in enumerate(document.read_text().splitlines(), start=1)
             for m in PLACEHOLDER.finditer(line)]
    assert not found, found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_starts_with_its_header(document: Path):
    """A table cut by a blank line renders its second half as plain text: each block of ``|`` lines must open with a
    header row and a ``|---|`` separator."""
    separator = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")
    text = document.read_text()
    above = {number: line for number, line in enumerate([""] + text.splitlines(), start=1)}  # the line before each
    # GitHub renders a header row without its leading pipe too: then the block opens with the separator
    cut = [f"{document.name}:{start}: {lines[0][:60]}" for start, lines in table_blocks(text)
           if not (len(lines) >= 2 and separator.match(lines[1]))
           and not (separator.match(lines[0]) and "|" in above[start])]
    assert not cut, cut


def test_the_checks_find_what_they_look_for():
    assert PLACEHOLDER.search("the needle another __NEEDLE_WALL__.") and not PLACEHOLDER.search("`__init__.py`")
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert [start for start, _ in table_blocks(cut)] == [1, 5]
