"""The checker: name resolution, kinds, arity, types, constraints, cycles, bindings, and the
``.attn`` library, through their error messages.

Most tests define what they need in ``.attn`` text (``flexspec.lang.library.load_text``), so they do
not depend on the registry's contents, which grow concurrently; tests of registry patterns skip
when the pattern is not there yet.
"""

from __future__ import annotations

import pytest

import flexspec
from flexspec import ir
from flexspec.errors import Source
from flexspec.lang import checker
from flexspec.lang.checker import check_definition
from flexspec.lang.definitions import Definition, ParamSpec, Scope
from flexspec.lang.library import check_text, load_text
from flexspec.lang.parser import parse_expr, parse_spec

# Helpers written in the language, in front of the registry.
HELPERS = """
mask local(n: int = 4) = abs(q - kv) <= n
mask lower = q >= kv
mask same(ids: int[B, KV_LEN]) = ids[b, q] == ids[b, kv]
mask flag(on: bool = true) = where(on, q >= kv, true)
mask per_head(lim: int[H]) = q - kv <= lim[h]
score cap(c: float = 50.0) = c * tanh(score / c)
score add1 = score + 1
score dbl = score * 2
score bias(w: float[H] = learnable(H, init="normal")) = score + w[h] * abs(q - kv)
score slope(s: float[H] = alibi_slopes(H)) = score - s[h] * abs(q - kv)
spec base = lower & local(8)
"""


@pytest.fixture(scope="module")
def lib():
    return load_text(HELPERS, "helpers.attn")


def check_error(text: str, lib=None) -> flexspec.SpecCheckError:
    with pytest.raises(flexspec.SpecCheckError) as info:
        flexspec.parse(text, library=lib)
    return info.value


def file_errors(text: str, name: str = "m.attn") -> list[flexspec.SpecError]:
    return check_text(text, name)


def one_file_error(text: str) -> flexspec.SpecError:
    errors = file_errors(text)
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


def needs(*names):
    """Skip unless the registry has these patterns (it is being filled concurrently)."""
    try:
        registry = flexspec.lang.registry.registry()
    except flexspec.SpecError as err:
        pytest.skip(f"the registry does not load: {err.message}")
    missing = [n for n in names if registry.scope.lookup(n) is None]
    if missing:
        pytest.skip(f"patterns not in the registry yet: {missing}")


# ---------------------------------------------------------------------------------------------
# Unknown names


def test_unknown_pattern_suggests_the_closest_name():
    needs("window")
    err = check_error("causal & windw(3)")
    assert err.message.startswith("unknown pattern 'windw'.")
    assert "Did you mean 'window'?" in err.message
    assert (err.line, err.column) == (1, 10)
    assert str(err).splitlines()[2] == "    " + " " * 9 + "^" * len("windw(3)")


def test_unknown_name_suggests_library_definitions(lib):
    err = check_error("locl(3)", lib)
    assert "Did you mean 'local'?" in err.message


def test_unknown_name_without_a_close_match():
    err = check_error("zzzzqqqq")
    assert err.message.startswith("unknown pattern 'zzzzqqqq'")
    assert "Did you mean" not in err.message


def test_unknown_name_in_a_definition_suggests_indices():
    err = one_file_error("mask a = q > kvv\n")
    assert "unknown name 'kvv'" in err.message and "Did you mean 'kv'?" in err.message
    assert (err.line, err.column) == (1, 14)


def test_unknown_name_in_a_definition_lists_what_is_in_scope():
    err = one_file_error("mask a = q > zzzzqqqq\n")
    assert "b h q kv" in err.message and "B H Q_LEN KV_LEN" in err.message


def test_unknown_function_suggests_a_function():
    err = one_file_error("mask a = absx(q - kv) < 3\n")
    assert "unknown function or pattern 'absx'" in err.message
    assert "'abs'" in err.message


def test_built_in_names_are_not_patterns():
    for name in ("q", "score", "abs", "KV_LEN"):
        err = check_error(name)
        assert "built-in name" in err.message, name


# ---------------------------------------------------------------------------------------------
# Kinds: masks join with & | ~, score modifiers with +


def test_score_modifier_in_a_mask_expression(lib):
    err = check_error("cap & lower", lib)
    assert "'cap' is a score modifier" in err.message
    assert "score modifiers join a spec with '+'" in err.message
    assert "'causal + cap'" in err.message
    assert err.column == 1


def test_score_modifier_under_not_and_or(lib):
    assert "'~'" in check_error("~cap(3.0)", lib).message
    assert "'|'" in check_error("lower | dbl", lib).message


def test_registry_softcap_and_causal():
    needs("softcap", "causal")
    err = check_error("softcap & causal")
    assert "score modifier" in err.message and "join a spec with '+'" in err.message


def test_spec_with_scores_inside_a_mask_expression(lib):
    err = check_error("(lower + cap) & local(3)", lib)
    assert "a spec with score modifiers" in err.message
    assert "after the masks" in err.message
    assert err.column == 2


def test_two_masks_in_a_plus_chain_suggest_and(lib):
    err = check_error("lower + local(3) + cap", lib)
    assert "at most one mask term" in err.message
    assert "combine masks with '&'" in err.message
    assert "'lower & local(3)'" in err.message
    assert err.column == 9


def test_a_named_spec_counts_as_the_mask_term(lib):
    err = check_error("base + lower", lib)
    assert "at most one mask term" in err.message


def test_score_only_spec_has_the_full_mask(lib):
    spec = flexspec.parse("cap(10.0)", library=lib)
    assert spec.ir.mask == ir.TRUE
    assert not spec.ir.has_mask and spec.ir.has_score


def test_scores_apply_left_to_right(lib):
    forward = flexspec.parse("lower + add1 + dbl", library=lib).ir
    backward = flexspec.parse("lower + dbl + add1", library=lib).ir
    score = ir.SCORE
    assert forward.score == ir.Binary("*", ir.Binary("+", score, ir.Const(1)), ir.Const(2))
    assert backward.score == ir.Binary("+", ir.Binary("*", score, ir.Const(2)), ir.Const(1))
    assert str(forward.score) == "(score + 1) * 2"


def test_mask_term_may_come_after_scores(lib):
    spec = flexspec.parse("add1 + lower", library=lib)
    assert spec.ir.mask == ir.Binary(">=", ir.Var("q"), ir.Var("kv"))


def test_named_spec_takes_no_arguments(lib):
    err = check_error("base(3)", lib)
    assert "named spec and takes no arguments" in err.message


# ---------------------------------------------------------------------------------------------
# Arguments: arity, keywords, types, constraints


def test_too_many_arguments(lib):
    err = check_error("local(1, 2)", lib)
    assert err.message == "'local' takes 1 argument: local(n: int = 4), but 2 were given"
    assert err.column == 10


def test_arguments_to_a_pattern_without_parameters(lib):
    err = check_error("lower(3)", lib)
    assert err.message == "'lower' takes no arguments, but 1 was given"


def test_missing_required_argument():
    lib = load_text("mask w(n: int) = abs(q - kv) <= n\n")
    err = check_error("w", lib)
    assert "'w' needs a value for 'n' (int)" in err.message
    assert "w(n: int)" in err.message
    assert "needs a value" in check_error("w()", lib).message


def test_unknown_keyword(lib):
    err = check_error("local(m=3)", lib)
    assert err.message.startswith("'local' has no parameter 'm'.")
    assert "local(n: int = 4)" in err.message
    assert err.column == 7


def test_keyword_given_twice(lib):
    assert "argument 'n' given twice" in check_error("local(n=3, n=4)", lib).message
    assert "argument 'n' given twice" in check_error("local(3, n=4)", lib).message


