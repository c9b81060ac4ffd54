"""Lowering: the IR turned into FlexAttention's ``mask_mod`` and ``score_mod`` functions.

The functions are generated as readable Python source (what ``flexspec explain`` shows and a user
may paste into a model), then built by ``exec``. Inside them every index is a 0-d int tensor
(FlexAttention vmaps them, dynamo traces them and inductor fuses them into its kernel), so only
ops that survive vmap + dynamo + inductor are emitted. Sizes are plain Python ints: an expression
over sizes and constants only is emitted with Python operators and ``math``, never torch.

Recompilation. ``torch.compile(flex_attention)`` must not recompile when the same spec runs with
fresh tensor values of the same shape (new ``doc_ids`` each step): dynamo gives up after 8
recompiles and falls back to an unfused path that materialises the S^2 scores. What matters is the
*code object*: functions with the same code but fresh closure cells (or fresh globals) are
matched by dynamo's guards, and their tensors become graph inputs, read anew each call; a fresh
``exec`` of the same text makes a new code object, which recompiles every time. So each
:class:`Lowered` compiles its source once, into a factory whose parameters are the sizes and the
tensors, and :meth:`Lowered.make_mods` calls that factory: every call returns new closures over
the same code. tests/kernels/test_lower.py counts it: calls with fresh closures and fresh
``doc_ids`` compile one frame, calls with a fresh ``exec`` each compile once each (on the CPU
and on a GPU, inductor and the eager backend alike). A shared holder whose tensors are swapped
would not recompile either, but a BlockMask made earlier would then silently read the new
values.

Each kind of IR node has its rule (``_NODE_RULES``); functions the operator table leaves to the
lowering have theirs (``SPECIAL_FORMS``); a code generator that needs other forms is a
:class:`Dialect`, data the backends name (``Backend.dialect``).

This module must not import the reference: tests compare the two.
"""

from __future__ import annotations

import functools
import keyword
import linecache
import math
import re
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from flexspec import ir
from flexspec.errors import BindingError, SpecError
from flexspec.ir.ops import (FUNCTIONS, OPERATORS, PY_ADD as _ADD, PY_ATOM as _ATOM,
                             PY_BAND as _BAND, PY_BOR as _BOR, PY_CMP as _CMP, PY_COND as _COND,
                             PY_MUL as _MUL, PY_OR as _OR_KW, PY_UNARY as _UNARY)
from flexspec.kernels.tensors import tensor_key

MASK_PARAMS = ("b", "h", "q_idx", "kv_idx")
SCORE_PARAMS = ("score",) + MASK_PARAMS
_INDEX_NAMES = {"b": "b", "h": "h", "q": "q_idx", "kv": "kv_idx", "score": "score"}
# Names the generated code uses itself; a tensor may not take one of them.
_RESERVED = frozenset(SCORE_PARAMS + ir.SIZE_VARS + ("torch", "math", "inf", "mask_mod",
                                                     "score_mod", "_flexspec_mods"))

_LINE_LIMIT = 96


@dataclass(frozen=True)
class _Code:
    """Emitted text, its Python precedence, and whether it is a tensor or a Python scalar."""

    text: str
    prec: int
    tensor: bool

    def at(self, minimum: int) -> str:
        return f"({self.text})" if self.prec < minimum else self.text


