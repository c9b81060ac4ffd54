"""The parser: text -> syntax tree, and the syntax errors it reports.

Example tests, one behaviour each: precedence and associativity at both levels of the language,
literals (negative numbers, ``inf``, strings and their escapes), keywords, trailing commas and
comments; then syntax errors with their message, line, column and the rendered caret. The
round-trip property on random trees lives in ``test_ast.py``, robustness on random text in
``test_fuzz.py``.
"""

from __future__ import annotations

import math

import pytest

from flexspec import SpecError, SpecSyntaxError
from flexspec.lang.ast import (Binary, Bool, Call, Chain, Definition, Float, Index, Int, Keyword,
                          Module, Name, Param, SpecDef, Str, TypeExpr, Unary)
from flexspec.errors import Source, SpecTypeError
from flexspec.lang.library import check_text
from flexspec.lang.parser import build_parser, parse_expr, parse_file, parse_spec, parse_type

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def expr(text: str):
    return parse_expr(Source(text))


def N(name: str) -> Name:
    return Name(name)


def syntax_error(parse, text: str) -> SpecSyntaxError:
    with pytest.raises(SpecSyntaxError) as info:
        parse(text)
    return info.value


def caret_line(err: SpecError) -> tuple[str, str]:
    """The source line and the caret line of a rendered error (without their indentation)."""
    lines = str(err).splitlines()
    assert len(lines) == 3, str(err)
    assert lines[1].startswith("    ") and lines[2].startswith("    ")
    return lines[1][4:], lines[2][4:]


def caret_column(err: SpecError) -> int:
    """1-based column of the first caret in the rendered error."""
    _, carets = caret_line(err)
    return carets.index("^") + 1


# ---------------------------------------------------------------------------------------------
# The grammar itself


def test_grammar_loads_in_strict_mode():
    pytest.importorskip("interegular")
    # strict=True makes lark reject terminal collisions and shift/reduce conflicts
    parser = build_parser(strict=True)
    assert set(parser.options.start) == {"spec", "file", "expr", "type_expr"}


def test_parser_is_cached():
    assert build_parser() is build_parser()


# ---------------------------------------------------------------------------------------------
# Spec expressions: precedence


def test_spec_and_binds_tighter_than_or():
    assert parse_spec("a | b & c") == Binary("|", N("a"), Binary("&", N("b"), N("c")))
    assert parse_spec("a & b | c") == Binary("|", Binary("&", N("a"), N("b")), N("c"))


def test_spec_not_binds_tightest():
    assert parse_spec("~a & b") == Binary("&", Unary("~", N("a")), N("b"))
    assert parse_spec("~a | ~b") == Binary("|", Unary("~", N("a")), Unary("~", N("b")))
    assert parse_spec("~~a") == Unary("~", Unary("~", N("a")))
    assert parse_spec("~(a & b)") == Unary("~", Binary("&", N("a"), N("b")))


def test_spec_and_or_associate_to_the_left():
    assert parse_spec("a & b & c") == Binary("&", Binary("&", N("a"), N("b")), N("c"))
    assert parse_spec("a | b | c") == Binary("|", Binary("|", N("a"), N("b")), N("c"))


def test_spec_plus_is_loosest_and_flat():
    tree = parse_spec("causal & window(128) + alibi + softcap(30.0)")
    assert tree == Chain((
        Binary("&", N("causal"), Call("window", (Int(128),))),
        N("alibi"),
        Call("softcap", (Float(30.0),)),
    ))


def test_spec_plus_chain_needs_two_terms():
    assert parse_spec("causal") == N("causal")
    assert isinstance(parse_spec("a + b"), Chain)


def test_spec_parentheses_group():
    assert parse_spec("(a | b) & c") == Binary("&", Binary("|", N("a"), N("b")), N("c"))
    assert parse_spec("((a))") == N("a")
    # a parenthesized chain is a chain inside the chain
    assert parse_spec("(a + b) + c") == Chain((Chain((N("a"), N("b"))), N("c")))


# ---------------------------------------------------------------------------------------------
# Spec expressions: arguments


def test_spec_call_arguments():
    tree = parse_spec('f(1, 2.5, true, false, "s", inf, name, k=3)')
    assert tree == Call("f", (Int(1), Float(2.5), Bool(True), Bool(False), Str("s"),
                              Float(math.inf), N("name"), Keyword("k", Int(3))))


