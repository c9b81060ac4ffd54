"""Strategies for spec texts and checked specs drawn from the pattern registry, with parameter
values that meet each pattern's constraints (see :func:`spec_texts`)."""

from __future__ import annotations

import math

from hypothesis import assume
from hypothesis import strategies as st

from flexspec import ir
from flexspec.ir.ops import BINARY_SOURCE, FUNCTIONS, UNARY_SOURCE
from flexspec.lang import ast
from flexspec.lang.registry import Pattern, registry

KINDS = ("static", "binding", "learnable")
DEFAULT_KINDS = ("static", "binding")

# Scalar values drawn for parameters: small ints (most of them), a few larger ones around block
# boundaries, floats of both signs in [0.5, 50].
_SMALL_INTS = tuple(range(0, 41))
_LARGE_INTS = (63, 64, 100, 127, 128, 129, 200, 255, 257)
_FALLBACK_FLOATS = (0.5, 1.0, 2.0, 3.0, 10.0, 50.0, -0.5, -1.0, -2.0)


# ---------------------------------------------------------------------------------------------
# Patterns


def _is_learnable(param) -> bool:
    return (param.dims is not None and isinstance(param.default, ast.Call)
            and param.default.func == "learnable")


def pattern_kind(pattern: Pattern) -> str:
    """``"learnable"`` if a tensor parameter defaults to a learnable table (``rel_bias``),
    ``"binding"`` if a tensor parameter has no default and so must be bound at call time
    (``document``), ``"static"`` otherwise (including defaults such as ``alibi_slopes(H)``)."""
    tensors = [p for p in pattern.params if p.dims is not None]
    if any(_is_learnable(p) for p in tensors):
        return "learnable"
    if any(p.default is None for p in tensors):
        return "binding"
    return "static"


def _select(kinds, names) -> tuple[list, list]:
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown pattern kinds {sorted(unknown)}; choose from {KINDS}")
    chosen = [p for p in registry().patterns.values()
              if pattern_kind(p) in kinds and (names is None or p.name in names)]
    chosen.sort(key=lambda p: p.name)
    masks = [p for p in chosen if p.kind == "mask"]
    scores = [p for p in chosen if p.kind == "score"]
    return masks, scores


# ---------------------------------------------------------------------------------------------
# Constraints: a tiny evaluator for parameter constraints such as `n >= 1 & n % 2 == 1`


class _Unknown(Exception):
    pass


def _eval_constraint(node, env: dict):
    """A parameter's constraint on Python values, with the operator table's Python functions."""
    if isinstance(node, (ast.Int, ast.Float, ast.Bool)):
        return node.value
    if isinstance(node, ast.Name):
        if node.name in env:
            return env[node.name]
        if node.name == "inf":
            return math.inf
        raise _Unknown(node.name)
    if isinstance(node, ast.Call):
        entry, operands = FUNCTIONS.get(node.func), node.args
    elif isinstance(node, ast.Unary):
        entry, operands = UNARY_SOURCE.get(node.op), (node.operand,)
    elif isinstance(node, ast.Binary):
        entry, operands = BINARY_SOURCE.get(node.op), (node.left, node.right)
    else:
        raise _Unknown(type(node).__name__)
    if entry is None:
        raise _Unknown(getattr(node, "func", getattr(node, "op", "")))
    return entry.python(*(_eval_constraint(a, env) for a in operands))


def _satisfies(param, value, env: dict) -> bool:
    """Whether ``value`` meets ``param``'s constraint, given the parameters bound so far
    (unknown names, such as parameters not drawn yet, count as satisfied: the checker decides)."""
    if param.constraint is None:
        return True
    try:
        return bool(_eval_constraint(param.constraint, {**env, param.name: value}))
    except (_Unknown, ZeroDivisionError, TypeError, ValueError, OverflowError):
        return True


# ---------------------------------------------------------------------------------------------
# Spec text



