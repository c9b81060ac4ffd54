"""Text -> syntax tree. The only module that imports lark.

The grammar lives in ``grammar/flexspec.lark`` (shipped inside the wheel as
``flexspec/grammar/flexspec.lark``). A hand-written transformer maps each parse-tree node to one
:mod:`flexspec.lang.ast` class; its ``__default__`` raises so that a grammar change cannot silently
leave raw lark trees in the AST. Every lark error becomes a :class:`SpecSyntaxError` with the
position and a caret; at the end of input the caret sits just after the last character.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from pathlib import Path

import lark
from lark import Transformer, v_args
from lark.exceptions import (UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken,
                             VisitError)

from flexspec.lang import ast
from flexspec.errors import Source, Span, SpecCheckError, SpecError, SpecSyntaxError, SpecTypeError
from flexspec.limits import check_float_literal
from flexspec.resources import data_path

START_SYMBOLS = ("spec", "file", "expr", "type_expr")

# Friendly names for terminals in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "INF": "'inf'",
    "STRING": "a string", "TRUE": "'true'", "FALSE": "'false'", "CMP_OP": "a comparison",
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "COMMA": "','",
    "COLON": "':'", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'",
    "SLASH": "'/'", "__ANON_0": "'//'", "PERCENT": "'%'", "VBAR": "'|'", "AMPERSAND": "'&'",
    "TILDE": "'~'", "MASK": "'mask'", "SCORE": "'score'", "SPEC": "'spec'",
    "$END": "the end of the input",
}


def grammar_path() -> Path:
    """Where the grammar file is: inside the package when installed, at the top of a checkout."""
    path = data_path("grammar", "flexspec.lark")
    if path is not None:
        return path
    raise FileNotFoundError("flexspec.lark not found: the installation is incomplete")


@functools.lru_cache(maxsize=None)
def build_parser(strict: bool = False) -> lark.Lark:
    """The LALR parser; ``strict=True`` (used by the tests) also rejects terminal collisions.

    ``cache=True`` keeps lark's parse tables in a temporary file between runs (building them
    takes most of a second); the comments seen by the lexer go to :data:`_comment_sink`.
    """
    return lark.Lark(grammar_path().read_text(), parser="lalr", start=list(START_SYMBOLS),
                     propagate_positions=True, maybe_placeholders=True, strict=strict,
                     cache=not strict, lexer_callbacks={"COMMENT": _collect_comment})


# Comments are ignored by the grammar; the lexer hands them here so the formatter can keep them.
_comment_sink: list | None = None


def _collect_comment(token):
    if _comment_sink is not None:
        # the offset, not lark's line: lark counts "\n" only, where a file may end its lines
        # with a lone "\r" (Source.line_col counts every kind of line break)
        _comment_sink.append((token.start_pos, str(token)))
    return token


# ---------------------------------------------------------------------------------------------
# Parse tree -> AST


def _unescape(token: str) -> str:
    body, out, i = token[1:-1], [], 0
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    while i < len(body):
        if body[i] == "\\":
            out.append(escapes[body[i + 1]])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def _number_value(token) -> int | float:
    if token.type == "INT":
        return int(token)
    if token.type == "INF":
        return math.inf
    return float(token)


@v_args(meta=True, inline=True)
class _ToAst(Transformer):
    def __init__(self, source: Source):
        super().__init__()
        self.source = source

    def __default__(self, data, children, meta):
        raise AssertionError(f"grammar rule {data!r} has no AST mapping")

    def _span(self, meta) -> Span | None:
        if getattr(meta, "empty", True):
            return None
        return Span(self.source, meta.start_pos, meta.end_pos)

    def _token_span(self, token) -> Span:
        return Span(self.source, token.start_pos, token.end_pos)

    # ---- atoms
    def number(self, meta, token):
        try:
            value = _number_value(token)
        except ValueError:  # Python refuses int() of more than 4300 digits
            raise SpecSyntaxError(f"the number is too long ({len(token)} digits)",
                                  self._token_span(token)) from None
        if token.type == "FLOAT":
            # 1e400 would be read as inf and 1e-400 as 0: refused as 1e39 is, at the number
            check_float_literal(str(token), value, error=SpecCheckError,
                                span=self._token_span(token))
        cls = ast.Int if isinstance(value, int) else ast.Float
        return cls(value, span=self._span(meta))

    def true(self, meta, _token):
        return ast.Bool(True, span=self._span(meta))

    def false(self, meta, _token):
        return ast.Bool(False, span=self._span(meta))

    def string(self, meta, token):
        return ast.Str(_unescape(str(token)), span=self._span(meta))

    def name(self, meta, token):
        return ast.Name(str(token), span=self._span(meta))

    def keyword(self, meta, name, value):
        return ast.Keyword(str(name), value, span=self._span(meta))

    def call(self, meta, name, args):
        return ast.Call(str(name), tuple(args or ()), span=self._span(meta))

    def spec_args(self, meta, *args):
        return [a for a in args if a is not None]

    call_args = spec_args

    def expr_list(self, meta, *items):
        return tuple(i for i in items if i is not None)

    def index(self, meta, target, indices):
        return ast.Index(target, indices, span=self._span(meta))

    # ---- operators
    def neg(self, meta, operand):
        span = self._span(meta)
        # `-1` is the literal -1 (so `window(-1)` and `x * -1` print back as written), but
        # `-(1)` stays a negation; a negative literal is never folded again.
        between = self.source.text[meta.start_pos:operand.span.start] if operand.span else "("
        if (isinstance(operand, (ast.Int, ast.Float)) and "(" not in between
                and math.copysign(1.0, operand.value) > 0):
            return type(operand)(-operand.value, span=span)
        return ast.Unary("-", operand, span=span)

    def not_(self, meta, operand):
        return ast.Unary("~", operand, span=self._span(meta))

    def _binary(op):
        def method(self, meta, left, right):
            return ast.Binary(op, left, right, span=self._span(meta))
        return method

    or_ = _binary("|")
    and_ = _binary("&")
    add = _binary("+")
    sub = _binary("-")
    mul = _binary("*")
    div = _binary("/")
    floordiv = _binary("//")
    mod = _binary("%")

    def compare(self, meta, left, op, right):
        return ast.Binary(str(op), left, right, span=self._span(meta))

    def chain(self, meta, *terms):
        return ast.Chain(tuple(terms), span=self._span(meta))

    # ---- statements
    def type_expr(self, meta, name, dims):
        return ast.TypeExpr(str(name), dims, span=self._span(meta))

    def param(self, meta, name, type_, default):
        return ast.Param(str(name), type_, default, span=self._span(meta))

    def params(self, meta, *params):
        return tuple(p for p in params if p is not None)

    def mask_def(self, meta, name, params, body):
        return ast.Definition("mask", str(name), params, body, span=self._span(meta),
                              name_span=self._token_span(name))

    def score_def(self, meta, name, params, body):
        return ast.Definition("score", str(name), params, body, span=self._span(meta),
                              name_span=self._token_span(name))

    def spec_def(self, meta, name, expr):
        return ast.SpecDef(str(name), expr, span=self._span(meta), name_span=self._token_span(name))

    def file(self, meta, *statements):
        return ast.Module(tuple(statements), span=self._span(meta))


# ---------------------------------------------------------------------------------------------
# Errors


def _describe_expected(expected) -> str:
    names = sorted({_TERMINAL_NAMES.get(t, t.lower()) for t in expected})
    if not names:
        return ""
    if len(names) > 6:
        names = names[:6] + ["..."]
    return "; expected " + (names[0] if len(names) == 1 else "one of " + ", ".join(names))


def _syntax_error(err: UnexpectedInput, source: Source) -> SpecSyntaxError:
    text = source.text
    if isinstance(err, UnexpectedCharacters):
        pos = err.pos_in_stream
        char = text[pos] if pos < len(text) else ""
        message = f"unexpected character {char!r}"
        if char == "'":
            message += " (strings use double quotes)"
        elif char == "!":
            message += " (flexspec writes 'not' as '~', as in `causal & ~doc`)"
        span = Span(source, pos, pos + 1)
        allowed = getattr(err, "allowed", None) or ()
        return SpecSyntaxError(message + _describe_expected(allowed), span)
    token = getattr(err, "token", None)
    at_end = isinstance(err, UnexpectedEOF) or token is None or token.type == "$END"
    expected = getattr(err, "expected", None) or getattr(err, "accepts", None) or ()
    if isinstance(err, UnexpectedToken) and err.accepts:
        expected = err.accepts
    if at_end:
        # the caret goes just after the last character, not on the last token; lark's $END
        # token borrows the last real token's position, so a trailing comment is not counted
        end = getattr(token, "end_pos", None) if token is not None else None
        if not isinstance(end, int) or token.value != "":
            end = len(text.rstrip())
        return SpecSyntaxError("unexpected end of input" + _describe_expected(expected),
                               Span(source, end, end + 1))
    message = f"unexpected {str(token)!r}"
    start = token.start_pos
    if token.type in ("AMPERSAND", "VBAR") and text[start - 1:start] == str(token):
        # `causal && doc`: the caret goes under both characters
        start -= 1
        message = f"unexpected {text[start:token.end_pos]!r} (flexspec writes it " \
                  f"{str(token)!r}, as in `causal {token} doc`)"
    elif token.type == "NAME" and str(token) in _WORD_OPERATORS:
        message += f" (flexspec writes {_WORD_OPERATORS[str(token)]!r} for {str(token)!r})"
    elif _in_spec_argument(token, expected):
        message += f" ({_spec_argument_hint(text, start)})"
    elif token.type == "CMP_OP" and "MINUS" not in expected:
        # no arithmetic could go on here: a spec, which combines patterns
        message += (" (a spec combines named patterns; write a comparison in a definition of "
                    f"an .attn file, as in `mask m = q {token} kv`)")
    elif token.type == "CMP_OP":
        message += " (comparisons do not chain: write `a < b & b < c`)"
    return SpecSyntaxError(message + _describe_expected(expected),
                           Span(source, start, token.end_pos))


# Python's and C's spellings of the logic operators, which a spec writes & | ~
_WORD_OPERATORS = {"and": "&", "or": "|", "not": "~"}
_OPERATOR_TOKENS = {"PLUS", "MINUS", "STAR", "SLASH", "__ANON_0", "PERCENT", "CMP_OP", "LPAR"}


def _in_spec_argument(token, expected) -> bool:
    """Whether an operator came where only a spec call's literal argument fits: after its
    value (only ')' ',' or '=' may follow) or before it (a '(' where a value is expected)."""
    if token.type not in _OPERATOR_TOKENS:
        return False
    expected = set(expected)
    after_value = bool(expected) and expected <= {"RPAR", "COMMA", "EQUAL"}
    before_value = token.type == "LPAR" and "LPAR" not in expected and "STRING" in expected
    return after_value or before_value


def _spec_argument_hint(text: str, position: int) -> str:
    """How to fix ``window(64 * 2)``: the call with the expression's value, when it is
    arithmetic on numbers, and where expressions are allowed."""
    hint = "a spec's arguments are literals, not expressions"
    suggestion = _call_with_value(text, position)
    fix = f"write {suggestion}" if suggestion else "write the number itself"
    return f"{hint}: {fix}, or compute it in a definition of an .attn file"


def _call_with_value(text: str, position: int) -> str | None:
    """``window(128)`` for an error inside ``window(64 * 2)``, or None."""
    opening = text.rfind("(", 0, position)
    name = re.search(r"[A-Za-z_]\w*\s*$", text[:max(opening, 0)])
    if opening < 0 or name is None or "(" in text[opening + 1:position]:
        return None
    begin = max(text.rfind(",", opening, position), opening) + 1
    end, depth = position, 0
    while end < len(text) and (depth > 0 or text[end] not in ",)"):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    close = text.find(")", end)
    keyword = re.match(r"\s*([A-Za-z_]\w*)\s*=", text[begin:end])
    head = begin + (keyword.end() if keyword else 0)
    try:
        value = _literal_value(parse_expr(Source(text[head:end])))
    except SpecError:
        return None
    if value is None or close < 0:
        return None
    before = text[name.start():begin].rstrip()
    before += ("" if before.endswith("(") else " ") + (f"{keyword[1]}=" if keyword else "")
    return before + str(value) + text[end:close + 1]


def _literal_value(node):
    """The value of arithmetic on numbers (``64 * 2``), or None for anything else."""
    if isinstance(node, (ast.Int, ast.Float)):
        return node.value
    if isinstance(node, ast.Unary) and node.op == "-":
        value = _literal_value(node.operand)
        return None if value is None else -value
    if isinstance(node, ast.Binary) and node.op in _ARITHMETIC:
        left, right = _literal_value(node.left), _literal_value(node.right)
        if left is None or right is None or (right == 0 and node.op in ("/", "//", "%")):
            return None
        return _ARITHMETIC[node.op](left, right)
    return None


_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
               "//": operator.floordiv, "%": operator.mod}


def _parse(text: str, start: str, source: Source):
    if not isinstance(text, str):
        raise SpecTypeError(f"expected spec text (a str), got {type(text).__name__}",
                              source_name=source.name)
    if text.startswith("\ufeff"):
        # a byte-order mark, as some editors save UTF-8: a space of the same length keeps every
        # position (and so every caret) where it is
        text = " " + text[1:]
    try:
        tree = build_parser().parse(text, start=start)
    except UnexpectedInput as err:
        raise _syntax_error(err, source) from None
    except RecursionError:
        raise SpecSyntaxError("the text is nested too deeply", Span(source, 0, 1)) from None
    try:
        return _ToAst(source).transform(tree)
    except RecursionError:
        raise SpecSyntaxError("the text is nested too deeply", Span(source, 0, 1)) from None
    except VisitError as err:
        # lark wraps an exception raised inside a transformer callback (a RecursionError that
        # strikes there) in VisitError
        if isinstance(err.orig_exc, RecursionError):
            raise SpecSyntaxError("the text is nested too deeply", Span(source, 0, 1)) from None
        if isinstance(err.orig_exc, (SpecSyntaxError, SpecCheckError)):
            raise err.orig_exc from None
        raise


def parse_spec(text: str, source_name: str = "<spec>") -> ast.Node:
    """Parse a spec expression such as ``causal & window(128) + alibi``."""
    source = Source(text if isinstance(text, str) else "", source_name)
    if isinstance(text, str) and not text.strip():
        raise SpecSyntaxError("empty spec; write a pattern such as 'causal' or 'full'",
                              Span(source, 0, 1))
    return _parse(text, "spec", source)


def parse_file(text: str, source_name: str = "<file>", line_offset: int = 0) -> ast.Module:
    """Parse the text of an ``.attn`` file (or of its lines from ``line_offset`` on: positions
    are then counted in the whole file)."""
    return _parse(text, "file", Source(text if isinstance(text, str) else "", source_name,
                                       line_offset=line_offset))


def parse_expr(source: Source) -> ast.Node:
    """Parse one definition expression (pattern definitions, constraints, defaults, dims)."""
    if not source.text.strip():
        raise SpecSyntaxError("empty expression", Span(source, 0, 1))
    return _parse(source.text, "expr", source)


def parse_type(source: Source) -> ast.TypeExpr:
    """Parse a parameter type such as ``int`` or ``int[B, KV_LEN]``."""
    return _parse(source.text, "type_expr", source)


def parse_file_with_comments(text: str, source_name: str = "<file>"):
    """``(module, comments)``: the parsed ``.attn`` file and its ``#`` comments as (line, text),
    for the formatter, which keeps them. Not thread-safe (the lexer reports to a module global)."""
    global _comment_sink
    _comment_sink = []
    try:
        module = parse_file(text, source_name)
        source = Source(text, source_name)
        return module, [(source.line_col(offset)[0], comment) for offset, comment in _comment_sink]
    finally:
        _comment_sink = None