def test_spec_empty_call_and_trailing_comma():
    assert parse_spec("f()") == Call("f", ())
    assert parse_spec("window(128,)") == Call("window", (Int(128),))
    assert parse_spec("window(n=128, )") == Call("window", (Keyword("n", Int(128)),))


def test_spec_negative_literals():
    assert parse_spec("window(-1)") == Call("window", (Int(-1),))
    assert parse_spec("f(-2.5, x=-inf)") == Call("f", (Float(-2.5), Keyword("x", Float(-math.inf))))
    assert parse_spec("f(- 3)") == Call("f", (Int(-3),))


def test_spec_arguments_are_literals_not_expressions():
    # `-(1)` and `1 + 2` are definition syntax; a spec argument is a literal or a name
    err = syntax_error(parse_spec, "window(-(1))")
    assert err.column == 9
    err = syntax_error(parse_spec, "window(1 + 2)")
    assert (err.line, err.column) == (1, 10)


def test_spec_keywords_of_files_are_names_here():
    # `mask`, `score` and `spec` start statements in files but are plain names elsewhere
    assert parse_spec("mask & score") == Binary("&", N("mask"), N("score"))
    assert parse_spec("spec") == N("spec")


def test_spec_names_that_start_like_keywords():
    assert parse_spec("true_ & infinite & falsey") == Binary(
        "&", Binary("&", N("true_"), N("infinite")), N("falsey"))
    assert parse_spec("f(inf2)") == Call("f", (N("inf2"),))


# ---------------------------------------------------------------------------------------------
# Definition expressions: precedence


def test_definition_and_or_bind_looser_than_comparisons():
    # unlike Python, where `q >= kv & q < 3` would parse as `q >= (kv & q) < 3`
    assert expr("q >= kv & q < 3") == Binary(
        "&", Binary(">=", N("q"), N("kv")), Binary("<", N("q"), Int(3)))
    assert expr("a == b | c != d") == Binary(
        "|", Binary("==", N("a"), N("b")), Binary("!=", N("c"), N("d")))


def test_definition_not_binds_looser_than_comparison():
    # `~` applies to the whole comparison
    assert expr("~q < kv") == Unary("~", Binary("<", N("q"), N("kv")))
    assert expr("~a & b") == Binary("&", Unary("~", N("a")), N("b"))


def test_definition_arithmetic_precedence():
    assert expr("a + b * c") == Binary("+", N("a"), Binary("*", N("b"), N("c")))
    assert expr("a * b + c") == Binary("+", Binary("*", N("a"), N("b")), N("c"))
    assert expr("a - b - c") == Binary("-", Binary("-", N("a"), N("b")), N("c"))
    assert expr("a / b // c % d") == Binary(
        "%", Binary("//", Binary("/", N("a"), N("b")), N("c")), N("d"))
    assert expr("a + b < c * d") == Binary(
        "<", Binary("+", N("a"), N("b")), Binary("*", N("c"), N("d")))


def test_definition_unary_minus_binds_tighter_than_multiplication():
    assert expr("-a * b") == Binary("*", Unary("-", N("a")), N("b"))
    assert expr("a * -b") == Binary("*", N("a"), Unary("-", N("b")))
    assert expr("--a") == Unary("-", Unary("-", N("a")))


def test_definition_indexing_and_calls_bind_tightest():
    assert expr("-t[h]") == Unary("-", Index(N("t"), (N("h"),)))
    assert expr("t[b, kv] * 2") == Binary("*", Index(N("t"), (N("b"), N("kv"))), Int(2))
    assert expr("t[b][kv]") == Index(Index(N("t"), (N("b"),)), (N("kv"),))
    assert expr("f(x)[0]") == Index(Call("f", (N("x"),)), (Int(0),))
    assert expr("abs(q - kv) <= n") == Binary(
        "<=", Call("abs", (Binary("-", N("q"), N("kv")),)), N("n"))


def test_definition_parentheses():
    assert expr("(a + b) * c") == Binary("*", Binary("+", N("a"), N("b")), N("c"))
    assert expr("a & (b | c)") == Binary("&", N("a"), Binary("|", N("b"), N("c")))
    assert expr("(q < kv) == (kv < 3)") == Binary(
        "==", Binary("<", N("q"), N("kv")), Binary("<", N("kv"), Int(3)))