class _Names:
    """Binding names given out while one spec is drawn, so two different tensors never share one
    (the checker rejects that) and one tensor used twice may."""

    def __init__(self):
        self.owner: dict[str, tuple] = {}
        self.fresh = 0

    def claim(self, name: str, owner: tuple) -> bool:
        return self.owner.setdefault(name, owner) == owner

    def new(self, base: str) -> str:
        self.fresh += 1
        name = f"{base}_{self.fresh}"
        self.owner[name] = ("fresh", name)
        return name


def _draw_scalar(draw, param, env: dict):
    if param.type == "bool":
        return draw(st.booleans())
    if param.type == "int":
        valid = [n for n in _SMALL_INTS if _satisfies(param, n, env)]
        large = [n for n in _LARGE_INTS if _satisfies(param, n, env)]
        assume(valid or large)
        if large and (not valid or draw(st.integers(0, 9)) == 0):
            return draw(st.sampled_from(large))
        return draw(st.sampled_from(valid))
    if param.type == "float":
        magnitude = draw(st.one_of(st.sampled_from((0.5, 1.0, 2.0)),
                                   st.floats(0.5, 50.0, allow_nan=False, allow_infinity=False)))
        value = -magnitude if draw(st.integers(0, 3)) == 0 else magnitude
        if value == int(value) and draw(st.integers(0, 3)) == 0:
            value = int(value)  # an int literal is a valid float argument: `scale(2)`
        if _satisfies(param, value, env):
            return value
        if _satisfies(param, -value, env):
            return -value
        fallback = [x for x in _FALLBACK_FLOATS if _satisfies(param, x, env)]
        assume(fallback)
        return draw(st.sampled_from(fallback))
    raise ValueError(f"no strategy for parameters of type '{param.type}'")


def _default_value(param):
    """The value of a scalar default, if it is a literal (else unknown: None)."""
    if isinstance(param.default, (ast.Int, ast.Float, ast.Bool)):
        return param.default.value
    return None


def _call_text(draw, pattern: Pattern, names: _Names, learnables_used: set) -> str:
    """One pattern call with valid arguments: ``window(3)``, ``softcap(c=20.0)``, ``doc``."""
    env: dict = {}
    args: list[tuple[str, str, bool]] = []  # (param name, value text, written or left out)
    for param in pattern.params:
        scalar_args = tuple(sorted((k, v) for k, v in env.items()))
        if param.dims is not None:  # a tensor: leave to its default, or bind a runtime name
            owner = (pattern.name, param.name, scalar_args)
            learnable = _is_learnable(param)
            bind = param.default is None or draw(st.integers(0, 3)) == 0
            if learnable and not bind and (pattern.name, param.name) in learnables_used:
                # Two uses of one learnable table would share its name (see the module notes).
                bind = True
            if not bind:
                if learnable:
                    learnables_used.add((pattern.name, param.name))
                args.append((param.name, "", False))
            elif param.default is None and draw(st.integers(0, 2)) and names.claim(param.name,
                                                                                   owner):
                args.append((param.name, param.name, False))  # the default binding name
            else:
                args.append((param.name, names.new(param.name), True))
            continue
        if param.default is not None and draw(st.integers(0, 2)) == 0:
            value = _default_value(param)
            if value is not None:
                env[param.name] = value
            args.append((param.name, "", False))
            continue
        value = _draw_scalar(draw, param, env)
        env[param.name] = value
        args.append((param.name, ir.format_number(value), True))

    name = pattern.name
    if pattern.aliases and draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(pattern.aliases))
    written = [(p, text) for p, text, keep in args if keep]
    if not written:
        return name + ("()" if draw(st.integers(0, 7)) == 0 else "")
    parts, keyword = [], False
    for param_name, text, keep in args:
        if not keep:
            keyword = True  # after a gap, later arguments must be named
            continue
        keyword = keyword or draw(st.integers(0, 3)) == 0
        parts.append(f"{param_name}={text}" if keyword else text)
    return f"{name}({', '.join(parts)})"


