"""Name resolution, kind and type checking, and inlining: syntax tree -> IR.

A spec expression is checked against a :class:`~flexspec.lang.definitions.Scope`. Every name is
resolved (with "did you mean" suggestions), calls are matched to parameters (positional, keyword,
defaults; types and constraints checked), definitions are inlined, and the result is one
:class:`~flexspec.ir.AttentionIR`. Definitions are also checked on their own, with symbolic
parameters, so an ``.attn`` file reports errors in definitions that no spec uses yet.

Pure Python; no torch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from flexspec import ir
from flexspec.ir import ops
from flexspec.lang import ast
from flexspec.lang.definitions import CALL_ARGUMENTS, Definition, ParamSpec, Scope
from flexspec.lang.runnable import check_constants, check_runnable
from flexspec.lang.expressions import (INDEX_NAMES, LOGIC, SIZE_NAMES, ExpressionChecker,
                                       describe, type_name)
from flexspec.errors import SpecCheckError, did_you_mean
from flexspec.lang.ast import format_node
from flexspec.ir.simplify import simplify
from flexspec.limits import MAX_INLINED_NODES, MAX_IR_DEPTH

class Oversized(SpecCheckError):
    """A spec or definition that expands beyond :data:`~flexspec.limits.MAX_INLINED_NODES`."""


RESERVED = INDEX_NAMES | SIZE_NAMES | {"score"} | set(ir.FUNCTIONS) | {"alibi_slopes", "learnable"}


@dataclass(frozen=True)
class SpecValue:
    """What a spec expression (or part of one) denotes: an optional mask and a score pipeline.

    ``kind`` is ``mask`` (mask only), ``score`` (score modifiers only) or ``spec`` (both).
    """

    kind: str
    mask: ir.Expr = ir.TRUE
    score: ir.Expr = ir.SCORE


class Checker(ExpressionChecker):
    """Resolves names in one scope. Keeps the stack of definitions being inlined (for cycles).
    Definition expressions are checked by the methods of :class:`ExpressionChecker`."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.stack: list[str] = []
        self.learnables: dict[str, int] = {}  # base name -> uses so far
        self.align: ir.Align = "start"  # "end" once a definition aligned at the end is used
        self.inlined = 0  # IR nodes written by inlining so far (see MAX_INLINED_NODES)

    # ------------------------------------------------------------------------------------------
    # spec expressions

    def spec(self, node: ast.Node) -> SpecValue:
        if isinstance(node, ast.Chain):
            return self._chain(node)
        if isinstance(node, ast.Binary) and node.op in ("&", "|"):
            left, right = self._mask_operand(node.left, node), self._mask_operand(node.right, node)
            combine = LOGIC[ops.BINARY_SOURCE[node.op].symbol]
            return SpecValue("mask", mask=combine((left, right)))
        if isinstance(node, ast.Unary) and node.op == "~":
            return SpecValue("mask", mask=ir.Unary("not", self._mask_operand(node.operand, node)))
        if isinstance(node, (ast.Name, ast.Call)):
            return self._spec_reference(node)
        raise SpecCheckError(f"'{describe(node)}' is not a pattern; a spec combines named "
                             "patterns such as 'causal & window(128) + alibi'", node.span)

    def _mask_operand(self, node: ast.Node, parent: ast.Node) -> ir.Expr:
        value = self.spec(node)
        if value.kind != "mask":
            op = {"&": "'&'", "|": "'|'"}.get(getattr(parent, "op", ""), "'~'")
            if value.kind == "score":
                hint = f"e.g. 'causal + {describe(node)}'"
            else:  # `(causal + alibi) & window(3)`: the masks go first, the scores after them
                hint = "after the masks, e.g. 'causal & window(128) + alibi'"
            what = "a score modifier" if value.kind == "score" else "a spec with score modifiers"
            raise SpecCheckError(
                f"'{describe(node)}' is {what}, so it cannot be combined with {op}; "
                f"score modifiers join a spec with '+', {hint}", node.span)
        return value.mask

    def _chain(self, node: ast.Chain) -> SpecValue:
        mask, mask_node, score = None, None, ir.SCORE
        for term in node.terms:
            value = self.spec(term)
            if value.kind in ("mask", "spec"):
                if mask is not None:
                    raise SpecCheckError(
                        f"a spec has at most one mask term, but '{describe(mask_node)}' and "
                        f"'{describe(term)}' are both masks; combine masks with '&': "
                        f"'{describe(mask_node)} & {describe(term)}'", term.span)
                mask, mask_node = value.mask, term
            if value.kind in ("score", "spec"):
                score = ir.substitute(value.score, {"score": score})
        return SpecValue("spec" if mask is not None and score != ir.SCORE else
                         ("mask" if mask is not None else "score"),
                         mask=mask if mask is not None else ir.TRUE, score=score)

    def _spec_reference(self, node: ast.Name | ast.Call) -> SpecValue:
        name = node.name if isinstance(node, ast.Name) else node.func
        definition = self._lookup(name, node)
        if definition.kind == "spec":
            if isinstance(node, ast.Call):
                raise SpecCheckError(f"'{name}' is a named spec and takes no arguments", node.span)
            with self._inlining(definition, node):
                return self.spec(definition.body)
        args = node.args if isinstance(node, ast.Call) else ()
        env = self._bind(definition, args, node, spec_level=True)
        with self._inlining(definition, node):
            body = self._definition_body(definition, env)
        self._count_inlined(body, definition, node)
        if definition.kind == "mask":
            return SpecValue("mask", mask=body)
        return SpecValue("score", score=body)

    def _lookup(self, name: str, node: ast.Node) -> Definition:
        definition = self.scope.lookup(name)
        if definition is None:
            if name in RESERVED:
                raise SpecCheckError(f"'{name}' is a built-in name of the definition language, "
                                     "not a pattern", node.span)
            hint = did_you_mean(name, self.scope.names())
            raise SpecCheckError(f"unknown pattern '{name}'.{hint}", node.span)
        return definition

    # ------------------------------------------------------------------------------------------
    # definitions

    @contextlib.contextmanager
    def _inlining(self, definition: Definition, node: ast.Node):
        """Marks ``definition`` as being inlined; entering it again is a cycle; a definition
        already found too large (:meth:`_count_inlined`) fails at once."""
        oversized = self.scope.oversized.get(definition.name)
        if oversized is not None:
            raise oversized
        if definition.name in self.stack:
            cycle = self.stack[self.stack.index(definition.name):] + [definition.name]
            raise SpecCheckError("definitions refer to each other in a cycle: "
                                 + " -> ".join(cycle), node.span)
        self.stack.append(definition.name)
        if definition.align == "end":
            self.align = "end"
        try:
            yield
        except Oversized as error:
            self.scope.oversized.setdefault(definition.name, error)
            raise
        finally:
            self.stack.pop()

    def _count_inlined(self, body: ir.Expr, definition: Definition, node: ast.Node) -> None:
        """Each use of a definition is a copy of its body: ``m2 = m1 & m1`` doubles, so a few
        lines can expand beyond any pass's reach. Stop once the copies exceed the budget."""
        self.inlined += ir.size(body)
        if self.inlined > MAX_INLINED_NODES:
            path = " -> ".join(self.stack + [definition.name])
            error = Oversized(
                f"the spec expands to more than {MAX_INLINED_NODES} operators when its "
                f"definitions are inlined (every use of a definition is a copy of it; reached "
                f"inlining {path}): use large definitions once each rather than several times "
                "in a chain", node.span)
            raise error

    def _definition_body(self, definition: Definition, env: dict) -> ir.Expr:
        local = dict(env)
        if definition.kind == "score":
            local.setdefault("score", ir.SCORE)
        body = self.expr(definition.body, local, definition)
        expected = "bool" if definition.kind == "mask" else None
        if expected == "bool" and body.type != "bool":
            raise SpecCheckError(f"mask '{definition.name}' must be a boolean expression, but its "
                                 f"definition is {type_name(body.type)}", definition.body.span)
        if definition.kind == "score" and body.type not in ("int", "float"):
            raise SpecCheckError(f"score '{definition.name}' must be a number, but its definition "
                                 f"is {type_name(body.type)}", definition.body.span)
        return body

    def check_definition(self, definition: Definition) -> None:
        """Check a definition on its own, with its parameters left symbolic."""
        if definition.kind == "spec":
            with self._inlining(definition, definition.body):
                self.spec(definition.body)
            return
        env = {}
        for param in definition.params:
            if param.name in RESERVED:
                raise SpecCheckError(f"parameter name '{param.name}' is reserved (an index, size "
                                     "or function of the language)", param.span)
            if param.is_tensor:
                dims = tuple(self._dim(d, env, definition) for d in param.dims)
                env[param.name] = ir.Param(param.name, param.type, dims)
            else:
                env[param.name] = ir.Param(param.name, param.type)
            if param.default is not None:
                self._check_argument(definition, param, self._default(definition, param, env),
                                     param.default)
        # constraints see every parameter, as they do when a call is checked
        for param in definition.params:
            if param.constraint is not None:
                constraint = self._constraint(param, env, definition)
                if constraint.type != "bool":
                    raise SpecCheckError(f"the constraint of '{param.name}' must be a boolean "
                                         "expression", param.constraint.span)
        self._check_default_constraints(definition, env)
        with self._inlining(definition, definition.body):
            check_constants(simplify(self._definition_body(definition, env)), definition.body.span)

    def _check_default_constraints(self, definition: Definition, symbolic: dict) -> None:
        """A literal default must meet its parameter's constraint: with every literal default in
        place (the other parameters symbolic), no constraint of a defaulted parameter may
        simplify to false."""
        env = dict(symbolic)
        for param in definition.params:
            if not param.is_tensor and isinstance(param.default, (ast.Int, ast.Float, ast.Bool)):
                env[param.name] = self._default(definition, param, env)
        for param in definition.params:
            if param.constraint is None or param.name not in env or param.default is None \
                    or isinstance(env[param.name], ir.Param):
                continue
            if simplify(self._constraint(param, dict(env), definition)) == ir.FALSE:
                raise SpecCheckError(
                    f"the default of '{param.name}' ({format_node(param.default)}) breaks its "
                    f"constraint {format_node(param.constraint)}; change one of them",
                    param.default.span or param.constraint.span or param.span)

    # ------------------------------------------------------------------------------------------
    # argument binding

    def _bind(self, definition: Definition, args: tuple, call: ast.Node, *, spec_level: bool,
              env: dict | None = None, context: Definition | None = None) -> dict:
        """Match a call's arguments to the definition's parameters -> {param name: IR value}."""
        params = definition.params
        by_name = {p.name: p for p in params}
        given: dict[str, tuple[ast.Node, ir.Expr]] = {}
        seen_keyword = False
        for position, arg in enumerate(args):
            if isinstance(arg, ast.Keyword):
                seen_keyword = True
                if arg.name not in by_name:
                    hint = did_you_mean(arg.name, by_name)
                    raise SpecCheckError(f"'{definition.name}' has no parameter '{arg.name}'."
                                         f"{hint} It takes {definition.signature()}", arg.span)
                if arg.name in given:
                    raise SpecCheckError(f"argument '{arg.name}' given twice", arg.span)
                param, value_node = by_name[arg.name], arg.value
            else:
                if seen_keyword:
                    raise SpecCheckError("a positional argument cannot follow a keyword argument",
                                         arg.span)
                if position >= len(params):
                    count = len(params)
                    takes = "no arguments" if count == 0 else (
                        f"{count} argument{'s' if count != 1 else ''}: {definition.signature()}")
                    raise SpecCheckError(f"'{definition.name}' takes {takes}, but "
                                         f"{len(args)} {'was' if len(args) == 1 else 'were'} "
                                         "given", arg.span)
                param, value_node = params[position], arg
                if param.name in given:
                    raise SpecCheckError(f"argument '{param.name}' given twice", arg.span)
            value = self._argument(param, value_node, spec_level, env, context)
            given[param.name] = (value_node, value)

        bound: dict[str, ir.Expr] = {}
        for param in params:
            if param.name in given:
                node, value = given[param.name]
                if param.is_tensor and isinstance(value, ir.Tensor) and value.origin == "binding" \
                        and not value.shape:
                    value = self._binding(param, value.name, bound, definition, node.span)
                self._check_argument(definition, param, value, node)
                if param.type == "float" and not param.is_tensor and value.type == "int":
                    value = _to_float(value)
            elif param.default is not None:
                value = self._default(definition, param, bound)
            elif param.is_tensor:
                value = self._binding(param, param.name, bound, definition, call.span)
            else:
                raise SpecCheckError(f"'{definition.name}' needs a value for '{param.name}' "
                                     f"({param.type}): write {definition.signature()}", call.span)
            bound[param.name] = value
        for param in params:
            if param.constraint is not None and param.name in given:
                self._check_constraint(definition, param, bound, given[param.name][0])
        return bound

    def _argument(self, param: ParamSpec, node: ast.Node, spec_level: bool, env, context) -> ir.Expr:
        if param.is_tensor and isinstance(node, ast.Name):
            if env is not None and node.name in env:
                return env[node.name]
            # A bare identifier names a runtime tensor binding; its shape is filled in by _bind.
            return ir.Tensor(node.name, (), param.type)
        if spec_level:
            if isinstance(node, ast.Name):
                raise SpecCheckError(
                    f"'{node.name}' is a bare name, which in a spec names a runtime tensor, but "
                    f"'{param.name}' is {type_name(param.type)} parameter; pass a literal such "
                    f"as {_example_literal(param.type)}", node.span)
            return self._literal(node, param)
        return self.expr(node, env or {}, context)

    def _literal(self, node: ast.Node, param: ParamSpec) -> ir.Expr:
        if isinstance(node, ast.Bool):
            return ir.Const(node.value)
        if isinstance(node, ast.Int):
            return ir.Const(node.value)
        if isinstance(node, ast.Float):
            return ir.Const(node.value)
        what = "a string" if isinstance(node, ast.Str) else f"'{describe(node)}'"
        raise SpecCheckError(f"'{param.name}' expects {type_name(param.type if not param.is_tensor else 'tensor')}, "
                             f"got {what}", node.span)

    def _check_argument(self, definition: Definition, param: ParamSpec, value: ir.Expr,
                        node: ast.Node) -> None:
        got = value.type
        if param.is_tensor:
            if got != "tensor":
                raise SpecCheckError(f"'{param.name}' of '{definition.name}' expects a tensor "
                                     f"({param.signature()}), got {type_name(got)}", node.span)
            return
        ok = got == param.type or (param.type == "float" and got == "int")
        if not ok:
            raise SpecCheckError(f"'{param.name}' of '{definition.name}' expects "
                                 f"{type_name(param.type)}, got {type_name(got)}"
                                 f" ({describe(node)})", node.span)

    def _check_constraint(self, definition: Definition, param: ParamSpec, bound: dict,
                          node: ast.Node) -> None:
        constraint = simplify(self._constraint(param, dict(bound), definition))
        if constraint == ir.FALSE:
            value = simplify(bound[param.name])
            raise SpecCheckError(f"'{definition.name}' requires {format_node(param.constraint)}, "
                                 f"but {param.name} = {value}", node.span)

    def _constraint(self, param: ParamSpec, env: dict, definition: Definition) -> ir.Expr:
        """A parameter's constraint, a condition on the parameters decided when a call binds
        them: an index (q, kv, b, h) or the score, read directly or through a pattern, has no
        value then, so such a constraint could never fail and is refused."""
        constraint = self.expr(param.constraint, env, definition)
        read = sorted(ir.free_vars(constraint) - set(ir.SIZE_VARS))
        if read:
            raise SpecCheckError(
                f"the constraint of '{param.name}' can read only the sizes "
                f"{', '.join(ir.SIZE_VARS)} and parameters, but it reads "
                f"{', '.join(repr(n) for n in read)}", param.constraint.span)
        return constraint

    def _default(self, definition: Definition, param: ParamSpec, bound: dict) -> ir.Expr:
        node = param.default
        if param.is_tensor and isinstance(node, ast.Call) and node.func in ("alibi_slopes", "learnable"):
            return self._tensor_builtin(definition, param, node, bound)
        value = self.expr(node, dict(bound), definition)
        if param.type == "float" and value.type == "int":
            value = _to_float(value)
        return value

    def _dim(self, node: ast.Node, env: dict, definition: Definition) -> ir.Expr:
        value = simplify(self.expr(node, env, definition))
        if value.type != "int":
            raise SpecCheckError(f"a tensor dimension must be an int expression, got "
                                 f"{type_name(value.type)}", node.span)
        # an index (q, kv, b, h) or the score, read here directly or through a pattern, has no
        # value when the tensor's shape is fixed
        read = sorted(ir.free_vars(value) - set(ir.SIZE_VARS))
        if read:
            raise SpecCheckError(
                f"a tensor dimension can read only the sizes {', '.join(ir.SIZE_VARS)} and "
                f"parameters, but this one reads {', '.join(repr(n) for n in read)}; "
                "write the shape with sizes, e.g. float[KV_LEN]", node.span)
        return value

    def _binding(self, param: ParamSpec, name: str, bound: dict, definition: Definition,
                 span=None) -> ir.Tensor:
        if name in CALL_ARGUMENTS:
            raise SpecCheckError(
                f"'{name}' cannot name the runtime tensor '{param.name}' of '{definition.name}': "
                f"every call takes an argument of that name ({', '.join(CALL_ARGUMENTS[1:])}); "
                f"bind it under another name, e.g. {definition.name}({param.name}=my_{name})",
                span)
        dims = tuple(self._dim(d, dict(bound), definition) for d in param.dims)
        return ir.Tensor(name, dims, param.type, "binding")

    def _tensor_builtin(self, definition, param, node: ast.Call, bound: dict) -> ir.Tensor:
        dims = tuple(self._dim(d, dict(bound), definition) for d in param.dims)
        positional = [a for a in node.args if not isinstance(a, ast.Keyword)]
        keywords = {a.name: a for a in node.args if isinstance(a, ast.Keyword)}
        if node.func == "alibi_slopes":
            if len(positional) != 1 or keywords:
                raise SpecCheckError("alibi_slopes takes one argument, the number of heads: "
                                     "alibi_slopes(H)", node.span)
            heads = self._dim(positional[0], dict(bound), definition)
            return ir.Tensor("alibi_slopes", (heads,), "float", "builtin", "alibi_slopes", (heads,))
        init = "zeros"
        for key, kw in keywords.items():
            if key != "init" or not isinstance(kw.value, ast.Str) or kw.value.value not in ("zeros", "normal"):
                raise SpecCheckError('learnable takes dims and optionally init="zeros" or '
                                     'init="normal"', kw.span)
            init = kw.value.value
        shape = tuple(self._dim(d, dict(bound), definition) for d in positional)
        if len(shape) != len(dims):
            raise SpecCheckError(f"learnable() gives {len(shape)} dims but '{param.name}' "
                                 f"declares {len(dims)}", node.span)
        # every use of a learnable default is its own table: rel_bias_table, rel_bias_table_2...
        base = f"{definition.name}_{param.name}"
        self.learnables[base] = self.learnables.get(base, 0) + 1
        name = base if self.learnables[base] == 1 else f"{base}_{self.learnables[base]}"
        return ir.Tensor(name, shape, param.type, "learnable", init=init)

    # ------------------------------------------------------------------------------------------
    # inlining a definition used inside another

    def _inline(self, target: Definition, args: tuple, node: ast.Node, env: dict,
                definition: Definition | None) -> ir.Expr:
        if target.kind == "spec":
            raise SpecCheckError(f"'{target.name}' is a named spec; definitions can use masks and "
                                 "score modifiers but not specs", node.span)
        if target.kind == "score" and (definition is None or definition.kind != "score"):
            raise SpecCheckError(f"'{target.name}' is a score modifier and can only be used in "
                                 "score definitions", node.span)
        bound = self._bind(target, args, node, spec_level=False, env=env, context=definition)
        with self._inlining(target, node):
            body = self._definition_body(target, bound)
        self._count_inlined(body, target, node)
        if target.kind == "score":
            body = ir.substitute(body, {"score": env.get("score", ir.SCORE)})
        return body