def test_definition_trailing_commas():
    assert expr("f(1, 2,)") == Call("f", (Int(1), Int(2)))
    assert expr("t[b, kv,]") == Index(N("t"), (N("b"), N("kv")))
    assert expr("f(x=1,)") == Call("f", (Keyword("x", Int(1)),))


# ---------------------------------------------------------------------------------------------
# Literals


def test_negative_literal_folds_but_parenthesized_negation_does_not():
    assert expr("-1") == Int(-1)
    assert expr("- 1") == Int(-1)
    assert expr("-(1)") == Unary("-", Int(1))
    assert expr("x * -1") == Binary("*", N("x"), Int(-1))
    assert expr("1 - -1") == Binary("-", Int(1), Int(-1))
    assert expr("-1.5") == Float(-1.5)
    assert expr("-inf") == Float(-math.inf)
    # a negative literal is never folded a second time
    assert expr("--1") == Unary("-", Int(-1))
    assert expr("-(-1)") == Unary("-", Int(-1))


def test_negative_literal_binds_like_a_literal():
    assert expr("-1 * x") == Binary("*", Int(-1), N("x"))
    assert expr("(-1)[x]") == Index(Int(-1), (N("x"),))


def test_numbers():
    assert expr("0") == Int(0)
    assert expr("007") == Int(7)
    assert expr("123456789012345678901234567890") == Int(123456789012345678901234567890)
    assert expr("2.5") == Float(2.5)
    assert expr("1.") == Float(1.0)
    assert expr(".5") == Float(0.5)
    assert expr("1e3") == Float(1000.0)
    assert expr("1E-3") == Float(0.001)
    assert expr("2.5e+2") == Float(250.0)
    assert expr("inf") == Float(math.inf)
    assert isinstance(expr("1"), Int) and isinstance(expr("1.0"), Float)


def test_too_long_integer_is_a_syntax_error():
    # Python refuses int() of more than 4300 digits; that must not escape as a ValueError
    err = syntax_error(parse_spec, "window(" + "9" * 5000 + ")")
    assert "too long" in err.message
    assert err.column == 8
    assert expr("9" * 4000) == Int(int("9" * 4000))


def test_ints_and_floats_are_different_nodes():
    assert expr("1") != expr("1.0")


def test_booleans_and_names_like_them():
    assert expr("true") == Bool(True)
    assert expr("false") == Bool(False)
    assert expr("True") == N("True")
    assert expr("infinity") == N("infinity")


def test_strings_and_escapes():
    assert expr('"abc"') == Str("abc")
    assert expr('""') == Str("")
    assert expr(r'"a\"b"') == Str('a"b')
    assert expr(r'"back\\slash"') == Str("back\\slash")
    assert expr(r'"line\nbreak\ttab"') == Str("line\nbreak\ttab")
    assert expr('"h\u00e9 \u4e2d # not a comment"') == Str("h\u00e9 \u4e2d # not a comment")


def test_unknown_escape_is_a_syntax_error():
    err = syntax_error(expr, r'"a\qb"')
    assert err.column == 1


def test_string_cannot_span_lines():
    syntax_error(expr, '"a\nb"')


def test_comments_and_whitespace_are_ignored():
    assert expr("1 # one\n + 2  # two") == Binary("+", Int(1), Int(2))
    assert parse_spec("  causal\t&\n window(3) # the window\n") == Binary(
        "&", N("causal"), Call("window", (Int(3),)))


def test_spans_point_at_the_text():
    tree = parse_spec("causal & window(128)")
    assert (tree.span.start, tree.span.end) == (0, 20)
    assert (tree.right.span.start, tree.right.span.end) == (9, 20)
    assert tree.right.args[0].span.start == 16


def test_equality_ignores_spans():
    assert parse_spec("causal&window(3)") == parse_spec(" causal  &  window( 3 ) ")
    assert hash(parse_spec("causal&window(3)")) == hash(parse_spec("(causal & window(3))"))


# ---------------------------------------------------------------------------------------------
# Files and types


