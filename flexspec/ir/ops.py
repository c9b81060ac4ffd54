"""The operator table: what every operator and function of the language means, written once.

Each entry says, for one operator (:data:`OPERATORS`, keyed by its IR name: ``+``, ``neg``,
``and``...) or one function (:data:`FUNCTIONS`, keyed by name):

* its arity, which operands it takes and the type of its result (read by the checker and by
  :func:`flexspec.ir.type_of`);
* for operators, how it is spelled and how tightly it binds in the language (the AST printer and
  the IR text) and in generated Python (the lowering);
* its value on Python numbers (constant folding, size expressions, the constraint evaluator and
  interval bounds on Python floats);
* its torch function (the reference, and interval bounds on tensors), named as a string such as
  ``"torch.tanh"`` or given as a callable that receives the torch module: this module is read by
  the torch-free front end, so it never imports torch;
* how the lowering writes it in a ``mask_mod`` / ``score_mod`` (on tensors and on Python numbers);
* the name of its interval rule in :mod:`flexspec.ir.intervals` and when it can give NaN.

Adding a function to the language is adding one entry here (plus its documentation and tests),
as long as it fits the existing interval rules ("increasing", "periodic"...).

>>> FUNCTIONS["tanh"].arity, FUNCTIONS["tanh"].result
(1, 'float')
>>> OPERATORS["//"].python(-7, 2)
-4
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Union

# Binding strength in the language, loosest first; mirrors grammar/flexspec.lark.
OR, AND, NOT, COMPARE, ADD, MUL, NEG, ATOM = range(1, 9)

# Binding strength in Python, loosest first (the conditional expression is loosest of all).
(PY_COND, PY_OR, PY_AND, PY_NOT, PY_CMP, PY_BOR, PY_BAND, PY_ADD, PY_MUL, PY_UNARY, PY_POW,
 PY_ATOM) = range(12)

# A torch function: "torch.name", or a callable that receives the torch module and returns one.
TorchFn = Union[str, Callable]


def _resolve(spec: TorchFn, torch) -> Callable:
    if callable(spec):
        return spec(torch)
    target = torch
    for part in spec.split(".")[1:]:
        target = getattr(target, part)
    return target


@dataclass(frozen=True, kw_only=True)
class Op:
    """An operator of the IR (built with named fields only).

    ``operands``: ``num`` (numbers), ``int`` (numbers, and then ints only), ``bool``, or ``eq``
    (numbers, or two bools). ``result``: a type, or ``num`` for the join of the operand types.
    ``py_tensor`` / ``py_scalar``: the Python operator and its precedence when an operand is a
    tensor / when all are Python numbers. ``negation``: for a comparison, its complement on ints.
    ``float_math``: the operands become floats first (the reference's float64). ``in_shapes``:
    allowed in a tensor's declared shape (size arithmetic).
    """

    symbol: str
    arity: int
    operands: str
    result: str
    source: str
    prec: int
    python: Callable
    torch: TorchFn
    py_tensor: tuple
    interval: str
    py_scalar: tuple = ()
    negation: str = ""
    float_math: bool = False
    associative: bool = True  # comparisons do not chain: both sides bind one level tighter
    in_shapes: bool = False
    int_identity = False  # as for functions; no operator leaves its int operand unchanged

    def torch_fn(self, torch) -> Callable:
        return _resolve(self.torch, torch)

    def wants_bool(self, position: int) -> bool:
        return self.operands == "bool"

    @property
    def scalar(self) -> tuple:
        return self.py_scalar or self.py_tensor


@dataclass(frozen=True)
class Form:
    """How the lowering writes a call: ``template`` over the argument texts ``{0}, {1}...``, the
    Python precedence of the result, and the precedence each argument needs in its slot."""

    template: str
    prec: int = PY_ATOM
    arg_prec: int = PY_COND


@dataclass(frozen=True, kw_only=True)
class Function:
    """A function of the language (built with named fields only).

    ``operands``: ``num`` (every argument a number) or ``where`` (a bool, then two bools or two
    numbers). ``result``: ``num`` (join of the argument types), ``float``, ``int`` or ``where``.
    ``tensor_form`` / ``scalar_form``: the lowering's text on tensors / on Python numbers; ``None``
    where the lowering has its own rule (``where``, ``min``, ``max``, ``clamp``, ``sign`` on
    numbers), because the form depends on which arguments are tensors.
    ``float_math``: int arguments become floats first (float64 in the reference, float32 for index
    tensors in the lowering). ``int_identity``: the function leaves an int unchanged.
    ``interval``: the rule of :class:`flexspec.ir.intervals.Analyzer`; ``peak`` places the maximum
    of a ``periodic`` one (period 2*pi, minimum at ``peak + pi``). ``nan_below``: NaN for arguments
    below this; ``nan_at_inf``: NaN for infinite arguments. ``in_shapes``: allowed in a tensor's
    declared shape.
    """

    name: str
    arity: int
    operands: str
    result: str
    python: Callable
    torch: TorchFn
    interval: str
    tensor_form: Form | None = None
    scalar_form: Form | None = None
    float_math: bool = False
    int_identity: bool = False
    peak: float = 0.0
    nan_below: float | None = None
    nan_at_inf: bool = False
    in_shapes: bool = False

    def torch_fn(self, torch) -> Callable:
        return _resolve(self.torch, torch)

    def wants_bool(self, position: int) -> bool:
        return self.operands == "where" and position == 0


def result_type(rule: str, arg_types) -> str:
    """The type of an operator's or function's result from its rule and its argument types."""
    arg_types = tuple(arg_types)
    if rule == "where":
        branches = arg_types[1:]
        if branches == ("bool", "bool"):
            return "bool"
        rule, arg_types = "num", branches
    if rule == "num":
        return "float" if "float" in arg_types else "int"
    return rule


# ---------------------------------------------------------------------------------------------
# Operators


def _arith(symbol, prec, python, torch, interval, operands="num", result="num", **more) -> Op:
    return Op(symbol=symbol, arity=2, operands=operands, result=result, source=symbol,
              prec=prec, python=python, torch=torch,
              py_tensor=(symbol, PY_ADD if prec == ADD else PY_MUL), interval=interval,
              in_shapes=True, **more)


def _compare(symbol, python, torch, negation, operands="num") -> Op:
    return Op(symbol=symbol, arity=2, operands=operands, result="bool", source=symbol,
              prec=COMPARE, python=python, torch=torch, py_tensor=(symbol, PY_CMP),
              interval="compare", negation=negation, associative=False)


def _all(*values):
    return all(values)


def _any(*values):
    return any(values)


def _floor_divide(torch):
    return lambda a, b: torch.div(a, b, rounding_mode="floor")


_OPERATOR_LIST = [
    _arith("+", ADD, operator.add, "torch.add", "add"),
    _arith("-", ADD, operator.sub, "torch.sub", "sub"),
    _arith("*", MUL, operator.mul, "torch.mul", "mul"),
    _arith("/", MUL, operator.truediv, "torch.true_divide", "div", result="float",
           float_math=True),
    _arith("//", MUL, operator.floordiv, _floor_divide, "floordiv", operands="int"),
    _arith("%", MUL, operator.mod, "torch.remainder", "mod", operands="int"),
    _compare("<", operator.lt, "torch.lt", ">="),
    _compare("<=", operator.le, "torch.le", ">"),
    _compare(">", operator.gt, "torch.gt", "<="),
    _compare(">=", operator.ge, "torch.ge", "<"),
    _compare("==", operator.eq, "torch.eq", "!=", operands="eq"),
    _compare("!=", operator.ne, "torch.ne", "==", operands="eq"),
    Op(symbol="neg", arity=1, operands="num", result="num", source="-", prec=NEG,
       python=operator.neg, torch="torch.neg", py_tensor=("-", PY_UNARY), interval="neg",
       in_shapes=True),
    Op(symbol="not", arity=1, operands="bool", result="bool", source="~", prec=NOT,
       python=operator.not_, torch="torch.logical_not", py_tensor=("~", PY_UNARY),
       interval="not", py_scalar=("not", PY_NOT)),
    # n-ary in the IR (ir.And, ir.Or); called with no operands they give their neutral element
    Op(symbol="and", arity=2, operands="bool", result="bool", source="&", prec=AND,
       python=_all, torch="torch.logical_and", py_tensor=("&", PY_BAND), interval="and",
       py_scalar=("and", PY_AND)),
    Op(symbol="or", arity=2, operands="bool", result="bool", source="|", prec=OR,
       python=_any, torch="torch.logical_or", py_tensor=("|", PY_BOR), interval="or",
       py_scalar=("or", PY_OR)),
]

OPERATORS: dict[str, Op] = {op.symbol: op for op in _OPERATOR_LIST}

# The language's spelling of an operator -> its entry (the AST keeps the source symbols).
BINARY_SOURCE: dict[str, Op] = {op.source: op for op in _OPERATOR_LIST if op.arity == 2}
UNARY_SOURCE: dict[str, Op] = {op.source: op for op in _OPERATOR_LIST if op.arity == 1}

ARITH_OPS = tuple(op.symbol for op in _OPERATOR_LIST if op.prec in (ADD, MUL))
COMPARE_OPS = tuple(op.symbol for op in _OPERATOR_LIST if op.prec == COMPARE)


# ---------------------------------------------------------------------------------------------
# Functions


def _sign(x):
    return (x > 0) - (x < 0)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0  # exp(700+) overflows a float


def _clamp(x, lo, hi):
    return min(max(x, lo), hi)


def _where(cond, a, b):
    return a if cond else b


def _clamp_torch(torch):
    # min(max()) rather than torch.clamp, which wants its bounds to be numbers or same-typed
    return lambda x, lo, hi: torch.minimum(torch.maximum(x, lo), hi)


def _rounding(name, python) -> Function:
    return Function(name=name, arity=1, operands="num", result="int", python=python,
                    torch=f"torch.{name}", interval="round",
                    tensor_form=Form(f"torch.{name}({{0}}).to(torch.int64)"),
                    scalar_form=Form(f"math.{name}({{0}})"), int_identity=True)


def _float_fn(name, python, scalar_form: Form | None = None, interval="increasing",
              **more) -> Function:
    """A float function of one number: ``torch.name`` on tensors, ``math.name`` on numbers."""
    return Function(name=name, arity=1, operands="num", result="float", python=python,
                    torch=f"torch.{name}", interval=interval,
                    tensor_form=Form(f"torch.{name}({{0}})"),
                    scalar_form=scalar_form or Form(f"math.{name}({{0}})"), float_math=True,
                    **more)


# On Python numbers (expressions of sizes only) the lowering writes these functions so that they
# give what torch gives, NaN or an infinity, where Python's math raises (log(-1), sqrt(-1),
# exp(1000), sin(inf)): a conditional expression, which dynamo folds like any constant.
_EXP_LIMIT = 709.782712893384  # the largest x whose math.exp(x) does not overflow


def _ieee(template: str, arg_prec: int = PY_ADD) -> Form:
    return Form(template, PY_COND, arg_prec)


def _ieee_log(name: str, pole: int) -> Form:
    """``name`` (log, log2, log1p): -inf at ``pole``, NaN below it (and for NaN)."""
    return _ieee(f"math.{name}({{0}}) if {{0}} > {pole} else -math.inf if {{0}} == {pole} "
                 "else math.nan")


_FUNCTION_LIST = [
    Function(name="abs", arity=1, operands="num", result="num", python=abs, torch="torch.abs",
             interval="abs", tensor_form=Form("torch.abs({0})"), scalar_form=Form("abs({0})")),
    Function(name="sign", arity=1, operands="num", result="num", python=_sign,
             torch="torch.sign", interval="increasing", tensor_form=Form("torch.sign({0})")),
    Function(name="min", arity=2, operands="num", result="num", python=min,
             torch="torch.minimum", interval="min", in_shapes=True),
    Function(name="max", arity=2, operands="num", result="num", python=max,
             torch="torch.maximum", interval="max", in_shapes=True),
    Function(name="clamp", arity=3, operands="num", result="num", python=_clamp,
             torch=_clamp_torch, interval="clamp"),
    Function(name="where", arity=3, operands="where", result="where", python=_where,
             torch="torch.where", interval="where"),
    _rounding("floor", math.floor),
    _rounding("ceil", math.ceil),
    _float_fn("tanh", math.tanh),
    _float_fn("exp", math.exp, _ieee(f"math.inf if {{0}} > {_EXP_LIMIT!r} else math.exp({{0}})")),
    _float_fn("exp2", lambda x: 2.0 ** x, _ieee("math.inf if {0} >= 1024 else 2.0 ** {0}", PY_UNARY)),
    _float_fn("log", math.log, _ieee_log("log", 0), nan_below=0.0),
    _float_fn("log2", math.log2, _ieee_log("log2", 0), nan_below=0.0),
    _float_fn("log1p", math.log1p, _ieee_log("log1p", -1), nan_below=-1.0),
    _float_fn("sqrt", math.sqrt, _ieee("math.sqrt({0}) if {0} >= 0 else math.nan"),
              nan_below=0.0),
    _float_fn("sigmoid", _sigmoid,
              _ieee("0.0 if {0} < -700 else 1.0 / (1.0 + math.exp(-{0}))",
                    PY_UNARY)),
    _float_fn("erf", math.erf),
    _float_fn("sin", math.sin, _ieee("math.sin({0}) if math.isfinite({0}) else math.nan"),
              interval="periodic", peak=math.pi / 2, nan_at_inf=True),
    _float_fn("cos", math.cos, _ieee("math.cos({0}) if math.isfinite({0}) else math.nan"),
              interval="periodic", peak=0.0, nan_at_inf=True),
]

FUNCTIONS: dict[str, Function] = {fn.name: fn for fn in _FUNCTION_LIST}
