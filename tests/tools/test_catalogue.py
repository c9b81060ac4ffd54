"""docs/patterns.md is generated from the registry; it must not go stale."""

from pathlib import Path

from flexspec.tools.catalogue import render_catalogue

PAGE = Path(__file__).resolve().parents[2] / "docs" / "patterns.md"


def test_catalogue_page_is_up_to_date():
    assert PAGE.read_text(encoding="utf-8") == render_catalogue(), (
        "docs/patterns.md is stale: run `python -m flexspec.tools.catalogue > /tmp/p.md && "
        "mv /tmp/p.md docs/patterns.md`")


def test_catalogue_lists_every_pattern():
    import flexspec

    page = PAGE.read_text(encoding="utf-8")
    for pattern in flexspec.patterns():
        assert f"## {pattern.name}\n" in page
        for reference in pattern.references:
            assert reference.url in page
