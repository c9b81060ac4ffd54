"""Hypothesis strategies for testing code that uses flexspec, and flexspec itself.

This module needs `hypothesis <https://hypothesis.readthedocs.io>`_, which is a test extra, not a
dependency of flexspec: ``pip install 'flexspec[test]'``. Importing it without hypothesis raises
an ``ImportError`` that says so. torch is imported only by the strategies that build tensors.

Everything is drawn from the pattern registry (:func:`flexspec.patterns`), so new patterns are
covered as soon as their YAML file exists:

* :func:`spec_texts` / :func:`specs`: random, *valid* spec expressions: mask patterns joined with
  ``& | ~`` and parentheses, then up to ``max_scores`` score modifiers in a ``+`` chain, each call
  with parameters valid for its type and its ``constraint``, given positionally or by keyword or
  left at their defaults, and tensor parameters sometimes bound to a fresh runtime name;
* :func:`shapes`: ``Shape(B, Hq, Hkv, Q_LEN, KV_LEN, D)`` with lengths that are not multiples of
  128, ``Q_LEN != KV_LEN`` sometimes and grouped-query heads; given a spec, only shapes for which
  every tensor lookup stays inside its declared shape (a ``document`` mask reads ``doc_ids[b, q]``
  from a ``[B, KV_LEN]`` tensor, so it needs ``Q_LEN <= KV_LEN``);
* :func:`bindings`: values for the runtime bindings of a spec (sorted document ids, random bools,
  random float biases), sometimes in the smaller broadcastable shape (``[KV_LEN]`` for
  ``[B, KV_LEN]``), and optionally values for learnable tables too (passed by name);
* :func:`tensor_values`: values for every tensor an IR reads, keyed by
  :func:`flexspec.kernels.tensors.tensor_key`, for the reference evaluator;
* :func:`cases`: a spec, a shape that fits it and bindings, together.

>>> from hypothesis import given, settings
>>> import flexspec
>>> from flexspec.testing import cases
>>> @settings(max_examples=10, deadline=None)
... @given(cases(max_len=64))
... def test_mine(case):
...     q, k, v = case.shape.qkv()
...     out = flexspec.compile(case.spec).reference(q, k, v, **case.bindings)
...     assert out.shape == q.shape
>>> test_mine()
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("flexspec.testing needs hypothesis, a test extra: "
                      "pip install 'flexspec[test]' (or pip install hypothesis)") from err

from flexspec import ir
from flexspec.ir.ops import BINARY_SOURCE, FUNCTIONS, UNARY_SOURCE
from flexspec.lang import ast
from flexspec.lang.registry import Pattern, registry
from flexspec.lang.spec import Spec


def slow_examples(count: int) -> int:
    """How many examples a slow (``@pytest.mark.slow``) sweep draws: ``count``, scaled by the
    environment variable ``FLEXSPEC_SLOW_FRACTION`` (CI's bounded profile sets 0.1)."""
    fraction = float(os.environ.get("FLEXSPEC_SLOW_FRACTION", "1"))
    return max(1, round(count * fraction))


__all__ = ["KINDS", "Case", "Shape", "bindings", "cases", "pattern_kind", "shapes", "slow_examples",
           "spec_texts",
           "specs", "tensor_values"]

#: Pattern categories :func:`spec_texts` can draw from (see :func:`pattern_kind`).
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


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)
    return str(value)


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
        args.append((param.name, _format_value(value), True))

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


# ---------------------------------------------------------------------------------------------
# Shapes


