"""The upstream workarounds table (flexspec/workarounds.py): every entry is cited where the code
applies it and names a test that exists, every citation names an entry, and no other module of
the package names a GPU or a library version (they belong to the table, or to docs/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from flexspec.workarounds import WORKAROUNDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexspec"
TABLE = PACKAGE / "workarounds.py"
CITATION = re.compile(r"flexspec\.workarounds:?\s+([a-z0-9-]+)")
# GPU models and versioned library names: lab notes, whose place is the table or docs/
LAB_NOTE = re.compile(r"\b(?:[ABH]\d{2,3}|GB\d{3}|L40S?|RTX ?\d{4})\b|"
                      r"\b(?:torch|triton|FA4|CuTeDSL|transformers|flash-attn-4|cuDNN)[ ']?s?"
                      r"\s+\d+\.\d+|\b\d+\.\d+\.\d+(?:b|rc|a)\d+\b", re.IGNORECASE)


def _package_sources():
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE}


def _cited() -> dict:
    """Entry name -> the modules that cite it, in comments, docstrings or messages (adjacent
    string literals and comment lines joined)."""
    cited: dict = {}
    for path, text in _package_sources().items():
        text = re.sub(r'"\s*\n\s*f?"', "", text)
        for match in CITATION.finditer(re.sub(r"\n\s*#?", " ", text)):
            cited.setdefault(match.group(1), []).append(path.relative_to(ROOT))
    return cited


def test_every_entry_is_cited_and_every_citation_is_an_entry():
    cited = _cited()
    assert sorted(set(cited) - set(WORKAROUNDS)) == []
    assert sorted(set(WORKAROUNDS) - set(cited)) == []


@pytest.mark.parametrize("name", sorted(WORKAROUNDS))
def test_each_entry_names_a_test_that_exists(name):
    entry = WORKAROUNDS[name]
    assert entry.name == name and entry.library and entry.seen and entry.symptom and entry.remedy
    path, test = entry.test.split("::")
    source = (ROOT / path).read_text()
    functions = {node.name for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef)}
    assert test in functions, f"{entry.test} does not exist"


def test_no_module_but_the_table_names_a_gpu_or_a_library_version():
    found = {str(path.relative_to(ROOT)): sorted({m.group(0) for m in LAB_NOTE.finditer(text)})
             for path, text in _package_sources().items() if LAB_NOTE.search(text)}
    assert found == {}


def test_the_lab_note_pattern_finds_what_it_is_for():
    # the check above can fail: these are the kinds of note it keeps out of the code
    for note in ("on an H200", "torch 2.13's compiled kernel", "FA4 4.0.0b36", "CuTeDSL 4.8.1",
                 "flash-attn-4 4.0.0b36", "an A100", "triton 3.6"):
        assert LAB_NOTE.search(note), note
    for fine in ("Hopper or Blackwell", "int32", "H = 8", "version 2", "block 128"):
        assert not LAB_NOTE.search(fine), fine