class _Emitter:
    """Emits one expression in one :class:`Dialect`; records which free names (sizes, tensors,
    inf, math) it used."""

    def __init__(self, names: dict, dialect: "Dialect"):
        self.names = names  # tensor_key -> Python identifier
        self.used: set[str] = set()
        self.dialect = dialect

    def emit(self, node: ir.Expr) -> _Code:
        rule = _NODE_RULES.get(type(node))
        if rule is None:
            raise SpecError(f"cannot lower '{ir.to_text(node)}' to FlexAttention")
        return rule(self, node)

    def const(self, node: ir.Const) -> _Code:
        value = node.value
        if isinstance(value, float) and math.isinf(value):
            self.used.add("inf")
            return _Code("inf" if value > 0 else "-inf", _ATOM if value > 0 else _UNARY, False)
        text = repr(value)
        return _Code(text, _UNARY if text.startswith("-") else _ATOM, False)

    def var(self, node: ir.Var) -> _Code:
        if node.name in ir.SIZE_VARS:
            self.used.add(node.name)
            return _Code(node.name, _ATOM, False)
        return _Code(_INDEX_NAMES[node.name], _ATOM, True)

    def lookup(self, node: ir.Lookup) -> _Code:
        if not isinstance(node.tensor, ir.Tensor):
            raise SpecError(f"tensor parameter '{node.tensor.name}' has no value to lower")
        name = self.names[tensor_key(node.tensor)]
        self.used.add(name)
        if not node.index:
            return _Code(name, _ATOM, True)
        index = ", ".join(self.emit(i).at(_OR_KW) for i in node.index)
        return _Code(f"{name}[{index}]", _ATOM, True)

    def unary(self, node: ir.Unary) -> _Code:
        x = self.emit(node.operand)
        entry = OPERATORS[node.op]
        symbol, prec = entry.py_tensor if x.tensor else entry.scalar
        space = " " if symbol.isalpha() else ""  # `not x`, `~x`, `-x`
        return _Code(f"{symbol}{space}{x.at(prec)}", prec, x.tensor)

    def binary(self, node: ir.Binary) -> _Code:
        left, right = self.emit(node.left), self.emit(node.right)
        tensor = left.tensor or right.tensor
        if self.dialect.float_int_division and node.op == "/" and tensor \
                and ir.type_of(node.left) == "int" and ir.type_of(node.right) == "int":
            # flexspec.workarounds: cute-int-division (a float operand makes the division a
            # float one throughout, as torch divides ints)
            if left.tensor:
                left = _Code(f"{left.at(_ATOM)}.to(torch.float32)", _ATOM, True)
            else:
                right = _Code(f"{right.at(_ATOM)}.to(torch.float32)", _ATOM, True)
        if node.op in ("==", "!=") and "bool" in (ir.type_of(node.left), ir.type_of(node.right)):
            # a scalar bool here may be symbolic (a comparison of a length, which the compiled
            # call marks dynamic): compared as an int (flexspec.workarounds:
            # dynamo-bool-equality)
            left, right = (c if c.tensor else _Code(f"int({c.text})", _ATOM, False)
                           for c in (left, right))
        entry = OPERATORS[node.op]
        symbol, prec = entry.py_tensor if tensor else entry.scalar
        # Comparisons take operands one level tighter: Python would chain `a < b < c`.
        left_prec = prec if entry.associative else prec + 1
        return _Code(f"{left.at(left_prec)} {symbol} {right.at(prec + 1)}", prec, tensor)

    def conjunction(self, node: ir.And) -> _Code:
        return self._chain(node.args, OPERATORS["and"], "True")

    def disjunction(self, node: ir.Or) -> _Code:
        return self._chain(node.args, OPERATORS["or"], "False")

    def _chain(self, args, entry, empty) -> _Code:
        if not args:
            return _Code(empty, _ATOM, False)
        codes = [self.emit(a) for a in args]
        if len(codes) == 1:
            return codes[0]
        tensor = any(c.tensor for c in codes)
        symbol, prec = entry.py_tensor if tensor else entry.scalar
        return _Code(f" {symbol} ".join(c.at(prec + 1) for c in codes), prec, tensor)

    def call(self, node: ir.Call) -> _Code:
        fn = FUNCTIONS.get(node.fn)
        if fn is None:
            raise SpecError(f"cannot lower function '{node.fn}' to FlexAttention")
        args = [self.emit(a) for a in node.args]
        arg_types = [ir.type_of(a) for a in node.args]
        if fn.int_identity and "float" not in arg_types:
            return args[0]
        tensor = any(a.tensor for a in args)
        if tensor and fn.name in self.dialect.functions:
            return self.dialect.functions[fn.name](self, args, arg_types)
        form = fn.tensor_form if tensor else fn.scalar_form
        if form is None:  # a form that depends on which arguments are tensors
            return SPECIAL_FORMS[fn.name](self, args, arg_types)
        if tensor and fn.float_math:
            # Float math needs a float tensor; the indices are ints.
            args = [_Code(f"{a.at(_ATOM)}.to(torch.float32)", _ATOM, True)
                    if a.tensor and t != "float" else a for a, t in zip(args, arg_types)]
        if "math." in form.template:
            self.used.add("math")
        text = form.template.format(*(a.at(form.arg_prec) for a in args))
        return _Code(text, form.prec, tensor)


