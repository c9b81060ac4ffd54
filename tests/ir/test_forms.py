"""Known forms read off the IR (flexspec.ir.forms)."""

import pytest

from flexspec import ir, parse
from flexspec.ir.forms import logit_factor
from flexspec.lang.library import load_text

LIBRARY = load_text("score halve = score / 2.0\nscore twice = 2 * score\n"
                    "score flip = score * -1.0\nscore shifted = score + 1.0\n")


@pytest.mark.parametrize("text, factor", [
    ("causal", 1.0), ("scale(0.5)", 0.5), ("halve + twice + scale(3.0)", 3.0),
    ("flip", None), ("scale(0.0)", None), ("shifted", None), ("softcap(5.0)", None),
    ("alibi", None),
])
def test_the_logit_times_a_positive_constant(text, factor):
    assert logit_factor(parse(text, library=LIBRARY).ir.score) == factor


def test_booleans_and_division_by_zero_are_not_factors():
    assert logit_factor(ir.Binary("*", ir.SCORE, ir.Const(True))) is None
    assert logit_factor(ir.Binary("/", ir.SCORE, ir.Const(0.0))) is None
    assert logit_factor(ir.Binary("*", ir.Const(1e308), ir.Binary("*", ir.SCORE,
                                                                    ir.Const(1e308)))) is None