def test_file_statements():
    module = parse_file(
        "# model.attn\n"
        "mask local(n: int = 1024,) = causal & window(n)  # trailing comment\n"
        "score cap(c: float = 50.0) = c * tanh(score / c)\n"
        "spec even = local(4096) + cap\n"
        "mask plain = q >= kv\n"
        "mask empty() = true\n"
    )
    local, cap, even, plain, empty = module.statements
    assert local == Definition(
        "mask", "local", (Param("n", TypeExpr("int"), Int(1024)),),
        Binary("&", N("causal"), Call("window", (N("n"),))))
    assert cap.kind == "score" and cap.params[0] == Param("c", TypeExpr("float"), Float(50.0))
    assert cap.body == Binary("*", N("c"), Call("tanh", (Binary("/", N("score"), N("c")),)))
    assert even == SpecDef("even", Chain((Call("local", (Int(4096),)), N("cap"))))
    assert plain.params is None
    assert empty.params == ()


def test_file_statement_name_spans():
    module = parse_file("mask local = q >= kv\n  spec s = local\n")
    local, s = module.statements
    assert (local.name_span.start, local.name_span.end) == (5, 10)
    assert s.name_span.source.line_col(s.name_span.start) == (2, 8)


def test_empty_file_and_comment_only_file():
    assert parse_file("") == Module(())
    assert parse_file("# nothing here\n\n  # at all\n") == Module(())


def test_file_keywords_can_be_names():
    module = parse_file("score score2 = score * 2\nmask spec(mask: int = 1) = q < mask\n")
    assert module.statements[0].body == Binary("*", N("score"), Int(2))
    assert module.statements[1].name == "spec"
    assert module.statements[1].params[0].name == "mask"


def test_tensor_types():
    param = parse_file("mask m(ids: int[B, KV_LEN], w: float[H,]) = true").statements[0].params
    assert param[0].type == TypeExpr("int", (N("B"), N("KV_LEN")))
    assert param[1].type == TypeExpr("float", (N("H"),))
    assert parse_type(Source("float[H * 2]")) == TypeExpr("float", (Binary("*", N("H"), Int(2)),))


def test_tensor_default_is_an_expression():
    params = parse_file('score s(w: float[H] = learnable(H, init="normal")) = score + w[h]'
                        ).statements[0].params
    assert params[0].default == Call("learnable", (N("H"), Keyword("init", Str("normal"))))


# ---------------------------------------------------------------------------------------------
# Syntax errors


def test_error_is_a_spec_error_with_position():
    err = syntax_error(parse_spec, "causal & & window(3)")
    assert isinstance(err, SpecError)
    assert err.kind == "syntax error"
    assert err.message.startswith("unexpected '&'")
    assert (err.source_name, err.line, err.column) == ("<spec>", 1, 10)
    assert str(err).startswith("<spec>:1:10: unexpected '&'")
    source, carets = caret_line(err)
    assert source == "causal & & window(3)"
    assert carets == " " * 9 + "^"


def test_error_lists_what_was_expected():
    err = syntax_error(parse_spec, "causal & & window(3)")
    assert "expected" in err.message
    assert "a name" in err.message and "'('" in err.message and "'~'" in err.message


def test_error_caret_spans_the_whole_token():
    err = syntax_error(parse_spec, "causal window")
    assert err.column == 8
    source, carets = caret_line(err)
    assert carets == " " * 7 + "^" * len("window")


def test_end_of_input_caret_goes_after_the_last_character():
    text = "causal &"
    err = syntax_error(parse_spec, text)
    assert err.message.startswith("unexpected end of input")
    assert (err.line, err.column) == (1, len(text) + 1)
    source, carets = caret_line(err)
    assert source == text
    assert carets == " " * len(text) + "^"


def test_end_of_input_ignores_trailing_whitespace_and_comments():
    for text in ("causal &   ", "causal &\n\n", "causal & # and then?", "causal &  # x\n  \n"):
        err = syntax_error(parse_spec, text)
        assert (err.line, err.column) == (1, 9), text


def test_end_of_input_on_a_later_line():
    err = syntax_error(parse_spec, "causal\n  & (window(3)")
    assert (err.line, err.column) == (2, 15)
    assert "expected ')'" in err.message
    source, carets = caret_line(err)
    assert source == "  & (window(3)"
    assert carets == " " * 14 + "^"


def test_end_of_input_in_a_file():
    err = syntax_error(parse_file, "mask a = q <  # unfinished\n\n")
    assert (err.line, err.column) == (1, 13)
    assert err.source_name == "<file>"
    err = syntax_error(lambda t: parse_file(t, "model.attn"), "mask local(n: int")
    assert str(err).startswith("model.attn:1:18: unexpected end of input")