def test_positional_after_keyword():
    lib = load_text("mask two(a: int, c: int) = q - kv <= a + c\n")
    err = check_error("two(a=1, 2)", lib)
    assert "positional argument cannot follow a keyword argument" in err.message


def test_keyword_arguments(lib):
    assert flexspec.parse("local(n=3)", library=lib).ir == flexspec.parse("local(3)", library=lib).ir


def test_defaults(lib):
    assert flexspec.parse("local", library=lib).ir == flexspec.parse("local(4)", library=lib).ir


@pytest.mark.parametrize("text, got", [
    ("local(2.5)", "got a float"),
    ("local(true)", "got a bool"),
    ('local("four")', "got a string"),
    ("cap(true)", "got a bool"),
    ("flag(1)", "got an int"),
])
def test_argument_types(lib, text, got):
    err = check_error(text, lib)
    assert got in err.message
    assert "expects" in err.message


def test_int_argument_for_a_float_parameter_is_promoted(lib):
    as_int = flexspec.parse("lower + cap(30)", library=lib)
    as_float = flexspec.parse("lower + cap(30.0)", library=lib)
    assert as_int.ir == as_float.ir
    assert str(as_int) == "lower + cap(30)"  # the text stays as written


def test_bare_name_for_a_scalar_parameter(lib):
    err = check_error("local(x)", lib)
    assert "'x' is a bare name, which in a spec names a runtime tensor" in err.message
    assert "an int parameter" in err.message and "128" in err.message


def test_literal_for_a_tensor_parameter(lib):
    err = check_error("same(3)", lib)
    assert "expects a tensor" in err.message


def test_constraint_is_quoted():
    needs("window")
    err = check_error("window(-1)")
    assert "n >= 0" in err.message
    assert "n = -1" in err.message
    assert err.column == 8
    assert str(err).splitlines()[2] == "    " + " " * 7 + "^^"


def test_constraint_checked_in_definitions_too():
    needs("window")
    err = one_file_error("mask m = window(n=-2)\n")
    assert "n >= 0" in err.message and "n = -2" in err.message


def test_constraint_holds():
    needs("window")
    assert flexspec.parse("window(0)").ir.mask is not None


# ---------------------------------------------------------------------------------------------
# Definitions: bodies, types, cycles


def test_mask_body_must_be_boolean():
    err = one_file_error("mask a = q + kv\n")
    assert err.message == "mask 'a' must be a boolean expression, but its definition is an int"
    assert (err.line, err.column) == (1, 10)


def test_score_body_must_be_a_number():
    err = one_file_error("score s = score > 0\n")
    assert "score 's' must be a number" in err.message and "a bool" in err.message


def test_score_is_not_available_in_masks():
    err = one_file_error("mask a = score > 0\n")
    assert err.message == "'score' is only available in score definitions"
    assert err.column == 10


def test_score_modifier_is_not_available_in_masks():
    err = one_file_error("score s = score * 2\nmask a = s > 0\n")
    assert "'s' is a score modifier and can only be used in score definitions" in err.message
    assert err.line == 2


def test_named_spec_inside_a_definition():
    err = one_file_error("spec s = lower\nmask lower = q >= kv\nmask a = s\n")
    assert "'s' is a named spec" in err.message


def test_score_patterns_inside_score_definitions_apply_to_the_current_score(lib):
    lib2 = load_text("score capped_plus = cap(10.0) + 1\nspec s = capped_plus\n"
                     "score cap(c: float = 50.0) = c * tanh(score / c)\n")
    assert str(lib2["s"].ir.score) == "10.0 * tanh(score / 10.0) + 1"


def test_mask_patterns_inline_into_definitions():
    lib2 = load_text("mask lower = q >= kv\nmask band = lower & kv > q - 4\nspec s = band\n")
    assert str(lib2["s"].ir.mask) == "q >= kv & kv > q - 4"


def test_cycle_between_two_definitions():
    errors = file_errors("mask x = y\nmask y = x\n")
    assert errors, "a cycle must be an error"
    assert all("definitions refer to each other in a cycle" in e.message for e in errors)
    assert any("x -> y -> x" in e.message for e in errors)
    assert any("y -> x -> y" in e.message for e in errors)


def test_cycle_of_one():
    err = one_file_error("mask a = a | q > kv\n")
    assert "cycle: a -> a" in err.message


def test_cycle_through_scores_and_specs():
    assert "cycle" in file_errors("score s1 = s2 + 1\nscore s2 = s1 * 2\n")[0].message
    assert "cycle" in file_errors("spec s = t\nspec t = s\n")[0].message


def test_load_text_raises_the_cycle():
    with pytest.raises(flexspec.SpecCheckError, match="cycle"):
        load_text("mask x = y\nmask y = x\nspec s = x\n")


def test_tensor_index_count_mismatch():
    err = one_file_error("mask a(t: int[B, KV_LEN]) = t[q] > 0\n")
    assert err.message == "'t' has 2 dimensions but is indexed with 1"
    err = one_file_error("mask a(t: int[KV_LEN]) = t[b, q] > 0\n")
    assert err.message == "'t' has 1 dimension but is indexed with 2"


def test_indexing_a_scalar():
    err = one_file_error("mask a = q[0] > 1\n")
    assert "only tensors can be indexed" in err.message


def test_float_tensor_index():
    err = one_file_error("mask a(t: int[KV_LEN]) = t[kv / 2] > 0\n")
    assert "tensor indices must be ints" in err.message


@pytest.mark.parametrize("body, message", [
    ("q // 2.0 > 0", "'//' needs ints; use floor(x / y) for floats"),
    ("q % 2.5 > 0", "'%' needs ints"),
    ("q + true > 0", "use where(c, 1, 0) to turn a boolean into a number"),
    ("~q", "'~' needs a boolean"),
    ("-(q > kv)", "'-' needs a number"),
    ("(q > kv) & 1", "'&' combines booleans"),
    ("abs(q, kv) > 0", "abs() takes 1 argument, got 2"),
    ("clamp(q, 0) > 0", "clamp() takes 3 arguments, got 2"),
    ("abs(x=q) > 0", "abs() takes positional arguments only"),
    ("where(q, 1, 2) > 0", "where()'s condition must be a boolean"),
    ("where(q > 0, true, 2)", "where()'s two branches must both be booleans or both be numbers"),
    ("tanh(q > 0) > 0", "tanh() needs numbers"),
    ("abs > 1", "'abs' is a function; call it"),
    ('"x"', "strings are not values in definitions"),
    ("alibi_slopes(H)[h] > 0", "can only be the default of a tensor parameter"),
])
def test_definition_type_errors(body, message):
    err = one_file_error(f"mask a = {body}\n")
    assert message in err.message


def test_comparison_of_booleans_is_allowed():
    assert file_errors("mask a = (q > kv) == (kv > 2)\nmask c = (q > kv) != true\n") == []


def test_float_arithmetic_and_division_types():
    lib2 = load_text("score s(c: float = 2.0) = score / c + q / 2 + floor(q / 3)\nspec t = s\n")
    assert lib2["t"].ir.score.type == "float"


# ---------------------------------------------------------------------------------------------
# Parameters of .attn definitions


def test_unknown_parameter_type():
    err = one_file_error("mask a(n: integer) = q < n\n")
    assert "unknown type 'integer'" in err.message and "Did you mean 'int'?" in err.message


def test_tensor_parameter_needs_dims():
    err = one_file_error("mask a(t: tensor) = true\n")
    assert "needs its dims" in err.message


def test_duplicate_parameter():
    err = one_file_error("mask a(n: int, n: int) = q < n\n")
    assert "parameter 'n' is declared twice" in err.message


