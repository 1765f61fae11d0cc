"""The README as a newcomer reads it: its offline code blocks run as written, and its links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- README test: runs offline -->"


def offline_blocks() -> list[str]:
    """The code of every block that follows the marker (the blocks that need nothing from the network)."""
    return re.findall(re.escape(MARKER) + r"\s*```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_marked_blocks_are_found():
    text = README.read_text()
    assert len(offline_blocks()) == text.count(MARKER) >= 1


@pytest.mark.parametrize("index", range(len(offline_blocks())))
def test_an_offline_readme_block_runs_as_written(index, tmp_path):
    """As `python -c BLOCK` in a process of its own, forked from one that imported torch, transformers and
    trl_vapo (`_script_process.run_code`: a fresh interpreter spent most of the test on those imports), offline as the
    tests' processes are (conftest.py)."""
    from _script_process import run_code

    result = run_code(offline_blocks()[index], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_within_the_readme_leads_to_a_heading():
    text = README.read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and not links - anchors, sorted(links - anchors)