def _mask_text(draw, masks, leaves: int, names, learnables_used, parent: str) -> str:
    """A mask expression with ``leaves`` pattern calls, as text that ``parent`` (``"&"``, ``"|"``,
    ``"~"`` or ``""`` at the top) can take as its operand."""
    if leaves == 1:
        text = _call_text(draw, draw(st.sampled_from(masks)), names, learnables_used)
        if draw(st.integers(0, 4)) == 0:
            text = "~" + text
        return f"({text})" if draw(st.integers(0, 9)) == 0 else text
    left = draw(st.integers(1, leaves - 1))
    op = draw(st.sampled_from("&|"))
    text = (_mask_text(draw, masks, left, names, learnables_used, op) + f" {op} "
            + _mask_text(draw, masks, leaves - left, names, learnables_used, op))
    # '&' binds tighter than '|'; '~' tighter than both.
    needs = parent == "~" or (parent == "&" and op == "|")
    if needs or (parent and draw(st.integers(0, 3)) == 0):
        text = f"({text})"
    if draw(st.integers(0, 6)) == 0:
        text = f"~({text})"
    return text


@st.composite
def spec_texts(draw, max_masks: int = 3, max_scores: int = 2, *, kinds=DEFAULT_KINDS,
               names=None, compact: bool = True) -> str:
    """Valid spec expressions drawn from the registry, as text.

    ``max_masks`` bounds the number of mask pattern calls (joined with ``& | ~`` and
    parentheses), ``max_scores`` the number of score modifiers in the ``+`` chain; either part may
    be empty, not both. ``kinds`` picks the pattern categories of :func:`pattern_kind`
    (``"static"``, ``"binding"``, ``"learnable"``); ``names`` limits the draw to these pattern
    names. With ``compact``, some texts leave out spaces (``causal&window(3)+alibi``).

    A learnable table is drawn at most once per spec: two uses of one learnable pattern with
    different parameters would need two tables of one name.
    """
    masks, scores = _select(kinds, names)
    if not masks and not scores:
        raise ValueError(f"no registry pattern matches kinds={kinds!r}, names={names!r}")
    n_masks = draw(st.integers(0, max_masks)) if masks else 0
    n_scores = draw(st.integers(0, max_scores)) if scores else 0
    if n_masks == 0 and n_scores == 0:
        if masks and (not scores or draw(st.booleans())):
            n_masks = 1
        else:
            n_scores = 1
    binding_names, learnables_used = _Names(), set()
    terms = []
    if n_masks:
        terms.append(_mask_text(draw, masks, n_masks, binding_names, learnables_used, ""))
    for _ in range(n_scores):
        terms.append(_call_text(draw, draw(st.sampled_from(scores)), binding_names,
                                learnables_used))
    if n_masks and n_scores and draw(st.integers(0, 5)) == 0:
        # The mask term may stand anywhere in the chain.
        terms.insert(draw(st.integers(0, len(terms) - 1)), terms.pop(0))
    if n_masks and len(terms) == 1 and draw(st.integers(0, 9)) == 0:
        terms = [f"({terms[0]})"]
    if len(terms) > 2 and draw(st.integers(0, 7)) == 0:
        split = draw(st.integers(2, len(terms) - 1))
        terms = [f"({' + '.join(terms[:split])})"] + terms[split:]
    text = " + ".join(terms)
    if compact and draw(st.integers(0, 7)) == 0:
        text = text.replace(" ", "")
    return text


def specs(max_masks: int = 3, max_scores: int = 2, *, kinds=DEFAULT_KINDS, names=None,
          compact: bool = True):
    """Checked :class:`~flexspec.Spec` objects: :func:`spec_texts` parsed by
    :func:`flexspec.parse` (every drawn text is valid, so a checker error is a real failure)."""
    from flexspec import parse

    return spec_texts(max_masks, max_scores, kinds=kinds, names=names,
                      compact=compact).map(parse)