def test_reserved_parameter_name():
    err = one_file_error("mask a(q: int) = q < 1\n")
    assert "parameter name 'q' is reserved" in err.message


def test_default_of_the_wrong_type():
    err = one_file_error("mask a(n: int = 1.5) = q < n\n")
    assert "expects an int, got a float" in err.message


def test_learnable_and_builtin_tensors(lib):
    spec = flexspec.parse("lower + bias + slope", library=lib)
    tensors = {t.origin: t for t in spec.ir.tensors()}
    assert tensors["learnable"].init == "normal"
    assert tensors["learnable"].shape == (ir.Var("H"),)
    assert tensors["builtin"].builtin == "alibi_slopes"
    assert spec.bindings == []


def test_learnable_init_must_be_known():
    err = one_file_error('score a(t: float[H] = learnable(H, init="ones")) = score + t[h]\n')
    assert 'init="zeros" or init="normal"' in err.message


def test_learnable_dims_must_match():
    err = one_file_error("score a(t: float[H] = learnable(H, H)) = score + t[h]\n")
    assert "learnable() gives 2 dims but 't' declares 1" in err.message


def test_alibi_slopes_takes_the_number_of_heads():
    err = one_file_error("score a(t: float[H] = alibi_slopes(H, 2)) = score + t[h]\n")
    assert "alibi_slopes(H)" in err.message


# ---------------------------------------------------------------------------------------------
# Runtime bindings


def test_tensor_parameter_without_default_is_a_binding(lib):
    spec = flexspec.parse("lower & same", library=lib)
    assert spec.bindings == ["ids"]
    (tensor,) = spec.ir.bindings()
    assert tensor.dtype == "int"
    assert tensor.shape == (ir.Var("B"), ir.Var("KV_LEN"))


def test_bare_identifier_renames_a_binding(lib):
    assert flexspec.parse("lower & same(segments)", library=lib).bindings == ["segments"]
    assert flexspec.parse("same(ids=segments)", library=lib).bindings == ["segments"]


def test_the_same_binding_twice_is_one_binding(lib):
    spec = flexspec.parse("same(x) & (same(x) | same)", library=lib)
    assert spec.bindings == ["x", "ids"]


def test_one_binding_name_with_two_shapes(lib):
    err = check_error("same(x) & per_head(x)", lib)
    assert "the binding 'x' is used as int[B, KV_LEN] and as int[H]" in err.message
    assert "different names" in err.message


def test_registry_document_binding():
    needs("causal", "doc", "document")
    assert flexspec.parse("causal & doc").bindings == ["doc_ids"]
    assert flexspec.parse("causal & document").bindings == ["doc_ids"]
    assert flexspec.parse("causal & doc(ids)").bindings == ["ids"]
    spec = flexspec.parse("causal & doc(ids)")
    assert "ids[b, q] == ids[b, kv]" in str(spec.ir.mask)


def test_binding_passed_through_a_definition():
    lib2 = load_text("mask same(ids: int[B, KV_LEN]) = ids[b, q] == ids[b, kv]\n"
                     "mask packed(seg: int[B, KV_LEN]) = q >= kv & same(seg)\n"
                     "spec s = packed\nspec t = packed(doc)\n")
    assert lib2["s"].bindings == ["seg"]
    assert lib2["t"].bindings == ["doc"]


# ---------------------------------------------------------------------------------------------
# .attn libraries


def test_library_specs_and_lookup(lib):
    assert list(lib) == ["base"]
    assert "base" in lib and len(lib) == 1
    spec = lib["base"]
    assert isinstance(spec, flexspec.Spec)
    assert str(spec) == "lower & local(8)"
    assert str(spec.ir.mask) == "q >= kv & abs(q - kv) <= 8"


def test_library_missing_spec_name(lib):
    with pytest.raises(flexspec.SpecCheckError) as info:
        lib["bse"]
    assert "has no spec named 'bse'" in info.value.message
    assert "Did you mean 'base'?" in info.value.message
    assert "Its specs: base" in info.value.message


def test_parse_with_a_library(lib):
    spec = flexspec.parse("base + cap(2.0)", library=lib)
    assert str(spec.ir.score) == "2.0 * tanh(score / 2.0)"
    with pytest.raises(flexspec.SpecCheckError):
        flexspec.parse("base + cap(2.0)")  # not without it


def test_definitions_may_be_used_before_they_are_defined():
    lib2 = load_text("spec s = later & lower\nmask later = q < 4\nmask lower = q >= kv\n")
    assert str(lib2["s"].ir.mask) == "q < 4 & q >= kv"


def test_file_definitions_shadow_the_registry():
    needs("causal")
    lib2 = load_text("mask causal = q > kv\nspec s = causal\n")
    assert str(lib2["s"].ir.mask) == "q > kv"
    assert str(flexspec.parse("causal", library=lib2).ir.mask) == "q > kv"
    assert str(flexspec.parse("causal").ir.mask) == "q >= kv"


def test_duplicate_names():
    err = one_file_error("mask x = q > kv\nmask x = q < kv\n")
    assert err.message == "'x' is defined twice in this file"
    assert (err.line, err.column) == (2, 6)
    err = file_errors("spec s = lower\nmask lower = q >= kv\nscore s = score\n")[0]
    assert "'s' is defined twice" in err.message


def test_built_in_names_cannot_be_redefined():
    for name in ("q", "b", "score", "abs", "KV_LEN", "learnable"):
        kind = "score" if name == "score" else "mask"
        body = "score + 1" if kind == "score" else "q > kv"
        errors = file_errors(f"{kind} {name} = {body}\n")
        assert len(errors) == 1 and "built-in name" in errors[0].message, name


def test_check_text_reports_every_broken_statement_in_order():
    errors = file_errors("mask a = q + 1\nmask ok = q > kv\nspec s = nope\nmask c = score > 1\n")
    assert [e.line for e in errors] == [1, 3, 4]
    assert all(str(e).startswith(f"m.attn:{e.line}:") for e in errors)


def test_an_error_met_through_several_definitions_is_reported_once():
    errors = file_errors("mask bad = q + 1\nmask a = bad & q > 0\nspec s = bad\nspec t = a\n")
    assert len(errors) == 1
    assert errors[0].line == 1


def test_the_statements_after_a_syntax_error_are_checked_too():
    errors = file_errors("mask m1 = q >\nmask m2 = zzz\nmask m3 = m1 & q < 3\n")
    assert [(type(e), e.line) for e in errors] == [(flexspec.SpecSyntaxError, 1),
                                                   (flexspec.SpecCheckError, 2)]
    assert errors[1].message.startswith("unknown name 'zzz'")
    # m3 uses the broken m1, so it is not checked: "unknown name 'm1'" would be a false alarm


def test_clean_file_has_no_errors():
    assert file_errors(HELPERS) == []


def test_error_rendering_in_a_file():
    err = one_file_error("mask ok = q >= kv\n\nmask a =   q +\\\n".replace("\\", " kv"))
    text = str(err)
    assert text.splitlines()[0].startswith("m.attn:3:12: mask 'a' must be a boolean")
    assert text.splitlines()[1] == "    mask a =   q + kv"
    assert text.splitlines()[2] == "    " + " " * 11 + "^" * len("q + kv")


def test_load_and_library_arguments_of_the_wrong_type_are_spec_errors():
    with pytest.raises(flexspec.SpecError, match="load\\(\\) takes the path of an .attn file"):
        flexspec.load(None)
    with pytest.raises(flexspec.SpecError, match="library must be a flexspec.Library"):
        flexspec.parse("causal", library="x")
    with pytest.raises(flexspec.SpecError, match="library must be a flexspec.Library"):
        flexspec.compile("causal", library="x")


