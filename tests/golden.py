"""Reading golden fixture files (tests/fixtures/*.txt): cases of input and expected lines,
separated by blank lines, ``#`` comments skipped."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def pairs(name: str) -> list[tuple[int, str, str]]:
    """``(line, input, expected)`` for every two-line case of ``tests/fixtures/NAME``."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    cases, block, start = [], [], 0
    for number, line in enumerate(lines + [""], start=1):
        if line.startswith("#"):
            continue
        if line.strip():
            start = start if block else number
            block.append(line.strip())
            continue
        if block:
            assert len(block) == 2, f"{name}:{start}: a case is two lines, got {block}"
            cases.append((start, block[0], block[1]))
            block = []
    return cases