# How each kind of node is emitted (a node of another kind cannot be lowered).
_NODE_RULES = {ir.Const: _Emitter.const, ir.Var: _Emitter.var, ir.Lookup: _Emitter.lookup,
               ir.Unary: _Emitter.unary, ir.Binary: _Emitter.binary, ir.And: _Emitter.conjunction,
               ir.Or: _Emitter.disjunction, ir.Call: _Emitter.call}


# ---- functions whose form depends on which arguments are tensors --------------------------------


def _sign(em: _Emitter, args, arg_types) -> _Code:
    x = args[0]
    code = _Code(f"({x.at(_CMP + 1)} > 0) - ({x.at(_CMP + 1)} < 0)", _ADD, False)
    return _call("float", code) if arg_types[0] == "float" else code


def _min(em: _Emitter, args, arg_types) -> _Code:
    return _minmax("min", *args)


def _max(em: _Emitter, args, arg_types) -> _Code:
    return _minmax("max", *args)


def _clamp(em: _Emitter, args, arg_types) -> _Code:
    x, lo, hi = args
    if x.tensor and lo.tensor == hi.tensor:
        return _call("torch.clamp", x, lo, hi)
    return _minmax("min", _minmax("max", x, lo), hi)


def _where(em: _Emitter, args, arg_types) -> _Code:
    cond, a, b = args
    if not cond.tensor:
        if a.tensor == b.tensor:
            return _Code(f"{a.at(_OR_KW)} if {cond.at(_OR_KW)} else {b.at(_COND)}", _COND,
                         a.tensor)
        # One branch is a Python scalar: a Python `if` would give a scalar on some calls
        # and a tensor on others, so make the condition a tensor and let torch choose.
        cond = _Code(f"torch.full_like(q_idx, {cond.text}, dtype=torch.bool)", _ATOM, True)
    if not (a.tensor or b.tensor):
        return em.dialect.where_of_scalars(cond, a, b, _where_type(arg_types[1:]))
    return _call("torch.where", cond, a, b)


def _minmax(fn: str, a: _Code, b: _Code) -> _Code:
    if a.tensor and b.tensor:
        return _call("torch.minimum" if fn == "min" else "torch.maximum", a, b)
    if a.tensor or b.tensor:
        # torch.minimum wants two tensors; clamp takes a Python number and promotes the
        # dtype (int tensor, float bound -> float) the same way.
        t, s = (a, b) if a.tensor else (b, a)
        bound = "max" if fn == "min" else "min"
        return _Code(f"torch.clamp({t.text}, {bound}={s.text})", _ATOM, True)
    return _call(fn, a, b)


# Functions whose operator-table entry leaves a form to the lowering (tensor_form or scalar_form
# None): their forms, by function name.
SPECIAL_FORMS = {"sign": _sign, "min": _min, "max": _max, "clamp": _clamp, "where": _where}


def _torch_where_of_scalars(cond: _Code, a: _Code, b: _Code, kind: str) -> _Code:
    return _call("torch.where", cond, a, b)


# ---- the cute dialect (FLASH's CuTeDSL code generator) -------------------------------------------


def _cute_abs(em: _Emitter, args, arg_types) -> _Code:
    x = args[0]
    return _Code(f"torch.where({x.at(_CMP + 1)} < 0, -{x.at(_UNARY)}, {x.text})", _ATOM, True)