@pytest.mark.parametrize("text", ["doc(q)", "doc(self)", "doc(scale)", "doc(k)",
                                  "causal & doc(doc_ids=q_offset)", "document(kv_lengths)"])
def test_bindings_cannot_take_the_names_of_call_arguments(text):
    """Red-team finding: doc(q) failed with TypeError at call time and doc(scale) was read as
    the scale."""
    with pytest.raises(flexspec.SpecCheckError, match="every call takes an argument of that name"):
        flexspec.parse(text)


def test_call_arguments_are_the_ones_the_runtime_takes():
    import inspect

    from flexspec.lang.definitions import CALL_ARGUMENTS
    from flexspec.runtime import Attention, SpecAttention

    for method in (Attention.__call__, SpecAttention.forward):
        named = [p for p, info in inspect.signature(method).parameters.items()
                 if info.kind is not inspect.Parameter.VAR_KEYWORD]
        assert set(named) <= set(CALL_ARGUMENTS), method


@pytest.mark.parametrize("text, message", [
    ("window(9223372036854775808)", "does not fit in a 64-bit int"),
    ("softcap(1e39)", "beyond float32"),
    ("causal + scale(1e-46)", "beyond float32"),
])
def test_constants_the_kernels_cannot_hold_are_check_errors(text, message):
    """Red-team finding: these were accepted and computed wrongly (softcap(1e39) off by 0.82,
    scale(1e-46) NaN) or failed in the reference with a raw ValueError."""
    with pytest.raises(flexspec.SpecCheckError, match=message):
        flexspec.parse(text)
    flexspec.parse("window(9223372036854775807) + scale(1e-40)")  # the edges still check


@pytest.mark.parametrize("text, literal", [
    ("softcap(1e400)", "1e400"), ("causal + scale(-1e400)", "1e400"),
    ("causal + scale(1e-400)", "1e-400"), ("softcap(1.5E+999)", "1.5E+999"),
])
def test_numbers_beyond_float64_are_refused_as_those_beyond_float32(text, literal):
    """Red-team finding: 1e400 was read as inf (every output NaN) while 1e39 was refused."""
    with pytest.raises(flexspec.SpecCheckError) as info:
        flexspec.parse(text)
    column = text.index(literal)
    assert info.value.message == (f"{literal} is beyond float32 (the kernels compute scores in "
                                  "float32, from 1.4e-45 to 3.4e38 in magnitude); use a value in "
                                  "that range")
    assert (info.value.line, info.value.column) == (1, column + 1)
    assert str(info.value).splitlines()[2] == "    " + " " * column + "^" * len(literal)
    assert flexspec.parse("causal + scale(0.0e-400)").ir == flexspec.parse("causal + scale(0.0)").ir


@pytest.mark.parametrize("number", ["1e39", "1e400", "-1e-400", "1e-46"])
def test_a_definition_s_constants_are_checked_on_their_own(number):
    """`flexspec check` finds a constant beyond float32 in a definition no spec uses yet."""
    [error] = check_text(f"score s = score * {number}\n", "m.attn")
    assert "is beyond float32" in error.message
    assert error.line == 1


def test_integer_division_by_a_constant_zero_is_a_check_error():
    with pytest.raises(flexspec.SpecCheckError, match="'q // 0' divides by zero"):
        load_text("mask m = q // 0 == kv\nspec s = m\n")["s"]
    with pytest.raises(flexspec.SpecCheckError, match="'q % 0' divides by zero"):
        load_text("mask m(n: int) = q % n == kv\nspec s = m(0)\n")["s"]


def test_specs_deeper_than_the_passes_handle_are_refused_when_checked():
    """Red-team finding: `causal` plus 100 x `+ softcap` parsed and checked, then `==` (and at
    150, explain and the CLI) raised RecursionError."""
    with pytest.raises(flexspec.SpecCheckError, match="levels of operators after inlining"):
        flexspec.parse("causal" + " + softcap" * 100)
    spec = flexspec.parse("causal" + " + softcap" * 60)  # deep, within the limit: every pass works
    assert flexspec.parse(str(spec)) == spec and hash(spec.ir) == hash(flexspec.parse(str(spec)).ir)
    assert spec.explain().count("tanh") == 60


def test_definitions_that_double_at_every_line_are_refused_quickly():
    """Red-team finding: `mask m{i} = m{i-1} & m{i-1}` took 25 s at 20 lines and never finished
    at 40 (every use of a definition is a copy). The copies are counted while inlining: past the
    budget, one error per file, in a fraction of a second."""
    lines = ["mask m0 = q >= kv"] + [f"mask m{i} = m{i - 1} & m{i - 1}" for i in range(1, 40)]
    errors = check_text("\n".join(lines) + "\n", "doubling.attn")
    assert len(errors) == 1
    error = errors[0]
    assert isinstance(error, flexspec.SpecCheckError)
    assert "expands to more than 20000 operators" in error.message
    assert "-> m4" in error.message and error.line == 6
    # a few doublings stay well inside the budget and check as before (x & x simplifies to x)
    spec = load_text("\n".join(lines[:6]) + "\nspec s = m5\n")["s"]
    assert ir.to_text(spec.ir.mask) == "q >= kv"


def test_a_long_chain_of_definitions_is_refused_without_checking_each_again():
    """Red-team finding: a plain chain of 4,000 definitions took 25 s. Each definition that
    inlines one already found too large fails at once."""
    lines = ["mask m0 = q >= kv"] + [f"mask m{i} = m{i - 1} & kv != {i}" for i in range(1, 4000)]
    errors = check_text("\n".join(lines) + "\n", "chain.attn")
    assert [e.line for e in errors] == [101]
    assert "expands to more than" in errors[0].message


# ---------------------------------------------------------------------------------------------
# Every message whole, and where it points (mutation testing: a search for part of a message
# does not notice words lost or added around it, nor a span that points nowhere)


