"""flexspec.lang.spec: a checked spec's text, equality and repr (its IR is tested through the
checker, tests/lang/test_checker.py)."""

from __future__ import annotations

import pickle

import flexspec

MODEL = "mask local(n: int = 1024) = causal & window(n)\nspec near = local(8) + alibi\n"


def test_the_repr_of_a_registry_spec_makes_it_again():
    spec = flexspec.parse("causal&window(128)+alibi")
    assert repr(spec) == "flexspec.parse('causal & window(128) + alibi')"
    assert eval(repr(spec), {"flexspec": flexspec}) == spec


def test_the_repr_of_a_spec_from_an_attn_file_names_the_file(tmp_path, monkeypatch):
    """Red-team finding: `repr(lib["near"])` was `Spec('local(8) + alibi')`, which pasted back
    fails (`local` is defined in the file) and is no call of Spec."""
    (tmp_path / "model.attn").write_text(MODEL, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    library = flexspec.load("model.attn")
    for spec in (library["near"], flexspec.parse("local(4) & doc", library=library)):
        text = str(spec)
        assert repr(spec) == f"flexspec.parse({text!r}, library=flexspec.load('model.attn'))"
        assert eval(repr(spec), {"flexspec": flexspec}) == spec


def test_the_repr_of_a_spec_from_attn_text_says_where_its_names_are():
    library = flexspec.loads(MODEL, "mine.attn")
    assert repr(library["near"]) == \
        "<Spec 'local(8) + alibi', names resolved in the .attn text 'mine.attn'>"


def test_where_names_resolved_is_not_part_of_what_a_spec_means():
    library = flexspec.loads("spec plain = causal & window(3)\n", "mine.attn")
    spec = library["plain"]
    assert spec == flexspec.parse("causal & window(3)")
    assert hash(spec) == hash(flexspec.parse("causal & window(3)"))
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert repr(pickle.loads(pickle.dumps(spec))) == repr(spec)
