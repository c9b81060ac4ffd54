"""``.attn`` files: definitions and named specs, checked against the registry.

A file holds ``mask NAME(params) = expr``, ``score NAME(params) = expr`` and ``spec NAME = spec``
statements and ``#`` comments. Its names sit in front of the registry's (a file may shadow a
pattern), may be used before they are defined, and must not form cycles.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from flexspec.lang import ast
from flexspec.lang.checker import RESERVED, check_definition, check_spec
from flexspec.lang.definitions import SCALAR_TYPES, Definition, ParamSpec, Scope
from flexspec.errors import LINE_BREAK, SpecCheckError, SpecError, SpecTypeError, did_you_mean
from flexspec.lang.parser import parse_file
from flexspec.lang.registry import registry
from flexspec.lang.spec import LibraryOrigin, Spec


def _param_spec(param: ast.Param) -> ParamSpec:
    type_ = param.type
    if type_.name == "tensor":
        if type_.dims is None:
            raise SpecCheckError(f"tensor parameter '{param.name}' needs its dims, e.g. "
                                 f"'{param.name}: float[H]'", type_.span)
        return ParamSpec(param.name, "float", type_.dims, param.default, span=param.span)
    if type_.name not in SCALAR_TYPES:
        hint = did_you_mean(type_.name, SCALAR_TYPES + ("tensor",))
        raise SpecCheckError(f"unknown type '{type_.name}'.{hint} Types are int, float, bool, "
                             "and tensors such as int[B, KV_LEN]", type_.span)
    return ParamSpec(param.name, type_.name, type_.dims, param.default, span=param.span)


def _definition(statement, origin: str) -> Definition:
    if isinstance(statement, ast.SpecDef):
        return Definition(statement.name, "spec", (), statement.expr, origin, statement.span)
    params = tuple(_param_spec(p) for p in statement.params or ())
    seen = set()
    for param, node in zip(params, statement.params or ()):
        if param.name in seen:
            raise SpecCheckError(f"parameter '{param.name}' is declared twice", node.span)
        seen.add(param.name)
    return Definition(statement.name, statement.kind, params, statement.body, origin, statement.span)


class Library:
    """The checked contents of one ``.attn`` file. ``library["name"]`` gives a named spec."""

    def __init__(self, module: ast.Module, name: str, parent: Scope | None = None,
                 path: str | None = None):
        self.name = name
        self.path = path  # the file it was read from; None for text (flexspec.loads)
        self.module = module
        errors, self.scope, spec_irs = _check_module(module, name, parent)
        if errors:
            raise errors[0]
        self.definitions = dict(self.scope.definitions)
        self.specs: dict[str, Spec] = {
            statement.name: Spec(statement.expr, spec_irs[statement.name], self.origin)
            for statement in module.statements if isinstance(statement, ast.SpecDef)}

    def __getitem__(self, name: str) -> Spec:
        if name not in self.specs:
            hint = did_you_mean(name, self.specs)
            known = ", ".join(self.specs) or "none"
            raise SpecCheckError(f"{self.name} has no spec named '{name}'.{hint} Its specs: {known}")
        return self.specs[name]

    @property
    def origin(self) -> LibraryOrigin:
        """What the specs whose names resolve here record of it (for their repr)."""
        return LibraryOrigin(self.name, self.path)

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return f"Library({self.name!r}, specs={list(self.specs)})"


def _check_module(module: ast.Module, name: str, parent: Scope | None) -> tuple:
    """``(errors, scope, spec_irs)`` of a parsed file: every error in source order, the scope of
    its definitions in front of ``parent`` (the registry by default), and the IR of each named
    spec that checked."""
    errors: list[SpecError] = []
    definitions: list[Definition] = []
    seen: dict[str, ast.Node] = {}
    for statement in module.statements:
        if statement.name in seen:
            errors.append(SpecCheckError(f"'{statement.name}' is defined twice in this file",
                                         statement.name_span))
            continue
        seen[statement.name] = statement
        if statement.name in RESERVED:
            # in a definition the name would mean the index, size or function, not this
            errors.append(SpecCheckError(f"'{statement.name}' is a built-in name of the language "
                                         "(an index, size or function); choose another name",
                                         statement.name_span))
            continue
        try:
            definitions.append(_definition(statement, name))
        except SpecError as err:
            errors.append(err)
    scope = Scope(definitions, parent=parent if parent is not None else registry().scope)
    spec_irs = {}
    for definition in definitions:
        try:
            if definition.kind == "spec":
                spec_irs[definition.name] = check_spec(definition.body, scope)
            else:
                check_definition(definition, scope)
        except SpecError as err:
            errors.append(err)
    # an error inside one definition is met again by every definition that inlines it: once
    unique = {(e.line, e.column, e.message): e for e in reversed(errors)}
    return sorted(unique.values(), key=lambda e: (e.line or 0, e.column or 0)), scope, spec_irs


def check_module(module: ast.Module, name: str = "<file>") -> list[SpecError]:
    """All errors of a parsed ``.attn`` file, in source order (empty when it is clean)."""
    return _check_module(module, name, None)[0]


def check_text(text: str, name: str = "<file>") -> list[SpecError]:
    """All errors of an ``.attn`` text (empty when it is clean), syntax errors included: after
    one, every statement is parsed on its own (see :func:`_parse_statements`)."""
    try:
        module = parse_file(text, name)
    except SpecError as err:
        statements, errors = _parse_statements(text, name)
        if not errors:  # not expected: the statements parse where the whole does not
            return [err]
        return sorted(errors + check_module(ast.Module(statements), name),
                      key=lambda e: (e.line or 0, e.column or 0))
    return check_module(module, name)


# A line that starts a statement: its keyword, its name, then `(` or `=`. (`score` alone also
# names the logit inside a definition, but never followed by a name.)
_STATEMENT_START = re.compile(r"[ \t]*(?:mask|score|spec)[ \t]+([A-Za-z_]\w*)[ \t]*[(=]")


def _parse_statements(text: str, name: str) -> tuple[list, list[SpecError]]:
    """``(statements, syntax errors)`` of a text that does not parse as a whole. An ``.attn``
    file is one statement per line (continued on the lines that follow, until the next line
    that starts one), so each such run of lines is parsed alone; positions stay those of the
    file. A statement that fails to parse poisons its name: the statements that use it are
    left unchecked too, since their errors would follow from the first one."""
    starts = [0] + [match.end() for match in LINE_BREAK.finditer(text)]
    beginnings = [(line, start) for line, start in enumerate(starts)
                  if _STATEMENT_START.match(text, start)]
    if not beginnings or beginnings[0][1] != 0:
        beginnings.insert(0, (0, 0))  # the comments (or junk) before the first statement
    statements, errors, broken = [], [], set()
    for (line, start), (_, end) in zip(beginnings, beginnings[1:] + [(None, len(text))]):
        try:
            statements.extend(parse_file(text[start:end], name, line_offset=line).statements)
        except SpecError as err:
            errors.append(err)
            match = _STATEMENT_START.match(text, start)
            if match:
                broken.add(match.group(1))
    changed = True
    while changed:  # a statement using a broken one is broken: until nothing changes
        changed = False
        for statement in list(statements):
            own = {param.name for param in getattr(statement, "params", None) or ()}
            if (_names_used(statement) - own) & broken:
                statements.remove(statement)
                broken.add(statement.name)
                changed = True
    return statements, errors


def _names_used(node) -> set[str]:
    """Every pattern, definition or variable name a statement's tree mentions."""
    found = set()
    if isinstance(node, ast.Name):
        found.add(node.name)
    elif isinstance(node, ast.Call):
        found.add(node.func)
    if isinstance(node, (list, tuple)):
        for item in node:
            found |= _names_used(item)
    elif isinstance(node, ast.Node):
        for item in dataclasses.fields(node):
            if item.name not in ("span", "name_span"):
                found |= _names_used(getattr(node, item.name))
    return found


def load_text(text: str, name: str = "<file>", path: str | None = None) -> Library:
    """Check ``.attn`` text (``name`` is what error messages call it; ``path`` the file it was
    read from, if any)."""
    if not isinstance(text, str):
        raise SpecTypeError(f"loads() takes the text of an .attn file, got {type(text).__name__}; "
                        "for a path use flexspec.load")
    return Library(parse_file(text, name), name, path=path)


loads = load_text  # the public name, as json.load / json.loads


def load(path) -> Library:
    """Load and check an ``.attn`` file."""
    if not isinstance(path, (str, os.PathLike)):
        raise SpecTypeError(f"load() takes the path of an .attn file, got {type(path).__name__}; "
                        "for .attn text use flexspec.loads")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}",
                        source_name=str(path)) from None
    return load_text(text, str(path), path=str(path))