class Shape(NamedTuple):
    """Sizes of one attention call: q is ``(B, Hq, Q_LEN, D)``, k and v ``(B, Hkv, KV_LEN, D)``."""

    B: int
    Hq: int
    Hkv: int
    Q_LEN: int
    KV_LEN: int
    D: int

    @property
    def sizes(self) -> dict:
        """The sizes a spec sees: ``B``, ``H`` (the query heads), ``Q_LEN``, ``KV_LEN``."""
        return {"B": self.B, "H": self.Hq, "Q_LEN": self.Q_LEN, "KV_LEN": self.KV_LEN}

    def qkv(self, seed: int = 0, dtype=None, device="cpu", requires_grad: bool = False):
        """Random ``q, k, v`` of this shape (float32 unless ``dtype`` says otherwise)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        dtype = torch.float32 if dtype is None else dtype

        def make(*shape):
            t = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            return t.requires_grad_(requires_grad)

        return (make(self.B, self.Hq, self.Q_LEN, self.D),
                make(self.B, self.Hkv, self.KV_LEN, self.D),
                make(self.B, self.Hkv, self.KV_LEN, self.D))


def _as_ir(spec) -> ir.AttentionIR:
    if isinstance(spec, ir.AttentionIR):
        return spec
    if isinstance(spec, Spec):
        return spec.ir
    if hasattr(spec, "ir") and isinstance(spec.ir, ir.AttentionIR):  # Attention
        return spec.ir
    from flexspec import parse

    return parse(spec).ir


def lookups_fit(spec, shape: Shape, *, exact: bool = True) -> bool:
    """Whether every tensor lookup of ``spec`` stays inside the tensor's declared shape at these
    sizes.

    With ``exact`` (the default) each index expression is evaluated at every position with the
    reference evaluator (what the semantics require); an index that reads another tensor or the
    score falls back to interval analysis. With ``exact=False`` only interval analysis is used,
    which is what the runtime checks before a call: sound, but it may refuse shapes that fit.
    """
    from flexspec.ir.intervals import lookup_ranges
    from flexspec.kernels.reference import evaluate, index_grid
    from flexspec.ir.specialize import declared_shape

    spec_ir = _as_ir(spec)
    sizes = shape.sizes
    grid = index_grid(shape.B, shape.Hq, shape.Q_LEN, shape.KV_LEN) if exact else None
    for tensor, dim, index, span in lookup_ranges(spec_ir, sizes):
        size = declared_shape(tensor, sizes)[dim]
        plain = not any(isinstance(n, ir.Lookup) or (isinstance(n, ir.Var) and n.name == "score")
                        for n in ir.walk(index))
        if exact and plain:
            values = evaluate(index, grid, {})
            if values.min().item() < 0 or values.max().item() >= size:
                return False
        elif span is not None and (span[0] < 0 or span[1] >= size):
            return False
    return True


def _length(max_len: int):
    edges = [n for n in (1, 2, 3, 17, 64, 127, 129, 255, 257, 383, 385) if n <= max_len]
    return st.one_of(st.integers(1, max_len), st.sampled_from(edges)).filter(
        lambda n: n % 128 != 0)


@st.composite
def shapes(draw, max_len: int = 300, *, spec=None, max_batch: int = 3, max_kv_heads: int = 3,
           max_group: int = 3, head_dims=(8, 16, 32)) -> Shape:
    """``Shape(B, Hq, Hkv, Q_LEN, KV_LEN, D)``: lengths in ``1..max_len`` that are not multiples
    of 128, ``Q_LEN == KV_LEN`` about a third of the time, ``Hq`` a multiple of ``Hkv``.

    Given ``spec`` (text, :class:`~flexspec.Spec`, ``Attention`` or IR), only shapes whose tensor
    lookups stay in range (see :func:`lookups_fit`): where that needs it, ``Q_LEN`` is made
    ``<= KV_LEN`` (document-style masks index ``[B, KV_LEN]`` tensors by ``q``).
    """
    if max_len < 1:
        raise ValueError("max_len must be at least 1")
    batch = draw(st.integers(1, max_batch))
    kv_heads = draw(st.integers(1, max_kv_heads))
    heads = kv_heads * draw(st.integers(1, max_group))
    kv_len = draw(_length(max_len))
    q_len = kv_len if draw(st.integers(0, 2)) == 0 else draw(_length(max_len))
    shape = Shape(batch, heads, kv_heads, q_len, kv_len, draw(st.sampled_from(head_dims)))
    if spec is not None and not lookups_fit(spec, shape):
        shape = shape._replace(Q_LEN=min(q_len, kv_len), KV_LEN=max(q_len, kv_len))
        assume(lookups_fit(spec, shape))
    return shape


# ---------------------------------------------------------------------------------------------
# Tensor values


def _tensor_value(draw, tensor: ir.Tensor, sizes: dict, broadcast: bool):
    import torch

    from flexspec.ir.specialize import broadcast_dims, declared_shape

    shape = list(declared_shape(tensor, sizes))
    if broadcast:
        may_broadcast = broadcast_dims(tensor)
        for dim, allowed in enumerate(may_broadcast):
            if allowed and draw(st.integers(0, 3)) == 0:
                shape[dim] = 1
        # Leading size-1 dimensions may be left out: [KV_LEN] for [1, KV_LEN].
        lead = 0
        while lead < len(shape) and shape[lead] == 1 and may_broadcast[lead]:
            lead += 1
        if lead and draw(st.booleans()):
            shape = shape[lead:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if tensor.dtype == "int":
        groups = draw(st.integers(1, 5))
        values = torch.randint(0, groups, shape, generator=gen)
        if values.dim() and draw(st.integers(0, 4)):  # mostly sorted, like document ids
            values = values.sort(dim=-1).values
        return values
    if tensor.dtype == "bool":
        density = draw(st.sampled_from((0.0, 0.05, 0.3, 0.7, 1.0)))
        return torch.rand(shape, generator=gen) < density
    scale = draw(st.sampled_from((0.1, 1.0, 4.0)))
    return torch.randn(shape, generator=gen) * scale


@st.composite
def bindings(draw, spec, shape: Shape, *, broadcast: bool = True, learnables: bool = False):
    """Valid values for ``spec``'s runtime bindings at ``shape``: a dict ``name -> tensor`` to
    pass as ``attn(q, k, v, **values)``.

    int tensors hold a few ids (mostly sorted, like ``doc_ids``), bool tensors a random density
    from 0 to 1, float tensors random normal values. With ``broadcast``, a ``B`` or ``H``
    dimension is sometimes 1 and leading size-1 dimensions are sometimes left out. With
    ``learnables``, learnable tables (``rel_bias_table``...) get random values too, bound by
    name, so that tests see non-zero tables.
    """
    spec_ir = _as_ir(spec)
    sizes = shape.sizes
    values = {}
    for tensor in spec_ir.tensors():
        if tensor.origin == "binding" or (learnables and tensor.origin == "learnable"):
            if tensor.name not in values:
                values[tensor.name] = _tensor_value(
                    draw, tensor, sizes, broadcast and tensor.origin == "binding")
    return values


@st.composite
def tensor_values(draw, spec, shape: Shape, *, broadcast: bool = True):
    """Values for *every* tensor ``spec`` (an IR, or anything :func:`specs` gives) reads, keyed by
    :func:`flexspec.kernels.tensors.tensor_key`: bindings and learnables drawn as in :func:`bindings`,
    builtins (``alibi_slopes(H)``) computed. What :mod:`flexspec.kernels.reference` takes."""
    from flexspec.kernels.tensors import builtin_tensor, tensor_key

    spec_ir = _as_ir(spec)
    values = {}
    for tensor in spec_ir.tensors():
        key = tensor_key(tensor)
        if key in values:
            continue
        if tensor.origin == "builtin":
            values[key] = builtin_tensor(tensor, shape.sizes)
        else:
            values[key] = _tensor_value(draw, tensor, shape.sizes,
                                        broadcast and tensor.origin == "binding")
    return values


class Case(NamedTuple):
    """One test case: a spec, a shape that fits it, and its bindings."""

    spec: Spec
    shape: Shape
    bindings: dict

    def attention(self, **kwargs):
        """``flexspec.compile(self.spec, **kwargs)``."""
        from flexspec import compile as compile_spec

        return compile_spec(self.spec, **kwargs)


@st.composite
def cases(draw, max_len: int = 300, *, learnables: bool | None = None, broadcast: bool = True,
          shape_options: dict | None = None, **spec_options) -> Case:
    """A :class:`Case`: a spec from :func:`specs` (``spec_options`` go there), a shape from
    :func:`shapes` that fits it, and :func:`bindings` for both. ``learnables`` (default: whether
    ``kinds`` includes ``"learnable"``) also binds random learnable tables."""
    spec = draw(specs(**spec_options))
    shape = draw(shapes(max_len, spec=spec, **(shape_options or {})))
    if learnables is None:
        learnables = "learnable" in spec_options.get("kinds", DEFAULT_KINDS)
    values = draw(bindings(spec, shape, broadcast=broadcast, learnables=learnables))
    return Case(spec, shape, values)