def _cute_sign(em: _Emitter, args, arg_types) -> _Code:
    # two converted comparisons, not a where of constants (see _chosen)
    x = args[0]
    dtype = "torch.float32" if arg_types[0] == "float" else "torch.int32"
    return _Code(f"({x.at(_CMP + 1)} > 0).to({dtype}) - ({x.at(_CMP + 1)} < 0).to({dtype})",
                 _ADD, True)


def _cute_min(em: _Emitter, args, arg_types) -> _Code:
    return _where_minmax("<", *args)


def _cute_max(em: _Emitter, args, arg_types) -> _Code:
    return _where_minmax(">", *args)


def _cute_clamp(em: _Emitter, args, arg_types) -> _Code:
    x, lo, hi = args
    return _where_minmax("<", _where_minmax(">", x, lo), hi)


# flexspec.workarounds: cute-floor-ceil. The float truncated toward zero by the conversion to
# int, then moved one step where it overshot; the int is int32, FLASH's index type
# (flexspec.workarounds: flash-nested-lookup), which ir/overflow keeps FLASH's ints inside.
def _cute_floor(em: _Emitter, args, arg_types) -> _Code:
    return _rounded(args[0], ">", "-")


def _cute_ceil(em: _Emitter, args, arg_types) -> _Code:
    return _rounded(args[0], "<", "+")


def _rounded(x: _Code, overshot: str, step: str) -> _Code:
    truncated = f"{x.at(_ATOM)}.to(torch.int32)"
    return _Code(f"torch.where({truncated} {overshot} {x.at(_CMP + 1)}, {truncated} {step} 1, "
                 f"{truncated})", _ATOM, True)


def _where_minmax(keep_first_if: str, a: _Code, b: _Code) -> _Code:
    if not (a.tensor or b.tensor):
        return _call("min" if keep_first_if == "<" else "max", a, b)
    cond = f"{a.at(_CMP + 1)} {keep_first_if} {b.at(_CMP + 1)}"
    return _Code(f"torch.where({cond}, {a.text}, {b.text})", _ATOM, True)


def _chosen(cond: _Code, a: _Code, b: _Code, kind: str) -> _Code:
    """The cute form of ``where`` with two Python scalar branches (flexspec.workarounds:
    cute-where-of-scalars): ``cond * a + (1 - cond) * b``, exact for finite values; where a
    branch may be infinite (``inf * 0`` is NaN), a ``where`` whose second branch is made a
    tensor by adding ``cond * 0.0``."""
    dtype = "torch.float32" if kind == "float" else "torch.int32"
    flag = f"{cond.at(_ATOM)}.to({dtype})"
    if kind == "float" and "inf" in a.text + b.text:
        tensor_b = _Code(f"{flag} * 0.0 + {b.at(_ADD + 1)}", _ADD, True)
        return _call("torch.where", cond, a, tensor_b)
    chosen = _Code(f"{flag} * {a.at(_MUL + 1)} + (1 - {flag}) * {b.at(_MUL + 1)}", _ADD, True)
    return _Code(f"{chosen.at(_CMP + 1)} != 0", _CMP, True) if kind == "bool" else chosen


@dataclass(frozen=True)
class Dialect:
    """A code generator's form of the lowering: ``functions`` replace the table's tensor forms
    of those functions (by name), ``where_of_scalars`` writes a ``where`` of a tensor condition
    and two scalar branches, and ``float_int_division`` makes the tensor operand of ``/`` of two
    ints a float."""

    name: str
    functions: types.MappingProxyType
    where_of_scalars: Callable
    float_int_division: bool = False