@pytest.mark.parametrize("text, message, column", [
    ("q", "'q' is a built-in name of the definition language, not a pattern", 1),
    ("tanh", "'tanh' is a built-in name of the definition language, not a pattern", 1),
    ("locl", "unknown pattern 'locl'. Did you mean 'local'?", 1),
    ("lower & add1", "'add1' is a score modifier, so it cannot be combined with '&'; score "
     "modifiers join a spec with '+', e.g. 'causal + add1'", 9),
    ("add1 | lower", "'add1' is a score modifier, so it cannot be combined with '|'; score "
     "modifiers join a spec with '+', e.g. 'causal + add1'", 1),
    ("~add1", "'add1' is a score modifier, so it cannot be combined with '~'; score modifiers "
     "join a spec with '+', e.g. 'causal + add1'", 2),
    ("(lower + add1) & local", "'lower + add1' is a spec with score modifiers, so it cannot be "
     "combined with '&'; score modifiers join a spec with '+', after the masks, e.g. "
     "'causal & window(128) + alibi'", 2),
    ("~(lower + add1)", "'lower + add1' is a spec with score modifiers, so it cannot be "
     "combined with '~'; score modifiers join a spec with '+', after the masks, e.g. "
     "'causal & window(128) + alibi'", 3),
    ("lower + local", "a spec has at most one mask term, but 'lower' and 'local' are both "
     "masks; combine masks with '&': 'lower & local'", 9),
    ("lower & local + add1 + local", "a spec has at most one mask term, but 'lower & local' "
     "and 'local' are both masks; combine masks with '&': 'lower & local & local'", 24),
    ("base(3)", "'base' is a named spec and takes no arguments", 1),
    ("local(m=3)", "'local' has no parameter 'm'. It takes local(n: int = 4)", 7),
    ("local(nn=3)", "'local' has no parameter 'nn'. Did you mean 'n'? It takes "
     "local(n: int = 4)", 7),
    ("local(n=3, n=4)", "argument 'n' given twice", 12),
    ("local(3, n=4)", "argument 'n' given twice", 10),
    ("local(n=3, 4)", "a positional argument cannot follow a keyword argument", 12),
    ("local(1, 2)", "'local' takes 1 argument: local(n: int = 4), but 2 were given", 10),
    ("lower(3)", "'lower' takes no arguments, but 1 was given", 7),
    ("lower(3, 4)", "'lower' takes no arguments, but 2 were given", 7),
    ("same(1, 2)", "'same' takes 1 argument: same(ids: int[B, KV_LEN]), but 2 were given", 9),
    ("two(1, 2, 3)", "'two' takes 2 arguments: two(a: int, c: int), but 3 were given", 11),
    ("two(1)", "'two' needs a value for 'c' (int): write two(a: int, c: int)", 1),
    ("local(x)", "'x' is a bare name, which in a spec names a runtime tensor, but 'n' is an int "
     "parameter; pass a literal such as 128", 7),
    ("cap(x)", "'x' is a bare name, which in a spec names a runtime tensor, but 'c' is a float "
     "parameter; pass a literal such as 30.0", 5),
    ("flag(x)", "'x' is a bare name, which in a spec names a runtime tensor, but 'on' is a bool "
     "parameter; pass a literal such as true", 6),
    ('local("four")', "'n' expects an int, got a string", 7),
    ("same(3)", "'ids' of 'same' expects a tensor (ids: int[B, KV_LEN]), got an int", 6),
    ('same("x")', "'ids' expects a tensor, got a string", 6),
    ("per_head(lim=2)", "'lim' of 'per_head' expects a tensor (lim: int[H]), got an int", 14),
    ("local(2.5)", "'n' of 'local' expects an int, got a float (2.5)", 7),
    ("cap(true)", "'c' of 'cap' expects a float, got a bool (true)", 5),
    ("flag(1)", "'on' of 'flag' expects a bool, got an int (1)", 6),
    ("same(q_offset)", "'q_offset' cannot name the runtime tensor 'ids' of 'same': every call "
     "takes an argument of that name (q, k, v, scale, q_offset, kv_lengths, return_lse, "
     "step); bind it under another name, e.g. same(ids=my_q_offset)", 6),
    ("same(ids=kv_lengths)", "'kv_lengths' cannot name the runtime tensor 'ids' of 'same': "
     "every call takes an argument of that name (q, k, v, scale, q_offset, kv_lengths, "
     "return_lse, step); bind it under another name, e.g. same(ids=my_kv_lengths)", 10),
    ("twice(x) & same(x)", "the binding 'x' is used as int[Q_LEN] and as int[B, KV_LEN]; give "
     "the two uses different names", 1),
    ("atleast(-1)", "'atleast' requires n >= 0, but n = -1", 9),
    # a tensor parameter left out is bound under its own name, here one a call takes
    ("lower & lenm", "'kv_lengths' cannot name the runtime tensor 'kv_lengths' of 'lenm': every "
     "call takes an argument of that name (q, k, v, scale, q_offset, kv_lengths, return_lse, "
     "step); bind it under another name, e.g. lenm(kv_lengths=my_kv_lengths)", 9),
    # the alibi slopes (a builtin tensor, not a binding) come before the two uses of x
    ("lower + slope + sk(x) + sq(x)", "the binding 'x' is used as float[KV_LEN] and as "
     "float[Q_LEN]; give the two uses different names", 1),
])
def test_spec_errors_whole(text, message, column):
    library = load_text(HELPERS + "mask two(a: int, c: int) = q - kv <= a + c\n"
                        "mask twice(t: int[Q_LEN]) = t[q] == 2\n"
                        "score sk(t: float[KV_LEN]) = score + t[kv]\n"
                        "score sq(t: float[Q_LEN]) = score + t[q]\n"
                        "mask lenm(kv_lengths: int[B]) = kv < kv_lengths[b]\n", "helpers.attn")
    library.scope.definitions["atleast"] = _definition(
        "atleast", "mask", "q - kv >= n", ParamSpec("n", "int", constraint=_expr("n >= 0")))
    err = check_error(text, library)
    assert (err.message, err.line, err.column) == (message, 1, column)


@pytest.mark.parametrize("text, errors", [
    ("mask a(q: int) = q > kv\n",
     [("parameter name 'q' is reserved (an index, size or function of the language)", 1, 8)]),
    ("mask a(t: int[2.5]) = t[0] > kv\n",
     [("a tensor dimension must be an int expression, got a float", 1, 15)]),
    # an index or the score (here through a score pattern) has no value when shapes are fixed
    ("mask a(t: int[q]) = t[0] > kv\n",
     [("a tensor dimension can read only the sizes B, H, Q_LEN, KV_LEN and parameters, but "
       "this one reads 'q'; write the shape with sizes, e.g. float[KV_LEN]", 1, 15)]),
    ("mask a(t: int[KV_LEN - kv + h]) = t[0] > kv\n",
     [("a tensor dimension can read only the sizes B, H, Q_LEN, KV_LEN and parameters, but "
       "this one reads 'h', 'kv'; write the shape with sizes, e.g. float[KV_LEN]", 1, 15)]),
    ("score add1 = score + 1.0\nscore a(t: float[floor(add1)]) = score + t[0]\n",
     [("a tensor dimension can read only the sizes B, H, Q_LEN, KV_LEN and parameters, but "
       "this one reads 'score'; write the shape with sizes, e.g. float[KV_LEN]", 2, 18)]),
    ("score a(t: float[H] = alibi_slopes(H, 2)) = score + t[h]\n",
     [("alibi_slopes takes one argument, the number of heads: alibi_slopes(H)", 1, 23)]),
    ("score a(t: float[H] = alibi_slopes(n=H)) = score + t[h]\n",
     [("alibi_slopes takes one argument, the number of heads: alibi_slopes(H)", 1, 23)]),
    ('score a(t: float[H] = learnable(H, init="ones")) = score + t[h]\n',
     [('learnable takes dims and optionally init="zeros" or init="normal"', 1, 36)]),
    ('score a(t: float[H] = learnable(H, mode="zeros")) = score + t[h]\n',
     [('learnable takes dims and optionally init="zeros" or init="normal"', 1, 36)]),
    ("score a(t: float[H] = learnable(H, init=1)) = score + t[h]\n",
     [('learnable takes dims and optionally init="zeros" or init="normal"', 1, 36)]),
    ("score a(t: float[H] = learnable(H, Q_LEN)) = score + t[h]\n",
     [("learnable() gives 2 dims but 't' declares 1", 1, 23)]),
    ("spec s = lower\nmask lower = q >= kv\nmask a = s\n",
     [("'s' is a named spec; definitions can use masks and score modifiers but not specs",
       3, 10)]),
    ("score s = score * 2\nmask a = s > 0\n",
     [("'s' is a score modifier and can only be used in score definitions", 2, 10)]),
    ("score s = score * 2\nmask a(n: int = floor(s)) = q - kv <= n\n",
     [("'s' is a score modifier and can only be used in score definitions", 2, 23)]),
    ("spec x = y\nspec y = x\n",
     [("definitions refer to each other in a cycle: y -> x -> y", 1, 10),
      ("definitions refer to each other in a cycle: x -> y -> x", 2, 10)]),
    ("mask a = q + kv\n",
     [("mask 'a' must be a boolean expression, but its definition is an int", 1, 10)]),
    ("score s = score > 0\n", [("score 's' must be a number, but its definition is a bool", 1, 11)]),
    ("mask w(n: int) = q - kv <= n\nmask a = w(true)\n",
     [("'n' of 'w' expects an int, got a bool (true)", 2, 12)]),
    ("mask w(t: int[KV_LEN]) = t[kv] == 0\nmask a = w(3)\n",
     [("'t' of 'w' expects a tensor (t: int[KV_LEN]), got an int", 2, 12)]),
])
def test_definition_errors_whole(text, errors):
    assert [(e.message, e.line, e.column) for e in file_errors(text)] == errors


