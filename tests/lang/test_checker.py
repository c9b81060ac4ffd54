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
from flexspec.lang.library import check_text, load_text

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


def test_a_syntax_error_is_the_only_error():
    errors = file_errors("mask a = q >\nmask b = zzz\n")
    assert len(errors) == 1 and isinstance(errors[0], flexspec.SpecSyntaxError)


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