def test_error_on_a_later_line_of_a_file():
    text = "mask ok = q >= kv\nmask bad = q >= >= kv\n"
    err = syntax_error(lambda t: parse_file(t, "m.attn"), text)
    assert (err.line, err.column) == (2, 17)
    assert str(err).splitlines()[0].startswith("m.attn:2:17: ")
    source, carets = caret_line(err)
    assert source == "mask bad = q >= >= kv"
    assert carets == " " * 16 + "^^"


def test_single_quoted_string_hint():
    err = syntax_error(parse_spec, "f('abc')")
    assert "strings use double quotes" in err.message
    assert err.column == 3
    err = syntax_error(expr, "x == 'a'")
    assert "strings use double quotes" in err.message


def test_chained_comparison_hint():
    err = syntax_error(expr, "0 <= q < KV_LEN")
    assert "comparisons do not chain" in err.message
    assert "a < b & b < c" in err.message
    assert err.column == 8
    source, carets = caret_line(err)
    assert carets == " " * 7 + "^"


def test_comparison_in_a_spec_is_an_error():
    err = syntax_error(parse_spec, "q < kv")
    assert err.column == 3


ARGUMENT_HINT = "a spec's arguments are literals, not expressions: "
ELSEWHERE = ", or compute it in a definition of an .attn file"


@pytest.mark.parametrize("text, operator, fix", [
    ("window(64 * 2)", "*", "write window(128)"),
    ("causal & window(n=64*2)", "*", "write window(n=128)"),
    ("softcap(60 / 2) + alibi", "/", "write softcap(30.0)"),
    ("dilated(4, 1 + 1)", "+", "write dilated(4, 2)"),
    ("window(-64 * 2)", "*", "write window(-128)"),
    ("window((64))", "(", "write window(64)"),
    ("window(x * 2)", "*", "write the number itself"),
    ("window(2**7)", "*", "write the number itself"),
    ("window(1 // 0)", "//", "write the number itself"),
])
def test_an_expression_as_a_spec_argument_says_how_to_fix_it(text, operator, fix):
    err = syntax_error(parse_spec, text)
    position = text.index(operator, text.index("(") + 1)
    assert err.message.startswith(f"unexpected {operator!r} ({ARGUMENT_HINT}{fix}{ELSEWHERE});")
    assert (err.line, err.column) == (1, position + 1)
    assert caret_line(err) == (text, " " * position + "^" * len(operator))


def test_the_argument_hint_names_the_file_and_the_line():
    [err] = check_text("mask ok = q >= kv\nspec s = ok & window(64 * 2)\n", "m.attn")
    assert str(err).startswith(f"m.attn:2:25: unexpected '*' ({ARGUMENT_HINT}write window(128)")
    # inside a definition a call's arguments are expressions: no error at all
    assert check_text("mask w = window(64 * 2)\nspec s = w\n", "m.attn") == []


@pytest.mark.parametrize("text, found, written", [
    ("causal && doc", "&&", "&"), ("causal || doc", "||", "|"),
    ("causal & (doc || sink(4))", "||", "|"),
])
def test_c_logic_operators_say_how_flexspec_writes_them(text, found, written):
    err = syntax_error(parse_spec, text)
    assert err.message.startswith(f"unexpected {found!r} (flexspec writes it {written!r}, as in "
                                  f"`causal {written} doc`);")
    position = text.index(found)
    assert (err.line, err.column) == (1, position + 1)
    assert caret_line(err) == (text, " " * position + "^^")


def test_logic_words_and_the_exclamation_mark_say_how_flexspec_writes_them():
    [err] = check_text("mask ok = q >= kv\nmask m = ok && q < 3\n", "m.attn")
    assert (err.line, err.column) == (2, 13)
    assert "(flexspec writes it '&', as in `causal & doc`)" in err.message
    err = syntax_error(parse_spec, "causal and doc")
    assert err.message.startswith("unexpected 'and' (flexspec writes '&' for 'and');")
    err = syntax_error(parse_spec, "causal & !doc")
    assert err.message.startswith("unexpected character '!' (flexspec writes 'not' as '~', as in "
                                  "`causal & ~doc`);")
    assert err.column == 10