def _expr(text: str, line: int = 0):
    """A definition expression as a YAML pattern holds it, placed at ``line`` of its file."""
    return parse_expr(Source(text, "p.yaml", line_offset=line))


def _definition(name, kind, body, *params):
    return Definition(name, kind, params, _expr(body) if kind != "spec" else parse_spec(body))


def _checked_on_its_own(definition, *others) -> flexspec.SpecCheckError | None:
    """check_definition of ``definition`` (a registry pattern's way in) in a scope with it."""
    scope = Scope((definition,) + others, parent=load_text(HELPERS, "helpers.attn").scope)
    try:
        check_definition(definition, scope)
    except flexspec.SpecCheckError as err:
        return err
    return None


def test_constraints_and_defaults_of_patterns_checked_on_their_own():
    # constraints exist only in registry patterns: these are checked with their parameters
    # symbolic (check_definition), where each part of a pattern file points at its own line
    not_bool = _definition("m", "mask", "q - kv <= n", ParamSpec("n", "int", constraint=_expr("n + 1", 4)))
    err = _checked_on_its_own(not_bool)
    assert (err.message, err.line) == ("the constraint of 'n' must be a boolean expression", 5)
    broken = _definition("m", "mask", "q - kv <= lo",
                         ParamSpec("lo", "int", default=_expr("5", 2), constraint=_expr("lo <= hi", 6)),
                         ParamSpec("hi", "int", default=_expr("3", 8)))
    err = _checked_on_its_own(broken)
    assert (err.message, err.line) == (
        "the default of 'lo' (5) breaks its constraint lo <= hi; change one of them", 3)
    # hi without a default is symbolic: the constraint may hold, so no error
    assert _checked_on_its_own(_definition(
        "m", "mask", "q - kv <= lo",
        ParamSpec("lo", "int", default=_expr("5"), constraint=_expr("lo <= hi")),
        ParamSpec("hi", "int"))) is None
    # a default that meets its constraint, and a constraint on a parameter without a default
    assert _checked_on_its_own(_definition(
        "m", "mask", "q - kv <= n",
        ParamSpec("n", "int", default=_expr("3"), constraint=_expr("n > 2")),
        ParamSpec("k", "int", constraint=_expr("k > 100")))) is None
    reserved = _definition("m", "mask", "q - kv <= 1",
                           ParamSpec("kv", "int", span=_expr("kv", 7).span))
    err = _checked_on_its_own(reserved)
    assert (err.message, err.line) == (
        "parameter name 'kv' is reserved (an index, size or function of the language)", 8)
    dims = _definition("m", "mask", "t[0] > kv", ParamSpec("t", "int", dims=(_expr("Q_LEN > 1", 3),)))
    err = _checked_on_its_own(dims)
    assert (err.message, err.line) == (
        "a tensor dimension must be an int expression, got a bool", 4)


def test_a_named_spec_checked_on_its_own():
    # check_definition takes every kind: a spec is checked as a spec expression, not as a
    # definition body (where '+' would be arithmetic), and its cycles point at the use
    assert _checked_on_its_own(_definition("s", "spec", "lower + add1")) is None
    x = Definition("x", "spec", (), parse_spec("y", "x.attn"))
    y = Definition("y", "spec", (), parse_spec("lower & x", "y.attn"))
    err = _checked_on_its_own(x, y)
    assert (err.message, err.source_name, err.column) == (
        "definitions refer to each other in a cycle: x -> y -> x", "y.attn", 9)
    err = _checked_on_its_own(_definition("s", "spec", "lower & add1"))
    assert err.message.startswith("'add1' is a score modifier, so it cannot be combined")


def test_int_expression_for_a_float_parameter_becomes_a_float(lib):
    # the float of a non-constant int argument is `x * 1.0`: the same value, as a float
    library = load_text(HELPERS + "score d = cap(q - kv)\nscore e = cap((q - kv) * 1.0)\n"
                        "spec sd = d\nspec se = e\n")
    assert library["sd"].ir.score == library["se"].ir.score
    assert library["sd"].ir.score.type == "float"


def test_learnable_and_builtin_tensors_exactly(lib):
    # each use of a learnable default is its own table, numbered from the second; learnable()
    # takes its init (zeros unless given) and dims; alibi_slopes(H) is the builtin of H heads
    library = load_text(HELPERS + "score two(w: float[H, 3] = learnable(H, 3)) = score + w[h, 0]\n"
                        'score z(w: float[H] = learnable(H, init="zeros")) = score + w[h]\n')
    spec = flexspec.parse("lower + bias + bias + bias + two + z + slope", library=library)
    heads = ir.Var("H")
    assert spec.ir.tensors() == [
        ir.Tensor("bias_w", (heads,), "float", "learnable", init="normal"),
        ir.Tensor("bias_w_2", (heads,), "float", "learnable", init="normal"),
        ir.Tensor("bias_w_3", (heads,), "float", "learnable", init="normal"),
        ir.Tensor("two_w", (heads, ir.Const(3)), "float", "learnable", init="zeros"),
        ir.Tensor("z_w", (heads,), "float", "learnable", init="zeros"),
        ir.Tensor("alibi_slopes", (heads,), "float", "builtin", "alibi_slopes", (heads,)),
    ]


@pytest.mark.parametrize("text, errors", [
    ("mask a(n: int = learnable(H)) = q - kv <= n\n",
     [("learnable() can only be the default of a tensor parameter", 1, 17)]),
    ("mask w(n: int) = q - kv <= n\nmask a = w() & q > 0\n",
     [("'w' needs a value for 'n' (int): write w(n: int)", 2, 10)]),
    # a default of the wrong type, named and pointed at
    ("mask a(n: int = 1.5) = q < n\n", [("'n' of 'a' expects an int, got a float (1.5)", 1, 17)]),
    ("mask a(n: bool = 1) = q < kv\n", [("'n' of 'a' expects a bool, got an int (1)", 1, 18)]),
    ("score a(c: float = true) = score * 2\n",
     [("'c' of 'a' expects a float, got a bool (true)", 1, 20)]),
    # a cycle closed inside a definition body points at the use that closes it
    ("mask x = y\nmask y = x\n",
     [("definitions refer to each other in a cycle: y -> x -> y", 1, 10),
      ("definitions refer to each other in a cycle: x -> y -> x", 2, 10)]),
    ("score s1 = s2 + 1\nscore s2 = s1 * 2\n",
     [("definitions refer to each other in a cycle: s2 -> s1 -> s2", 1, 12),
      ("definitions refer to each other in a cycle: s1 -> s2 -> s1", 2, 12)]),
    ("mask a = q > kv | a\n", [("definitions refer to each other in a cycle: a -> a", 1, 19)]),
])
def test_definition_errors_whole_more(text, errors):
    test_definition_errors_whole(text, errors)


def test_defaults_and_arguments_inside_score_definitions(lib):
    # an int default of a float parameter is a float; inside a score definition an argument
    # may read the score through a score modifier (cap's c is score + 1 here),
    # and so may a default (the argument a call leaves out)
    library = load_text(HELPERS + "score f(c: float = 2) = score * c\nscore g = cap(add1)\n"
                        "score d(c: float = add1) = score + c\n")
    assert ir.to_text(flexspec.parse("lower + f", library=library).ir.score) == "score * 2.0"
    assert ir.to_text(flexspec.parse("lower + d", library=library).ir.score) == "score + (score + 1)"
    assert ir.to_text(flexspec.parse("lower + g", library=library).ir.score) == \
        "(score + 1) * tanh(score / (score + 1))"
    # a score modifier's body may be an int
    assert ir.to_text(load_text("score i = q - kv\nspec s = i\n")["s"].ir.score) == "q - kv"