TORCH = Dialect("torch", types.MappingProxyType({}), _torch_where_of_scalars)
# FLASH's CuTeDSL (flexspec.workarounds: cute-maximum, cute-floor-ceil, cute-where-of-scalars,
# cute-int-division): min, max, clamp and abs of tensors through torch.where over comparisons
# (equal values except for NaN operands, which where does not propagate), sign as two converted
# comparisons, floor and ceil as a conversion to int32 corrected by one
CUTE = Dialect("cute", types.MappingProxyType({
    "abs": _cute_abs, "sign": _cute_sign, "min": _cute_min, "max": _cute_max,
    "clamp": _cute_clamp, "floor": _cute_floor, "ceil": _cute_ceil}), _chosen,
    float_int_division=True)
DIALECTS: dict[str, Dialect] = {dialect.name: dialect for dialect in (TORCH, CUTE)}


def _where_type(branch_types) -> str:
    """The type of a ``where`` from its branches' types (the checker lets ints and floats mix)."""
    return "float" if "float" in branch_types else branch_types[0]


def _call(fn: str, *args: _Code) -> _Code:
    return _Code(f"{fn}({', '.join(a.text for a in args)})", _ATOM, any(a.tensor for a in args))


def _identifier(key: str, taken: set) -> str:
    """A readable Python identifier for a tensor key: ``alibi_slopes(H)`` -> ``alibi_slopes_H``."""
    base = re.sub(r"\W+", "_", key).strip("_") or "tensor"
    if base[0].isdigit():
        base = "t_" + base
    if keyword.iskeyword(base) or base in _RESERVED:
        base += "_"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def _split_chain(code: _Code, expr: ir.Expr, emitter: _Emitter) -> str:
    """The return expression; a long ``&``/``|`` chain goes one term per line."""
    text = code.text
    if len(text) + 11 <= _LINE_LIMIT or not isinstance(expr, (ir.And, ir.Or)) or not code.tensor:
        return text
    op, prec = ("&", _BAND) if isinstance(expr, ir.And) else ("|", _BOR)
    terms = [emitter.emit(a).at(prec + 1) for a in expr.args]
    return "(\n        " + f"\n        {op} ".join(terms) + "\n    )"


def _mask_source(expr: ir.Expr, emitter: _Emitter) -> str:
    code = emitter.emit(expr)
    if ir.type_of(expr) != "bool":
        raise SpecError(f"the mask '{ir.to_text(expr)}' is not a boolean expression")
    body = _split_chain(code, expr, emitter) if code.tensor else \
        f"torch.full_like(q_idx, {code.text}, dtype=torch.bool)"
    return (f"def mask_mod({', '.join(MASK_PARAMS)}):\n"
            f"    # {ir.to_text(expr)}\n"
            f"    return {body}\n")


def _score_source(expr: ir.Expr, emitter: _Emitter) -> str:
    code = emitter.emit(expr)
    if ir.type_of(expr) == "bool":
        raise SpecError(f"the score '{ir.to_text(expr)}' is not numeric")
    if not code.tensor:
        body = f"torch.full_like(score, {code.text})"
    elif ir.type_of(expr) == "int" or not ir.depends_on(expr, ir.SCORE_VAR):
        # The kernel expects a float score whatever the expression computes.
        body = f"{code.at(_ATOM)}.to(score.dtype)"
    else:
        body = code.text
    return (f"def score_mod({', '.join(SCORE_PARAMS)}):\n"
            f"    # {ir.to_text(expr)}\n"
            f"    return {body}\n")