def test_a_comparison_in_a_spec_points_to_definitions():
    err = syntax_error(parse_spec, "causal & q != kv")
    assert err.message.startswith(
        "unexpected '!=' (a spec combines named patterns; write a comparison in a definition of "
        "an .attn file, as in `mask m = q != kv`);")
    assert err.column == 12


def test_unexpected_character():
    err = syntax_error(parse_spec, "causal @ window(3)")
    assert err.message.startswith("unexpected character '@'")
    assert err.column == 8
    err = syntax_error(expr, "a.b")
    assert err.message.startswith("unexpected character '.'")
    assert err.column == 2


def test_unterminated_string():
    err = syntax_error(parse_spec, 'f("abc')
    assert err.column == 3


def test_power_operator_does_not_exist():
    err = syntax_error(expr, "2 ** 3")
    assert err.column == 4


def test_missing_operand_inside_parentheses():
    err = syntax_error(parse_spec, "(causal & )")
    assert err.message.startswith("unexpected ')'")
    assert err.column == 11


def test_tab_before_the_error_is_kept_in_the_caret_line():
    err = syntax_error(parse_spec, "causal\t& @")
    source, carets = caret_line(err)
    assert carets == "      \t  ^"


def test_empty_inputs():
    err = syntax_error(parse_spec, "")
    assert "empty spec" in err.message
    err = syntax_error(parse_spec, "   \n ")
    assert "empty spec" in err.message
    err = syntax_error(parse_spec, "# just a comment")
    assert "end of input" in err.message
    err = syntax_error(expr, "  ")
    assert "empty expression" in err.message


def test_a_non_string_is_rejected():
    with pytest.raises(SpecTypeError) as info:
        parse_spec(42)
    assert info.value.message == "expected spec text (a str), got int"
    assert isinstance(info.value, TypeError)


def test_source_name_in_messages():
    err = syntax_error(lambda t: parse_spec(t, "layer 3"), "causal &")
    assert str(err).startswith("layer 3:1:9: ")


def test_source_offsets_place_embedded_text():
    # a definition embedded in a YAML file at line 7, column 13 of that file
    source = Source("q >= >= kv", "pattern.yaml", line_offset=6, column_offset=12)
    with pytest.raises(SpecSyntaxError) as info:
        parse_expr(source)
    assert (info.value.line, info.value.column) == (7, 18)
    assert str(info.value).startswith("pattern.yaml:7:18: ")


def test_deep_nesting_is_a_syntax_error_not_a_crash():
    with pytest.raises(SpecSyntaxError) as info:
        parse_spec("~" * 5000 + "causal")
    assert "nested too deeply" in info.value.message
    with pytest.raises(SpecSyntaxError):
        expr("-" * 5000 + "q")
    with pytest.raises(SpecSyntaxError):
        expr("t[" * 5000 + "q" + "]" * 5000)
    with pytest.raises(SpecSyntaxError):
        parse_spec("(" * 5000 + "causal")
    # parentheses leave no node behind, so deep but balanced ones are fine (or cleanly refused)
    try:
        assert parse_spec("(" * 5000 + "causal" + ")" * 5000) == N("causal")
    except SpecSyntaxError as err:
        assert "nested too deeply" in err.message


def test_nesting_near_the_recursion_limit_never_crashes():
    # the recursion limit can strike inside a transformer callback, where lark wraps the
    # RecursionError in its VisitError (nested indexing hits it at depths from about 250)
    for depth in (250, 300, 450, 600):
        for text in ("t[" * depth + "q" + "]" * depth, "abs(" * depth + "q" + ")" * depth,
                     "-" * depth + "q", "~" * depth + "true"):
            try:
                expr(text)
            except SpecSyntaxError:
                pass


def test_moderate_nesting_parses():
    assert parse_spec("(" * 200 + "causal" + ")" * 200) == N("causal")
    assert parse_spec("~" * 100 + "causal").operand is not None


def test_a_byte_order_mark_is_whitespace_and_keeps_positions():
    assert parse_spec("\ufeffcausal & window(3)") == parse_spec("causal & window(3)")
    with pytest.raises(SpecSyntaxError) as caught:
        parse_file("\ufeffmask m = q >= \n")
    assert (caught.value.line, caught.value.column) == (1, 15)