def test_recursion_too_deep_is_a_check_error_at_the_definition_or_spec(monkeypatch, lib):
    # a RecursionError anywhere in checking (a body nested deeper than Python's stack, whose
    # depth differs by platform) becomes a check error pointing at the body or the spec; only
    # the definition `deep` and the spec node below raise it (the registry may load meanwhile)
    spec_node = parse_spec("lower & local")
    check_definition_, spec_ = checker.Checker.check_definition, checker.Checker.spec

    def deep_definition(self, definition):
        if definition.name == "deep":
            raise RecursionError
        return check_definition_(self, definition)

    def deep_spec(self, node):
        if node is spec_node:
            raise RecursionError
        return spec_(self, node)

    monkeypatch.setattr(checker.Checker, "check_definition", deep_definition)
    monkeypatch.setattr(checker.Checker, "spec", deep_spec)
    message = ("the expression is nested too deeply (or its definitions inline each other too "
               "deeply) to check")
    assert [(e.message, e.line, e.column) for e in file_errors("mask deep = q > kv\n")] == \
        [(message, 1, 13)]
    with pytest.raises(flexspec.SpecCheckError) as info:
        checker.check_spec(spec_node, lib.scope)
    assert (info.value.message, info.value.line, info.value.column) == (message, 1, 1)


def test_default_constraints_of_later_parameters_and_computed_defaults():
    # every literal default is checked, after parameters without a constraint; a computed
    # default (Q_LEN) is symbolic here, so its constraint is left to the call, even one that
    # can never hold
    late = _definition("m", "mask", "q - kv <= n", ParamSpec("k", "int", default=_expr("1")),
                       ParamSpec("n", "int", default=_expr("3"), constraint=_expr("n > 4")))
    assert _checked_on_its_own(late).message == \
        "the default of 'n' (3) breaks its constraint n > 4; change one of them"
    computed = _definition("m", "mask", "q - kv <= n",
                           ParamSpec("n", "int", default=_expr("Q_LEN"), constraint=_expr("n > 0 & false")))
    assert _checked_on_its_own(computed) is None


def test_a_named_spec_with_a_mask_and_scores_inside_a_chain(lib):
    # a named spec contributes its mask and its scores; later terms apply to its score
    library = load_text(HELPERS + "spec ms = lower & local(2) + add1\n")
    spec = flexspec.parse("ms + dbl", library=library)
    assert ir.to_text(spec.ir.mask) == ir.to_text(flexspec.parse("lower & local(2)", library=library).ir.mask)
    assert ir.to_text(spec.ir.score) == "(score + 1) * 2"


def test_what_a_chain_of_terms_is(lib):
    # scores only: no mask (true), and a score modifier to '&'; a mask whose scores leave the
    # score as it is: a mask, which '&' takes
    library = load_text(HELPERS + "score same0 = score\n")
    scores = flexspec.parse("add1 + dbl", library=library)
    assert (scores.ir.mask, ir.to_text(scores.ir.score)) == (ir.TRUE, "(score + 1) * 2")
    err = check_error("(add1 + dbl) & lower", library)
    assert (err.message, err.column) == (
        "'add1 + dbl' is a score modifier, so it cannot be combined with '&'; score modifiers "
        "join a spec with '+', e.g. 'causal + add1 + dbl'", 2)
    assert flexspec.parse("(lower + same0) & local", library=library).ir == \
        flexspec.parse("lower & local", library=library).ir


def test_the_inlining_budget_is_the_most_operators_allowed(monkeypatch):
    # `lower & local` inlines q >= kv (3 nodes) and abs(q - kv) <= 4 (6 nodes): 9 in all (a
    # library of its own: a scope remembers the definitions found too large)
    lib = load_text(HELPERS, "helpers.attn")
    monkeypatch.setattr(checker, "MAX_INLINED_NODES", 9)
    assert flexspec.parse("lower & local", library=lib).ir.mask is not None
    monkeypatch.setattr(checker, "MAX_INLINED_NODES", 8)
    err = check_error("lower & local", lib)
    assert (err.message, err.column) == (
        "the spec expands to more than 8 operators when its definitions are inlined (every use "
        "of a definition is a copy of it; reached inlining local): use large definitions once "
        "each rather than several times in a chain", 9)


def test_not_of_a_mask_is_a_mask(lib):
    # `~` negates its mask (simplified: q >= kv negated is q < kv) and gives a mask '&' takes
    assert ir.to_text(flexspec.parse("~lower", library=lib).ir.mask) == "q < kv"
    spec = flexspec.parse("~lower & local + add1", library=lib)
    assert ir.to_text(spec.ir.mask) == "q < kv & abs(q - kv) <= 4"
    # and a spec whose definitions are not aligned at the end counts positions from the start
    assert spec.ir.align == "start"


def test_check_spec_of_an_expression_that_is_not_a_spec(lib):
    # the parser gives check_spec spec expressions only; called with a definition expression
    # it names it and points at it
    with pytest.raises(flexspec.SpecCheckError) as info:
        checker.check_spec(_expr("q >= kv", 2), lib.scope)
    assert (info.value.message, info.value.line) == (
        "'q >= kv' is not a pattern; a spec combines named patterns such as "
        "'causal & window(128) + alibi'", 3)


def test_a_spec_using_a_definition_aligned_at_the_end_is_aligned_at_the_end(lib):
    needs("causal_bottom_right")
    assert flexspec.parse("causal_bottom_right & local(2)", library=lib).ir.align == "end"
    assert flexspec.parse("local(2) + add1", library=lib).ir.align == "start"


def test_the_depth_limit_is_the_most_levels_allowed(monkeypatch, lib):
    # the mask is the deeper half here: its depth is the one measured
    mask = flexspec.parse("lower & local", library=lib).ir.mask
    levels = ir.depth(mask)
    monkeypatch.setattr(checker, "MAX_IR_DEPTH", levels)
    assert flexspec.parse("lower & local", library=lib).ir.mask == mask
    monkeypatch.setattr(checker, "MAX_IR_DEPTH", levels - 1)
    err = check_error("lower & local", lib)
    assert (err.message, err.column) == (
        "the expression is nested too deeply (or its definitions inline each other too deeply) "
        f"to check ({levels} levels of operators after inlining; at most {levels - 1})", 1)


def _spec_error(text: str, *definitions) -> flexspec.SpecCheckError:
    """check_spec of ``text`` in a scope with these definitions, not checked on their own (a
    scope handed to the checker directly), in front of the helpers."""
    scope = Scope(definitions, parent=load_text(HELPERS, "helpers.attn").scope)
    with pytest.raises(flexspec.SpecCheckError) as info:
        checker.check_spec(parse_spec(text), scope)
    return info.value


_READS = ("can read only the sizes B, H, Q_LEN, KV_LEN and parameters, but {} reads {}")