@dataclass(frozen=True, eq=False)
class Lowered:
    """The FlexAttention functions of one IR, as source, and a way to build them.

    ``mask_source`` / ``score_source`` are ``None`` when the spec has no mask / no score
    modifier. ``tensor_names`` maps each :func:`~flexspec.ir.tensor_key` to the Python name
    the source uses for it; ``size_names`` lists the sizes the source reads.
    """

    ir: ir.AttentionIR
    mask_source: str | None
    score_source: str | None
    tensor_names: dict = field(repr=False)
    size_names: tuple = ()
    _factory: Callable = field(default=None, repr=False)

    def make_mods(self, sizes: dict, tensors: dict) -> tuple:
        """``(mask_mod, score_mod)`` for these sizes (``B H Q_LEN KV_LEN``, Python ints) and
        tensor values (keyed by tensor_key); ``None`` for a missing half.

        Each call returns new functions over the same code objects, so a compiled
        ``flex_attention`` does not recompile for fresh tensors of the same shape.
        """
        missing = [key for key in self.tensor_names if key not in tensors]
        if missing:
            raise BindingError("no value was given for tensor " +
                               ", ".join(f"'{key}'" for key in missing))
        absent = [name for name in self.size_names if name not in sizes]
        if absent:
            raise SpecError("no value was given for size " + ", ".join(absent))
        values = {name: int(sizes[name]) for name in self.size_names}
        values.update((ident, tensors[key]) for key, ident in self.tensor_names.items())
        return self._factory(**values)

    def source(self) -> str:
        """Both functions as one pasteable piece of Python, headed by the free names it needs."""
        lines = [f"# flexspec lowering of   mask:  {ir.to_text(self.ir.mask)}",
                 f"#                        score: {ir.to_text(self.ir.score)}"]
        free = [f"{name} (int)" for name in self.size_names]
        free += [f"{ident} (tensor '{key}')" for key, ident in self.tensor_names.items()]
        lines.append("# free names: " + (", ".join(free) if free else "none"))
        lines += ["import math", "", "import torch", "", "inf = math.inf", "", "", ""]
        parts = [s for s in (self.mask_source, self.score_source) if s is not None]
        return "\n".join(lines) + "\n\n\n".join(parts)


@functools.lru_cache(maxsize=512)
def lower(spec: ir.AttentionIR, *, dialect: str = "torch") -> Lowered:
    """The :class:`Lowered` functions of an IR in one of :data:`DIALECTS` (``"torch"``, or
    ``"cute"`` for FLASH's code generator); equal IR gives the very same object.

    The IR should already be specialized to the actual tensor shapes
    (:func:`flexspec.ir.specialize.specialize_ir`), so a broadcast tensor gives a mask without
    ``b``.
    """
    if dialect not in DIALECTS:
        raise SpecError(f"unknown dialect of the lowering '{dialect}'; dialects: "
                        f"{', '.join(DIALECTS)}")
    taken = set(_RESERVED)
    names = {}
    for t in spec.tensors():
        key = tensor_key(t)
        names[key] = _identifier(key, taken)
        taken.add(names[key])
    emitter = _Emitter(names, DIALECTS[dialect])
    mask_source = _mask_source(spec.mask, emitter) if spec.has_mask else None
    score_source = _score_source(spec.score, emitter) if spec.has_score else None
    size_names = tuple(n for n in ir.SIZE_VARS if n in emitter.used)
    used_names = {key: ident for key, ident in names.items() if ident in emitter.used}
    factory = _build_factory(mask_source, score_source, size_names, tuple(used_names.values()))
    return Lowered(spec, mask_source, score_source, types.MappingProxyType(used_names), size_names,
                   factory)


_counter = iter(range(1, 1 << 62))


def _build_factory(mask_source, score_source, size_names, tensor_idents) -> Callable:
    """Compile the sources once, inside a function whose parameters are the free names."""
    params = ", ".join(("*",) + size_names + tensor_idents) if size_names or tensor_idents else ""
    body = "".join(_indent(s) + "\n" for s in (mask_source, score_source) if s is not None)
    result = ", ".join(n if s is not None else "None"
                       for n, s in (("mask_mod", mask_source), ("score_mod", score_source)))
    text = f"def _flexspec_mods({params}):\n{body}    return {result}\n"
    # A unique file name registered with linecache, so tracebacks and dynamo show the source.
    filename = f"<flexspec-lowered-{next(_counter)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"torch": torch, "math": math, "inf": math.inf}
    exec(compile(text, filename, "exec"), namespace)
    return namespace["_flexspec_mods"]


def _indent(text: str) -> str:
    return "".join("    " + line if line.strip() else line for line in text.splitlines(True))