def _to_float(value: ir.Expr) -> ir.Expr:
    """An int argument of a float parameter, as a float (``softcap(30)`` is ``softcap(30.0)``)."""
    if isinstance(value, ir.Const):
        return ir.Const(float(value.value))
    return ir.Binary("*", value, ir.Const(1.0))


def _example_literal(type_name: str) -> str:
    return {"int": "128", "float": "30.0", "bool": "true"}.get(type_name, "a value")


def check_spec(node: ast.Node, scope: Scope) -> ir.AttentionIR:
    """Resolve a spec expression into its IR (simplified), raising :class:`SpecCheckError`."""
    try:
        checker = Checker(scope)
        value = checker.spec(node)
        result = ir.AttentionIR(mask=simplify(value.mask), score=simplify(value.score),
                                align=checker.align)
    except RecursionError:
        raise SpecCheckError(_TOO_DEEP, node.span) from None
    check_result(result, node)
    return result


def check_result(result: ir.AttentionIR, node: ast.Node) -> None:
    """The checks of a whole spec's IR (``node`` is the spec, for the error's place): depth,
    bindings used with one shape each, constants the kernels can hold. :func:`check_spec` runs
    them, and so does whoever builds a spec's IR by rewriting others (``lang.api.with_mask``)."""
    levels = max(ir.depth(result.mask), ir.depth(result.score))
    if levels > MAX_IR_DEPTH:
        # every later pass (equality, hashing, the lowering, the printer) recurses over the IR
        raise SpecCheckError(f"{_TOO_DEEP} ({levels} levels of operators after inlining; at "
                             f"most {MAX_IR_DEPTH})", node.span)
    _check_bindings_agree(result, node)
    check_runnable(result, node)


def _check_bindings_agree(result: ir.AttentionIR, node: ast.Node) -> None:
    shapes: dict[str, ir.Tensor] = {}
    for tensor in result.tensors():
        if tensor.origin != "binding":
            continue
        other = shapes.setdefault(tensor.name, tensor)
        if other != tensor:
            raise SpecCheckError(
                f"the binding '{tensor.name}' is used as {_tensor_text(other)} and as "
                f"{_tensor_text(tensor)}; give the two uses different names", node.span)


def _tensor_text(tensor: ir.Tensor) -> str:
    return f"{tensor.dtype}[{', '.join(str(d) for d in tensor.shape)}]"


def check_definition(definition: Definition, scope: Scope) -> None:
    try:
        Checker(scope).check_definition(definition)
    except RecursionError:
        raise SpecCheckError(_TOO_DEEP, definition.body.span) from None


_TOO_DEEP = ("the expression is nested too deeply (or its definitions inline each other too "
             "deeply) to check")