def test_a_constraint_that_reads_an_index_or_the_score_is_refused():
    # a constraint is decided when a call binds the parameters; an index or the score (here
    # through the score pattern add1) has no value then, so the constraint could never fail
    through_add1 = _definition("s", "score", "score * n",
                               ParamSpec("n", "int", constraint=_expr("floor(add1) > n", 4)))
    err = _checked_on_its_own(through_add1)
    assert (err.message, err.line, err.column) == (
        "the constraint of 'n' " + _READS.format("it", "'score'"), 5, 1)
    index = _definition("m", "mask", "q - kv <= n",
                        ParamSpec("n", "int", constraint=_expr("n <= q & kv >= 0", 2)))
    err = _checked_on_its_own(index)
    assert (err.message, err.line) == ("the constraint of 'n' " + _READS.format("it", "'kv', 'q'"), 3)
    # when the definition was not checked on its own, the call refuses it just the same
    err = _spec_error("lower + s(3)", through_add1)
    assert err.message == "the constraint of 'n' " + _READS.format("it", "'score'")
    err = _spec_error("lower & m(3)", index)
    assert err.message == "the constraint of 'n' " + _READS.format("it", "'kv', 'q'")


def test_a_constraint_may_read_the_sizes_and_the_parameters():
    sized = _definition("m", "mask", "q - kv <= n",
                        ParamSpec("n", "int", default=_expr("2"), constraint=_expr("n <= KV_LEN + k")),
                        ParamSpec("k", "int", default=_expr("1")))
    assert _checked_on_its_own(sized) is None
    scope = Scope((sized,), parent=load_text(HELPERS, "helpers.attn").scope)
    result = checker.check_spec(parse_spec("m(5)"), scope)
    assert ir.to_text(result.mask) == "q - kv <= 5"


def test_tensor_dimensions_read_the_score_through_a_pattern_at_every_use():
    # the shape of a binding, of a learnable default and of alibi_slopes' heads, each checked
    # in its score definition (where add1 inlines): the score has no value when shapes are fixed
    dims = _READS.format("this one", "'score'") + "; write the shape with sizes, e.g. float[KV_LEN]"
    message = "a tensor dimension " + dims
    bound = _definition("s", "score", "score + t[0]", ParamSpec("t", "float", dims=(_expr("floor(add1)"),)))
    assert _spec_error("lower + s", bound).message == message
    learned = _definition("s", "score", "score + t[0]", ParamSpec(
        "t", "float", dims=(_expr("floor(add1)"),), default=_expr("learnable(1)")))
    assert _spec_error("lower + s", learned).message == message
    text = "score add1 = score + 1.0\nscore a(t: float[H] = {}(floor(add1))) = score + t[h]\n"
    assert [(e.message, e.line, e.column) for e in file_errors(text.format("alibi_slopes"))] == \
        [(message, 2, 36)]
    assert [(e.message, e.line, e.column) for e in file_errors(text.format("learnable"))] == \
        [(message, 2, 33)]


def test_an_expression_no_kernel_can_run_is_refused_at_the_whole_spec():
    # check_runnable's errors (here a zero divisor that only the call's argument makes, which
    # the definition checked on its own cannot see) point at the spec that inlined it
    library = load_text(HELPERS + "mask m(n: int) = q // n == kv\n")
    err = check_error("lower & m(0)", library)
    assert (err.message, err.line, err.column) == ("'q // 0' divides by zero", 1, 1)
    assert str(err).splitlines()[2] == "    " + "^" * len("lower & m(0)")


def test_a_constant_no_kernel_can_run_is_found_in_its_definition():
    # a literal zero divisor is in the definition itself: found there, used by a spec or not
    [err] = check_text("mask m = q // 0 == kv\n", "m.attn")
    assert (err.message, err.line, err.column) == ("'q // 0' divides by zero", 1, 10)


def test_literal_arguments_of_each_type(lib):
    # a bool literal is the bool (where(false, ...) keeps every position), an int and a float
    # their numbers
    assert flexspec.parse("flag(false)", library=lib).ir.mask == ir.TRUE
    assert ir.to_text(flexspec.parse("flag(true)", library=lib).ir.mask) == "q >= kv"
    assert ir.to_text(flexspec.parse("local(2)", library=lib).ir.mask) == "abs(q - kv) <= 2"
    assert ir.to_text(flexspec.parse("cap(2.5)", library=lib).ir.score) == "2.5 * tanh(score / 2.5)"


def test_an_argument_inside_a_definition_reads_the_outer_parameters(lib):
    # wide's k reaches local's n as k + 1, given or defaulted
    library = load_text(HELPERS + "mask wide(k: int = 3) = local(k + 1)\n"
                        "score scaled(f: float = 2.0) = cap(f * 10)\n")
    assert ir.to_text(flexspec.parse("wide(5)", library=library).ir.mask) == "abs(q - kv) <= 6"
    assert ir.to_text(flexspec.parse("wide", library=library).ir.mask) == "abs(q - kv) <= 4"
    assert ir.to_text(flexspec.parse("scaled(0.5)", library=library).ir.score) == \
        "5.0 * tanh(score / 5.0)"


@pytest.mark.parametrize("text, message, column", [
    ("score s(w: float[H]) = score + w[q]\n",
     "'w' is declared float[H], one entry per head in dimension 1, but is indexed there by 'q', "
     "a query position (up to Q_LEN - 1): index it by h, or declare that dimension Q_LEN", 34),
    ("score s(w: float[B, H]) = score + w[kv, h]\n",
     "'w' is declared float[B, H], one entry per batch row in dimension 1, but is indexed there "
     "by 'kv', a key position (up to KV_LEN - 1): index it by b, or declare that dimension "
     "KV_LEN", 37),
    ("mask m(t: int[4]) = t[5] > 0\n",
     "the index '5' of 't' is at least 5, beyond dimension 1 of int[4], which has 4 entries "
     "(0 .. 3)", 23),
    ("mask m(t: int[4]) = t[clamp(q, 4, 7)] > 0\n",
     "the index 'clamp(q, 4, 7)' of 't' is at least 4, beyond dimension 1 of int[4], which has 4 "
     "entries (0 .. 3)", 23),
    ("mask m(t: int[1, KV_LEN]) = t[-1, kv] > 0\n",
     "the index '-1' of 't' is negative wherever it is read (at most -1): indices start at 0", 31),
])
def test_an_index_out_of_its_tensor_for_every_call_is_a_check_error(text, message, column):
    """Red-team finding: `w[q]` on a `float[H]` parameter passed `check` and failed only at
    call time (and only when Q_LEN > H)."""
    [error] = check_text(text, "m.attn")
    assert (error.message, error.line, error.column) == (message, 1, column)


def test_an_index_out_of_range_is_found_once_the_call_fixes_the_size():
    text = ("score s(m: int = 3, t: float[H, 2 * m + 1] = learnable(H, 2 * m + 1)) = "
            "score + t[h, 3 * m]\n")
    assert check_text(text, "m.attn") == []  # m symbolic: 3m may fit 2m + 1 (m = 0)
    with pytest.raises(flexspec.SpecCheckError, match="the index '3 \\* m' of 't' is at least 6, "
                                                      "beyond dimension 2 of float\\[H, 5\\]"):
        flexspec.parse("causal + s(2)", library=load_text(text))


@pytest.mark.parametrize("text", [
    "score s(t: float[H]) = score + t[h]\n",
    "mask m(t: int[1, KV_LEN]) = t[b, kv] > 0\n",   # a size-1 dimension read at b: B may be 1
    "mask m(t: int[B, KV_LEN]) = t[b, q] == t[b, kv]\n",   # a query looked up among the keys
    "mask m(t: int[4]) = t[q % 4] > 0 & t[clamp(kv, 0, 3)] > 0 & t[3] > 0 & t[0] > 0\n",
    "mask m(n: int, t: int[n]) = t[n - 1] > 0\n",
    "score s(t: float[H, Q_LEN]) = score + t[h, q]\n",
])
def test_indices_that_some_call_keeps_in_range_are_accepted(text):
    assert check_text(text, "m.attn") == []
